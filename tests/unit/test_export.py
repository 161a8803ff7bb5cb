"""Serving snapshots and updates (psframe.export): from real checkpoints, through safetensors files, and the CLI.

The oracle of a snapshot is :func:`psframe.checkpoint.load` of the same
checkpoint; the oracle of an update chain is the export of the checkpoint it
ends at. Bit for bit in both cases.

This file holds the unit tier's tests of the subject; `tests/service/test_export.py`,
`tests/cluster/test_export.py` hold the other tiers'.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F

import psframe
import psframe.checkpoint
from psframe.checkpoint import files as cio
from psframe.checkpoint.shard import OptimizerData, ShardData, VariableData
from psframe.checkpoint.tensor_file import write_tensors
from psframe.cli import main as cli_main
from psframe.errors import CheckpointError, SnapshotError
from psframe.export import (
    Snapshot,
    SnapshotUpdate,
    TableRows,
    TableUpdate,
    apply_update,
    diff_snapshots,
    export_checkpoint,
    read_snapshot,
    read_update,
    write_snapshot,
    write_update,
)
from tests.conftest import free_cluster

DIM = 4
INIT = psframe.RowInitializer(std=0.3, seed=11)
MAX_ROWS = 5  # per ps task: ids come faster than that, so rows are evicted between checkpoints
TRAIN_STEPS = 12
SAVE_EVERY = 3
SUBPROCESS_TIMEOUT_S = 120


class Feed(torch.nn.Module):
    """A dynamic table of users, a fixed table of items (nn.Embedding(sparse=True)) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = psframe.DynamicEmbedding(DIM, initializer=INIT, max_rows=MAX_ROWS)
        self.items = torch.nn.Embedding(10, DIM, sparse=True)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(users).mean(1), self.items(items)], 1)).squeeze(1)


def batch(step: int):
    """Users from a window that slides over hashed-looking ids (old ones fall out, some come back), items, targets."""
    g = torch.Generator().manual_seed(step)
    window = torch.arange(2 * step, 2 * step + 8)
    users = window[torch.randint(0, 8, (6, 3), generator=g)] * 0x9E3779B1 - 2**40
    return users, torch.randint(0, 10, (6,), generator=g), torch.rand(6, generator=g)


@dataclasses.dataclass(frozen=True)
class Run:
    checkpoint_dir: str
    steps: list[int]  # the steps of its checkpoints, ascending
    users_seen: int  # distinct user ids trained on


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Run:
    """A real run on two ps tasks in this process, with a checkpoint every SAVE_EVERY steps."""
    checkpoint_dir = str(tmp_path_factory.mktemp("export") / "ckpt")
    cluster = free_cluster(2, 1)
    servers = [psframe.Server(cluster, "ps", i, serving_processes=1) for i in range(2)]
    steps = []
    try:
        model = Feed()
        checkpointing = psframe.Checkpointing(checkpoint_dir, keep=TRAIN_STEPS)
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.5), checkpointing=checkpointing) as t:
            for step in range(TRAIN_STEPS):
                users, items, target = batch(step)
                t.step(F.mse_loss(model(users, items), target))
                if step % SAVE_EVERY == SAVE_EVERY - 1:
                    steps.append(t.save_checkpoint().step)
    finally:
        for server in servers:
            server.stop(grace=0.1)
    seen = torch.unique(torch.cat([batch(step)[0].flatten() for step in range(TRAIN_STEPS)]))
    return Run(checkpoint_dir, steps, seen.numel())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN equals itself, -0.0 differs from 0.0)."""
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def assert_same(actual: Snapshot, expected: Snapshot) -> None:
    """Same step, names and bits."""
    assert actual.step == expected.step
    assert sorted(actual.dense) == sorted(expected.dense)
    for name, value in expected.dense.items():
        assert same_bits(actual.dense[name], value), name
    assert sorted(actual.tables) == sorted(expected.tables)
    for name, table in expected.tables.items():
        assert same_bits(actual.tables[name].ids, table.ids), name
        assert same_bits(actual.tables[name].rows, table.rows), name


def snapshot_of(step: int = 3, **tables: tuple[list[int], list[list[float]]]) -> Snapshot:
    dense = {"fc.weight": torch.arange(6.0).reshape(2, 3), "fc.bias": torch.tensor([0.5, -0.5])}
    return Snapshot(step, dense, {name: rows_of(*held) for name, held in tables.items()})


def rows_of(ids: list[int], rows: list[list[float]]) -> TableRows:
    return TableRows(torch.tensor(ids, dtype=torch.int64), torch.tensor(rows, dtype=torch.float32).reshape(len(ids), 2))


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def copy_of(snapshot: Snapshot) -> Snapshot:
    return Snapshot(
        snapshot.step,
        {k: v.clone() for k, v in snapshot.dense.items()},
        {k: TableRows(t.ids.clone(), t.rows.clone()) for k, t in snapshot.tables.items()},
    )


# ---- from a real run


# ---- files


def test_a_snapshot_and_an_update_round_trip_bit_for_bit_through_a_file_and_an_fsspec_url(tmp_path, url):
    snapshot = Snapshot(
        7,
        {
            "fc.weight": torch.randn(3, 4),
            "scale": torch.tensor(2.5, dtype=torch.bfloat16),
            "odd": torch.tensor([float("nan"), -0.0, math.inf]),
            "view": torch.randn(6, 4)[::2],  # a view: saved as its own rows
        },
        {
            "users": TableRows(ids(-(2**62), -1, 0, 2**62), torch.randn(4, 2, 3)),
            "empty": TableRows(ids(), torch.zeros(0, 5)),
        },
    )
    for path in (str(tmp_path / "deep" / "snapshot.safetensors"), f"{url}/snapshot.safetensors"):
        write_snapshot(snapshot, path)
        back = read_snapshot(path)
        assert_same(back, snapshot)  # NaN and -0.0 included
    assert os.listdir(tmp_path / "deep") == ["snapshot.safetensors"]  # no temporary file left
    with safetensors.safe_open(str(tmp_path / "deep" / "snapshot.safetensors"), "pt") as f:  # any safetensors reader
        assert f.metadata()["format"] == "psframe-snapshot" and f.metadata()["step"] == "7"
        assert sorted(f.keys()) == [
            "dense/fc.weight", "dense/odd", "dense/scale", "dense/view",
            "table/empty/ids", "table/empty/rows", "table/users/ids", "table/users/rows",
        ]  # fmt: skip

    update = SnapshotUpdate(
        7, 9, {"fc.weight": torch.randn(3, 4)}, {"users": TableUpdate(rows_of([5], [[1, 2]]), ids(-1, 3))}
    )
    write_update(update, f"{url}/update.safetensors")
    back = read_update(f"{url}/update.safetensors")
    assert (back.base_step, back.step) == (7, 9) and torch.equal(back.dense["fc.weight"], update.dense["fc.weight"])
    assert torch.equal(back.tables["users"].upsert.rows, update.tables["users"].upsert.rows)
    assert torch.equal(back.tables["users"].delete, ids(-1, 3))


def write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_a_file_of_another_kind_version_or_damaged_is_refused_naming_it(tmp_path):
    good = str(tmp_path / "good.safetensors")
    write_snapshot(snapshot_of(users=([1, 4], [[1, 2], [3, 4]])), good)
    data = Path(good).read_bytes()
    other = safetensors.torch.save({"x": torch.ones(2)})
    newer = safetensors.torch.save({"x": torch.ones(2)}, {"format": "psframe-snapshot", "format_version": "3"})
    flipped = bytearray(data)
    flipped[-1] ^= 1
    cases = [
        (str(tmp_path / "missing.safetensors"), "no such file"),
        (write_bytes(tmp_path / "text", b"step,rows\n1,2\n"), "is not a safetensors file"),
        (write_bytes(tmp_path / "tiny", b"\x01"), "is not a safetensors file"),
        (write_bytes(tmp_path / "other", other), "no format in its metadata, not a psframe-snapshot file"),
        (write_bytes(tmp_path / "newer", newer), "format version '3'; this psframe reads versions \\[1, 2\\]"),
        (write_bytes(tmp_path / "flipped", bytes(flipped)), "is corrupt: the bytes after its header have sha256"),
        (write_bytes(tmp_path / "cut", data[:-9]), "is corrupt"),
    ]
    for path, message in cases:
        with pytest.raises(SnapshotError, match=message):
            read_snapshot(path)
    with pytest.raises(SnapshotError, match="is a psframe-snapshot file, not a psframe-update file"):
        read_update(good)
    write_update(SnapshotUpdate(3, 4), str(tmp_path / "update"))
    with pytest.raises(SnapshotError, match="is a psframe-update file, not a psframe-snapshot file"):
        read_snapshot(str(tmp_path / "update"))


def test_a_file_whose_tensors_are_not_the_layout_is_refused(tmp_path):
    header = {"format": "psframe-snapshot", "format_version": "1", "step": "1"}
    cases = [
        ({"weights/fc": torch.ones(2)}, "holds a tensor 'weights/fc'; a psframe-snapshot file holds dense/<name>"),
        ({"table/users/ids": ids(1, 2)}, r"lacks \['table/users/rows'\]"),
        ({"table/users/ids": ids(2, 1), "table/users/rows": torch.ones(2, 3)}, "ids must be sorted, each once"),
        ({"table/users/ids": ids(1, 2), "table/users/rows": torch.ones(3, 3)}, r"shape \[2, \.\.\.\] \(one per id\)"),
        (
            {"table/users/ids": torch.ones(2), "table/users/rows": torch.ones(2, 3)},
            "1-d int64 tensor, got torch.float32",
        ),
    ]
    for k, (tensors, message) in enumerate(cases):
        path = str(tmp_path / f"case-{k}")
        write_tensors(path, tensors, header)
        with pytest.raises(SnapshotError, match=message):
            read_snapshot(path)
    write_tensors(str(tmp_path / "nostep"), {}, {**header, "step": "soon"})
    with pytest.raises(SnapshotError, match="nostep: its metadata has no step as an int"):
        read_snapshot(str(tmp_path / "nostep"))
    update = {"format": "psframe-update", "format_version": "1", "step": "2", "base_step": "1"}
    write_tensors(str(tmp_path / "half"), {"delete/users/ids": ids(3)}, update)
    with pytest.raises(SnapshotError, match=r"names tables \['users'\] in upsert/ or in delete/ but not in both"):
        read_update(str(tmp_path / "half"))


def test_a_failed_write_leaves_the_file_there_as_it_was(tmp_path):
    path = str(tmp_path / "snapshot.safetensors")
    write_snapshot(snapshot_of(users=([1], [[1, 2]])), path)
    before = Path(path).read_bytes()
    for bad, message in (
        (
            Snapshot(4, {"z": torch.zeros(2, dtype=torch.complex128)}),
            "safetensors cannot hold tensors of torch.complex128",
        ),
        (Snapshot(4, {"s": torch.zeros(2, 2).to_sparse()}), "'dense/s' is a torch.sparse_coo tensor"),
    ):
        with pytest.raises(SnapshotError, match=message):
            write_snapshot(bad, path)
    with pytest.raises(SnapshotError, match="write_snapshot needs a Snapshot, got dict"):
        write_snapshot({"step": 4}, path)  # type: ignore[arg-type]
    assert Path(path).read_bytes() == before
    assert os.listdir(tmp_path) == ["snapshot.safetensors"]


# ---- updates


def test_deletes_apply_before_upserts_and_ids_stay_sorted():
    snapshot = snapshot_of(users=([1, 4, 9], [[1, 1], [4, 4], [9, 9]]))
    kept = copy_of(snapshot)
    update = SnapshotUpdate(
        3,
        5,
        {"fc.bias": torch.tensor([1.0, 2.0])},
        {
            # 4 is deleted and made again: it comes back with its new row; 7 was never held; 2 and 12 are new.
            "users": TableUpdate(rows_of([2, 4, 12], [[2, 2], [40, 40], [12, 12]]), ids(1, 4, 7)),
            "items": TableUpdate(rows_of([3], [[3, 3]]), ids(8)),  # a table the snapshot lacks is added
        },
    )
    after = apply_update(snapshot, update)
    assert after.step == 5
    assert after.tables["users"].ids.tolist() == [2, 4, 9, 12]
    assert after.tables["users"].rows.tolist() == [[2, 2], [40, 40], [9, 9], [12, 12]]
    assert after.tables["items"].ids.tolist() == [3]
    assert after.dense["fc.bias"].tolist() == [1.0, 2.0] and after.dense["fc.weight"] is snapshot.dense["fc.weight"]
    assert_same(snapshot, kept)  # pure: the snapshot it was given is as it was
    assert_same(apply_update(after, SnapshotUpdate(5, 6)), dataclasses.replace(after, step=6))


def test_a_diff_of_two_snapshots_applies_back_to_the_newer_one():
    old = snapshot_of(users=([1, 4, 9], [[1, 1], [4, 4], [9, 9]]))
    new = Snapshot(
        8,
        {"fc.weight": old.dense["fc.weight"], "fc.bias": torch.tensor([0.5, -0.0])},  # -0.0 differs in its bits
        {"users": rows_of([1, 9, 10], [[1, 1], [9, 9.5], [10, 10]]), "items": rows_of([2], [[2, 2]])},
    )
    update = diff_snapshots(old, new)
    assert list(update.dense) == ["fc.bias"]
    assert update.tables["users"].upsert.ids.tolist() == [9, 10] and update.tables["users"].delete.tolist() == [4]
    assert update.tables["items"].upsert.ids.tolist() == [2]
    assert_same(apply_update(old, update), new)
    same = diff_snapshots(new, new)
    assert not same.dense and not same.tables


def test_an_update_that_does_not_fit_is_refused_and_changes_nothing():
    snapshot = snapshot_of(users=([1, 4], [[1, 1], [4, 4]]))
    kept = copy_of(snapshot)
    rows = TableUpdate(rows_of([2], [[2, 2]]), ids())
    cases = [
        (SnapshotUpdate(2, 5), "goes from step 2 to step 5, but the snapshot is of step 3"),
        (SnapshotUpdate(3, 5, {"fc.gain": torch.ones(2)}), "replaces dense variable 'fc.gain', which the snapshot"),
        (
            SnapshotUpdate(3, 5, {"fc.bias": torch.ones(3)}),
            r"'fc.bias' is float32 \[2\] in the snapshot; .* float32 \[3\]",
        ),
        (SnapshotUpdate(3, 5, {"fc.bias": torch.ones(2).double()}), "the update's is float64 \\[2\\]"),
        (
            SnapshotUpdate(
                3, 5, {"fc.bias": torch.ones(2)}, {"users": TableUpdate(TableRows(ids(2), torch.ones(1, 3)), ids())}
            ),
            r"table 'users' has rows of float32 \[2\]; the update's are float32 \[3\]",
        ),
        (
            SnapshotUpdate(3, 5, {}, {"users": TableUpdate(TableRows(ids(2), torch.ones(1, 2).half()), ids())}),
            "the update's are float16",
        ),
    ]
    for update, message in cases:
        with pytest.raises(SnapshotError, match=message):
            apply_update(snapshot, update)
        assert_same(snapshot, kept)
    assert apply_update(snapshot, SnapshotUpdate(3, 5, {}, {"users": rows})).tables["users"].ids.tolist() == [1, 2, 4]


def test_malformed_records_are_refused_naming_the_field():
    cases = [
        (lambda: TableRows(ids(3, 1), torch.ones(2, 2)), "ids must be sorted, each once; 3 comes before 1"),
        (lambda: TableRows(ids(1, 1), torch.ones(2, 2)), "1 comes before 1"),
        (lambda: TableRows(ids(1), torch.ones(1)), r"rows must be a tensor of shape \[1, \.\.\.\]"),
        (lambda: TableUpdate(rows_of([1], [[1, 1]]), torch.tensor([2.0])), "delete must be a 1-d int64 tensor"),
        (lambda: SnapshotUpdate(5, 4), r"its step \(4\) is before its base_step \(5\)"),
        (lambda: Snapshot(-1), r"step \(-1\) must be an int >= 0"),
        (lambda: Snapshot(1, {"w": [1.0]}), r"dense\['w'\] must be a Tensor, got list"),  # type: ignore[dict-item]
        (lambda: Snapshot(1, {}, {"t": ids(1)}), r"tables\['t'\] must be a TableRows"),  # type: ignore[dict-item]
    ]
    for make, message in cases:
        with pytest.raises(SnapshotError, match=message):
            make()


def test_diffs_of_snapshots_of_another_model_are_refused():
    old = snapshot_of(users=([1], [[1, 1]]))
    cases = [
        (
            dataclasses.replace(old, step=2),
            "the newer snapshot \\(step 2\\) is of an earlier step than the older \\(3\\)",
        ),
        (dataclasses.replace(old, dense={"fc.weight": old.dense["fc.weight"]}), r"only in step 3: \['fc.bias'\]"),
        (dataclasses.replace(old, tables={}), r"tables \['users'\] of step 3 are not in step 3"),
        (dataclasses.replace(old, tables={"users": TableRows(ids(1), torch.ones(1, 3))}), "table 'users' has rows of"),
    ]
    for new, message in cases:
        with pytest.raises(SnapshotError, match=message):
            diff_snapshots(old, new)


# ---- filters, on a checkpoint written by hand


def commit(url: str, step: int, seen: torch.Tensor | None) -> None:
    """A one-shard checkpoint of a dense weight and a dynamic table of ids 10, 20, 30, 40 with rows of norms 1..4."""
    table_ids = ids(10, 20, 30, 40)
    rows = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    held = {
        "spec": {"distribution": "normal"},
        "ids": table_ids,
        "updated": torch.zeros(4, dtype=torch.int64),
        "updates": torch.ones(4, dtype=torch.int64),
        "clock": 1,
        **({} if seen is None else {"seen": seen}),
    }
    dense = VariableData("fc.weight", "fc.weight", "float32", (2, 2), (2, 2), 0, 0, 1, torch.eye(2))
    part = VariableData("users/part_0", "users", "float32", (4, 2), (0, 2), 0, 0, 1, rows, table=True, dynamic=held)
    shard = ShardData(step, 0, 1, OptimizerData("SGD", {"lr": 0.1}), None, (dense, part))
    cio.write_manifest(url, step, [cio.write_shard(url, step, shard)])


def test_rows_below_the_norm_or_past_the_age_are_left_out(url):
    commit(url, 5, seen=torch.tensor([1000.0, 1900.0, 1500.0, 1990.0], dtype=torch.float64))
    assert export_checkpoint(url).tables["users"].ids.tolist() == [10, 20, 30, 40]
    assert export_checkpoint(url, min_row_norm=2.0).tables["users"].ids.tolist() == [20, 30, 40]
    young = export_checkpoint(url, max_row_age_seconds=100.0, now=2000.0).tables["users"]
    assert young.ids.tolist() == [20, 40] and young.rows.tolist() == [[0.0, 2.0], [0.0, 4.0]]
    both = export_checkpoint(url, min_row_norm=2.5, max_row_age_seconds=100.0, now=2000.0)
    assert both.tables["users"].ids.tolist() == [40] and torch.equal(both.dense["fc.weight"], torch.eye(2))
    for kwargs, message in (
        ({"min_row_norm": -1.0}, r"min_row_norm \(-1.0\) must be a number >= 0"),
        ({"max_row_age_seconds": math.nan}, r"max_row_age_seconds \(nan\) must be a number >= 0"),
        ({"min_row_norm": True}, r"min_row_norm \(True\) must be a number >= 0"),
        ({"now": "noon"}, r"now \('noon'\) must be a number of seconds since the epoch"),
    ):
        with pytest.raises(SnapshotError, match=message):
            export_checkpoint(url, **kwargs)


def test_the_age_filter_refuses_a_checkpoint_saved_before_rows_were_timed(url):
    commit(url, 5, seen=None)
    assert export_checkpoint(url, min_row_norm=2.0).tables["users"].ids.tolist() == [20, 30, 40]
    with pytest.raises(SnapshotError, match="table 'users' of checkpoint .* has no times its rows were last used"):
        export_checkpoint(url, max_row_age_seconds=60.0)


def test_an_unknown_step_or_no_checkpoint_is_a_checkpoint_error(url):
    with pytest.raises(CheckpointError, match="no valid checkpoint in"):
        export_checkpoint(url)
    commit(url, 5, seen=None)
    with pytest.raises(CheckpointError, match="no committed checkpoint of step 6 in"):
        export_checkpoint(url, 6)


# ---- the command line


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["export", *argv])
    out, err = capsys.readouterr()
    return code, out, err

"""The on-disk checkpoint format: sharded, committed by a manifest, checksummed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import uuid

import fsspec
import pytest
import torch

from psframe.checkpoint import files as cio
from psframe.checkpoint import load as load_checkpoint
from psframe.checkpoint.files import CheckpointCorruptError, CheckpointError
from psframe.checkpoint.shard import OptimizerData, ShardData, SyncData, VariableData
from psframe.checkpoint.slices import assemble, slice_rows

ADAM = OptimizerData("Adam", {"lr": 0.001, "betas": (0.9, 0.999)})
SYNC = SyncData(replicas_to_aggregate=2, total_num_replicas=3, timeout_seconds=30.0)


def adam_state(value: torch.Tensor, steps: int = 3, seed: int = 0) -> dict:
    """Real torch.optim.Adam per-parameter state after a few steps on ``value``."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(value.clone())
    opt = torch.optim.Adam([p], lr=0.01, betas=(0.9, 0.999))
    for i in range(steps):
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * (i + 1)
        opt.step()
    return dict(opt.state[p])


def part(name, variable, value, full_shape, row_start=0, part_index=0, num_parts=1, state=None) -> VariableData:
    return VariableData(
        name=name,
        variable=variable,
        dtype=str(value.dtype).removeprefix("torch."),
        shape=value.shape,
        full_shape=full_shape,
        row_start=row_start,
        part_index=part_index,
        num_parts=num_parts,
        value=value,
        state={} if state is None else state,
    )


def shard(variables, global_step=7, ps_task=0, num_shards=1) -> ShardData:
    return ShardData(
        global_step=global_step, ps_task=ps_task, num_shards=num_shards, optimizer=ADAM, sync=SYNC, variables=variables
    )


def small_shard(seed: int = 0, global_step: int = 7, ps_task: int = 0, num_shards: int = 1) -> ShardData:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 3, generator=g)
    return shard(
        [part("fc.weight", "fc.weight", w, [4, 3], state=adam_state(w, seed=seed))], global_step, ps_task, num_shards
    )


def save(url, step, num_shards=2, seed=0) -> cio.Manifest:
    records = [cio.write_shard(url, step, small_shard(seed + t, step, t, num_shards)) for t in range(num_shards)]
    return cio.write_manifest(url, step, records)


def commit_raw(url, step, content) -> cio.Manifest:
    """Commit a one-shard checkpoint whose shard file holds ``content`` as torch.save writes it,
    for files write_shard would never write."""
    fs, folder = fsspec.core.url_to_fs(f"{url}/ckpt-{step:012d}")
    fs.makedirs(folder, exist_ok=True)
    name = "shard-00000-of-00001.pt"
    with fs.open(f"{folder}/{name}", "wb") as f:
        torch.save(content, f)
    data = fs.cat_file(f"{folder}/{name}")
    record = cio.ShardRecord(0, name, hashlib.sha256(data).hexdigest(), len(data), 1)
    return cio.write_manifest(url, step, [record])


def shard_path(manifest: cio.Manifest, ps_task: int):
    return fsspec.core.url_to_fs(f"{manifest.folder}/{manifest.shard(ps_task).file}")


def assert_state_equal(a: dict, b: dict):
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ---- round trip


def test_shard_round_trip_is_bit_exact_with_adam_state(url):
    w = torch.randn(5, 3, dtype=torch.float64)
    emb = torch.randn(6, 2).to(torch.bfloat16)
    counts = torch.arange(4, dtype=torch.int64)
    state = adam_state(w)
    state["extra_scalar"] = 0.5  # a Python number is per-parameter scalar state too
    original = shard(
        [
            part("fc.weight", "fc.weight", w, [5, 3], state=state),
            part("emb.weight/part_1", "emb.weight", emb, [10, 2], row_start=4, part_index=1, num_parts=2),
            part("counts", "counts", counts, [4]),
        ],
        global_step=123,
        ps_task=1,
        num_shards=2,
    )

    record = cio.write_shard(url, 42, original)
    other = cio.write_shard(url, 42, small_shard(ps_task=0, num_shards=2))
    manifest = cio.write_manifest(url, 42, [record, other])
    loaded = cio.read_shard(manifest, 1)

    # the hash was computed while writing: it matches the bytes on disk
    fs, path = shard_path(manifest, 1)
    data = fs.cat_file(path)
    assert record.nbytes == len(data) and record.sha256 == hashlib.sha256(data).hexdigest()
    assert record.global_step == 123 and record.file == "shard-00001-of-00002.pt"

    assert isinstance(loaded, ShardData)
    assert (loaded.global_step, loaded.ps_task, loaded.num_shards) == (123, 1, 2)
    assert loaded.optimizer == ADAM and loaded.sync == SYNC
    assert [v.name for v in loaded.variables] == ["fc.weight", "emb.weight/part_1", "counts"]
    for got, want in zip(loaded.variables, original.variables):
        for key in ("variable", "dtype", "shape", "full_shape", "row_start", "part_index", "num_parts"):
            assert getattr(got, key) == getattr(want, key), key
        assert got.value.dtype == want.value.dtype
        assert torch.equal(got.value, want.value)
        assert_state_equal(got.state, want.state)
    assert loaded.variables[0].state["step"].dim() == 0
    assert loaded.variables[1].shape == (6, 2) and loaded.variables[1].full_shape == (10, 2)


def test_a_shard_on_disk_is_a_plain_dict_keyed_by_the_record_fields(url):
    manifest = cio.write_manifest(url, 1, [cio.write_shard(url, 1, small_shard())])
    fs, path = shard_path(manifest, 0)
    with fs.open(path, "rb") as f:
        content = torch.load(f, weights_only=True)
    assert type(content) is dict and content["format_version"] == cio.FORMAT_VERSION == 6
    assert set(content) == {
        "format_version",
        "global_step",
        "ps_task",
        "num_shards",
        "optimizer",
        "sync",
        "variables",
        "table_optimizer",
        "pushes",
    }
    assert content["table_optimizer"] is None and content["pushes"] is None
    assert content["optimizer"] == {
        "name": "Adam",
        "kwargs": {"lr": 0.001, "betas": (0.9, 0.999)},
        "schedule": None,
        "schedule_state": None,
    }
    assert content["sync"] == {
        "replicas_to_aggregate": 2,
        "total_num_replicas": 3,
        "timeout_seconds": 30.0,
        "fraction_to_aggregate": 0.0,
        "async_tables": [],
    }
    var = content["variables"][0]
    assert type(var) is dict and var["shape"] == [4, 3] and var["full_shape"] == [4, 3]
    assert set(var) == {
        "name",
        "variable",
        "dtype",
        "shape",
        "full_shape",
        "row_start",
        "part_index",
        "num_parts",
        "value",
        "state",
        "row_stride",
        "table",
        "dynamic",
    }
    assert (var["row_stride"], var["table"], var["dynamic"]) == (0, False, None)


def test_a_format_2_shard_from_before_tables_still_loads(url):
    w = torch.randn(4, 3)
    content = {
        "format_version": 2,
        "global_step": 9,
        "ps_task": 0,
        "num_shards": 1,
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}},
        "sync": None,
        "variables": [
            {
                "name": "fc.weight",
                "variable": "fc.weight",
                "dtype": "float32",
                "shape": [4, 3],
                "full_shape": [4, 3],
                "row_start": 0,
                "part_index": 0,
                "num_parts": 1,
                "value": w,
                "state": {},
            }
        ],
    }
    shard = cio.read_shard(commit_raw(url, 5, content), 0)
    assert shard.table_optimizer is None
    assert (shard.variables[0].row_stride, shard.variables[0].table, shard.variables[0].dynamic) == (0, False, None)
    assert torch.equal(shard.variables[0].value, w)


def test_a_format_4_shard_from_before_the_push_ledger_loads_without_one(url):
    content = dict(small_shard().to_dict(), format_version=4)
    del content["pushes"]
    shard = cio.read_shard(commit_raw(url, 3, content), 0)
    assert shard.pushes is None


def test_the_workers_pushes_travel_with_the_shard(url):
    from dataclasses import replace

    pushes = {"last_push": [7, 0, 3], "applied_steps": [5, 0, 2]}
    manifest = cio.write_manifest(url, 1, [cio.write_shard(url, 1, replace(small_shard(), pushes=pushes))])
    assert cio.read_shard(manifest, 0).pushes == pushes


def test_a_format_3_shard_from_before_dynamic_tables_still_loads(url):
    rows = torch.randn(5, 2)
    content = {
        "format_version": 3,
        "global_step": 4,
        "ps_task": 0,
        "num_shards": 1,
        "optimizer": {"name": "SGD", "kwargs": {"lr": 0.1}},
        "sync": None,
        "table_optimizer": {"name": "Adagrad", "kwargs": {"lr": 0.1}},
        "variables": [
            {
                "name": "emb.weight",
                "variable": "emb.weight",
                "dtype": "float32",
                "shape": [5, 2],
                "full_shape": [5, 2],
                "row_start": 0,
                "part_index": 0,
                "num_parts": 1,
                "value": rows,
                "state": {},
                "row_stride": 0,
                "table": True,
            }
        ],
    }
    shard = cio.read_shard(commit_raw(url, 4, content), 0)
    assert shard.variables[0].table and shard.variables[0].dynamic is None


def test_a_dynamic_part_whose_ids_do_not_match_its_rows_is_refused(url):
    rows = torch.randn(3, 2)
    held = {
        "spec": {"distribution": "normal"},
        "ids": torch.tensor([4, 9]),
        "updated": torch.zeros(2).long(),
        "updates": torch.zeros(2).long(),
        "clock": 0,
    }
    part = VariableData("t/part_0", "t", "float32", (3, 2), (0, 2), 0, 0, 1, rows, table=True, dynamic=held)
    shard = ShardData(1, 0, 1, OptimizerData("SGD", {}), None, (part,))
    with pytest.raises(CheckpointError, match="dynamic ids must be an int64 tensor of shape \\[3\\]"):
        cio.write_shard(url, 1, shard)


def test_a_format_1_shard_with_the_old_sync_key_still_loads(url):
    """Shards and manifests the previous psframe wrote: format 1, sync deadline ``timeout``."""
    w = torch.randn(4, 3)
    state = adam_state(w)
    content = {
        "format_version": 1,
        "global_step": 9,
        "ps_task": 0,
        "num_shards": 1,
        "optimizer": {"name": "Adam", "kwargs": {"lr": 0.001}},
        "sync": {"replicas_to_aggregate": 2, "total_num_replicas": 3, "timeout": 45.0},
        "variables": [
            {
                "name": "fc.weight",
                "variable": "fc.weight",
                "dtype": "float32",
                "shape": [4, 3],
                "full_shape": [4, 3],
                "row_start": 0,
                "part_index": 0,
                "num_parts": 1,
                "value": w,
                "state": state,
            }
        ],
    }
    manifest = commit_raw(url, 5, content)
    fs, path = fsspec.core.url_to_fs(f"{manifest.folder}/MANIFEST.json")
    fs.pipe_file(path, json.dumps(dict(json.loads(fs.cat_file(path)), format_version=1)).encode())

    (old,) = cio.list_checkpoints(url)
    assert old.format_version == 1 and cio.latest_valid(url) == old
    loaded = cio.read_shard(old, 0)
    assert loaded.sync == SyncData(replicas_to_aggregate=2, total_num_replicas=3, timeout_seconds=45.0)
    assert loaded.global_step == 9 and loaded.optimizer == OptimizerData("Adam", {"lr": 0.001})
    assert torch.equal(loaded.variables[0].value, w)
    assert_state_equal(loaded.variables[0].state, state)
    assert torch.equal(load_checkpoint(url)["fc.weight"], w)


def test_a_view_is_saved_without_its_whole_storage(url):
    big = torch.randn(100_000, 4)
    rows = big[10:12]  # a view into 1.6 MB of storage
    record = cio.write_shard(url, 1, shard([part("v/part_0", "v", rows, [100_000, 4], row_start=10, num_parts=9)]))
    assert record.nbytes < 100_000
    loaded = cio.read_shard(cio.write_manifest(url, 1, [record]), 0)
    assert torch.equal(loaded.variables[0].value, big[10:12])


def test_local_path_and_file_url(tmp_path):
    plain = str(tmp_path / "ckpt")
    manifest = save(plain, 7)
    folder = tmp_path / "ckpt" / "ckpt-000000000007"
    assert sorted(os.listdir(folder)) == [
        "MANIFEST.json",
        "shard-00000-of-00002.pt",
        "shard-00001-of-00002.pt",
    ]  # no temp files
    assert manifest.folder == f"{plain}/ckpt-000000000007"

    via_url = cio.list_checkpoints(f"file://{tmp_path}/ckpt/")
    assert [m.step for m in via_url] == [7]
    assert via_url[0].shards == manifest.shards
    assert cio.latest_valid(plain) == cio.list_checkpoints(plain)[0]
    for ps_task in (0, 1):
        got = cio.read_shard(via_url[0], ps_task).variables[0]
        want = small_shard(ps_task, 7).variables[0]
        assert torch.equal(got.value, want.value)
        assert_state_equal(got.state, want.state)


# ---- commit, listing, interrupted saves


def test_manifest_commits_and_list_is_ascending(url):
    assert cio.list_checkpoints(url) == []  # the directory does not even exist
    for step in (30, 5, 100):
        save(url, step)
    listed = cio.list_checkpoints(url)
    assert [m.step for m in listed] == [5, 30, 100]
    m = listed[-1]
    assert (m.url, m.num_shards, m.format_version) == (url, 2, cio.FORMAT_VERSION)
    assert m.folder == f"{url}/ckpt-000000000100"
    assert [r.ps_task for r in m.shards] == [0, 1]
    assert m.shard(1).file == "shard-00001-of-00002.pt"
    with pytest.raises(CheckpointError, match="ps task 2"):
        m.shard(2)


def test_committed_checkpoint_is_never_rewritten(url):
    save(url, 3)
    with pytest.raises(CheckpointError, match="already committed"):
        cio.write_shard(url, 3, small_shard(num_shards=2))
    cio.verify(cio.list_checkpoints(url)[0])


def test_unreadable_manifest_is_skipped_with_a_warning(url, caplog):
    save(url, 1)
    save(url, 2)
    fs, path = fsspec.core.url_to_fs(f"{url}/ckpt-000000000002/MANIFEST.json")
    fs.pipe_file(path, b"{not json")
    with caplog.at_level(logging.WARNING, logger="psframe.checkpoint.files"):
        assert [m.step for m in cio.list_checkpoints(url)] == [1]
    assert "ckpt-000000000002" in caplog.text


def test_interrupted_save_is_not_listed_and_previous_stays_usable(url):
    save(url, 10)
    cio.write_shard(url, 20, small_shard(0, 20, 0, 2))
    cio.write_shard(url, 20, small_shard(1, 20, 1, 2))
    # the chief died while writing the manifest: only its temp file is there
    fs, path = fsspec.core.url_to_fs(f"{url}/ckpt-000000000020/MANIFEST.json.tmp-{uuid.uuid4()}")
    fs.pipe_file(path, b'{"format_version": 1, "step": 20')
    assert [m.step for m in cio.list_checkpoints(url)] == [10]
    latest = cio.latest_valid(url)
    assert latest is not None and latest.step == 10
    assert torch.equal(cio.read_shard(latest, 1).variables[0].value, small_shard(1, 10).variables[0].value)


def test_latest_valid_on_nothing_is_none(url):
    assert cio.latest_valid(url) is None


# ---- damage


def _truncate(manifest, ps_task):
    fs, path = shard_path(manifest, ps_task)
    fs.pipe_file(path, fs.cat_file(path)[:-100])


def _flip_a_byte(manifest, ps_task):
    fs, path = shard_path(manifest, ps_task)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))


@pytest.mark.parametrize("damage, why", [(_truncate, "truncated"), (_flip_a_byte, "corrupt")])
def test_damaged_shard_is_detected_and_latest_valid_falls_back(url, caplog, damage, why):
    save(url, 10)
    newest = save(url, 20)
    damage(newest, 1)

    with caplog.at_level(logging.WARNING, logger="psframe.checkpoint.files"):
        latest = cio.latest_valid(url)
    assert latest is not None and latest.step == 10
    assert "ckpt-000000000020" in caplog.text and why in caplog.text

    with pytest.raises(CheckpointCorruptError) as info:
        cio.read_shard(newest, 1)
    message = str(info.value)
    assert "ckpt-000000000020/shard-00001-of-00002.pt" in message and why in message
    assert newest.shard(1).sha256 in message
    if why == "corrupt":  # same size, other bytes: both hashes are named
        fs, path = shard_path(newest, 1)
        assert hashlib.sha256(fs.cat_file(path)).hexdigest() in message
    with pytest.raises(CheckpointCorruptError):
        cio.verify(newest)
    cio.read_shard(newest, 0)  # the undamaged shard still reads
    cio.verify(latest)


def test_missing_shard_is_detected(url):
    m = save(url, 5)
    fs, path = shard_path(m, 0)
    fs.rm(path)
    with pytest.raises(CheckpointCorruptError, match="shard-00000-of-00002.pt is missing"):
        cio.read_shard(m, 0)
    assert cio.latest_valid(url) is None


class NotATensor:
    pass


def test_loads_refuse_pickled_objects(url):
    # a file that hashes right but holds an arbitrary object: weights_only refuses it
    m = commit_raw(url, 1, {"format_version": 1, "ps_task": 0, "num_shards": 1, "x": NotATensor()})
    cio.verify(m)
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        cio.read_shard(m, 0)


# ---- prune


def test_prune_keeps_newest_and_removes_old_leftovers(url):
    for step in (10, 20, 30, 40):
        save(url, step)
    for step in (15, 35, 50):  # interrupted saves; 50 may still be in progress
        cio.write_shard(url, step, small_shard(0, step, 0, 2))
    save(url, 25)
    fs, path = fsspec.core.url_to_fs(f"{url}/ckpt-000000000025/MANIFEST.json")
    fs.pipe_file(path, b"garbage")  # unreadable, so not surely garbage: kept

    assert cio.prune(url, keep=2) == [10, 15, 20, 35]

    fs, root = fsspec.core.url_to_fs(url)
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert left == [f"ckpt-{s:012d}" for s in (25, 30, 40, 50)]
    assert [m.step for m in cio.list_checkpoints(url)] == [30, 40]
    assert cio.latest_valid(url).step == 40
    assert cio.prune(url, keep=2) == []
    assert cio.prune(url, keep=1) == [30]
    with pytest.raises(CheckpointError, match="keep"):
        cio.prune(url, keep=0)


# ---- assemble and slice_rows


def three_parts() -> tuple[torch.Tensor, torch.Tensor, list[dict], list[dict]]:
    """emb.weight [10, 3] in parts of 4/3/3 rows over 2 shards, plus fc.bias."""
    emb = torch.randn(10, 3)
    bias = torch.randn(5)
    p0 = part("emb.weight/part_0", "emb.weight", emb[0:4], [10, 3], 0, 0, 3)
    p1 = part("emb.weight/part_1", "emb.weight", emb[4:7], [10, 3], 4, 1, 3)
    p2 = part("emb.weight/part_2", "emb.weight", emb[7:10], [10, 3], 7, 2, 3)
    b = part("fc.bias", "fc.bias", bias, [5])
    return emb, bias, [p0, p2], [p1, b]


def test_assemble_rebuilds_a_partitioned_variable_bit_exactly(url):
    emb, bias, shard0, shard1 = three_parts()
    records = [
        cio.write_shard(url, 1, shard(shard0, ps_task=0, num_shards=2)),
        cio.write_shard(url, 1, shard(shard1, ps_task=1, num_shards=2)),
    ]
    m = cio.write_manifest(url, 1, records)
    full = assemble([cio.read_shard(m, 1), cio.read_shard(m, 0)])
    assert set(full) == {"emb.weight", "fc.bias"}
    assert torch.equal(full["emb.weight"], emb) and torch.equal(full["fc.bias"], bias)


def test_assemble_refuses_missing_or_overlapping_rows():
    _emb, _, (p0, p2), (p1, _b) = three_parts()
    with pytest.raises(CheckpointError, match=r"rows \[4, 7\) of 'emb.weight' are in no part"):
        assemble([shard([p0, p2])])
    with pytest.raises(CheckpointError, match=r"rows \[7, 10\)"):
        assemble([shard([p0, p1])])
    overlapping = dataclasses.replace(p1, row_start=3)
    with pytest.raises(CheckpointError, match="overlap"):
        assemble([shard([p0, p2]), shard([overlapping])])
    with pytest.raises(CheckpointError, match="overlap"):  # the same part twice
        assemble([shard([p0, p2]), shard([p1]), shard([p1])])


def test_slice_rows_repartitions_value_and_state(url):
    emb = torch.randn(10, 3)
    exp_avg, exp_avg_sq = torch.randn(10, 3), torch.rand(10, 3)

    def stored(lo, hi, i, step):
        state = {"step": torch.tensor(step), "exp_avg": exp_avg[lo:hi], "exp_avg_sq": exp_avg_sq[lo:hi]}
        return part(f"emb.weight/part_{i}", "emb.weight", emb[lo:hi], [10, 3], lo, i, 2, state)

    records = [
        cio.write_shard(url, 1, shard([stored(0, 5, 0, 7.0)], ps_task=0, num_shards=2)),
        cio.write_shard(url, 1, shard([stored(5, 10, 1, 8.0)], ps_task=1, num_shards=2)),
    ]
    m = cio.write_manifest(url, 1, records)
    shards = [cio.read_shard(m, 0), cio.read_shard(m, 1)]

    for lo, hi, step in ((0, 4, 7.0), (4, 7, 7.0), (7, 10, 8.0)):
        value, state = slice_rows(shards, "emb.weight", lo, hi)
        assert torch.equal(value, emb[lo:hi]) and value.is_contiguous()
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(state["exp_avg"], exp_avg[lo:hi])
        assert torch.equal(state["exp_avg_sq"], exp_avg_sq[lo:hi])
        assert state["step"].dim() == 0 and state["step"].item() == step

    with pytest.raises(CheckpointError, match=r"rows \[5, 7\)"):
        slice_rows(shards[:1], "emb.weight", 4, 7)
    with pytest.raises(CheckpointError, match="out of range"):
        slice_rows(shards, "emb.weight", 8, 11)
    with pytest.raises(CheckpointError, match="no variable"):
        slice_rows(shards, "nope", 0, 1)


# ---- refusals


def test_write_manifest_refuses_records_that_do_not_cover_every_task_once(url):
    r0, r1, r2 = (cio.write_shard(url, 1, small_shard(t, 1, t, 3)) for t in range(3))
    with pytest.raises(CheckpointError, match=r"exactly once; got ps tasks \[0, 2\]"):
        cio.write_manifest(url, 1, [r0, r2])
    with pytest.raises(CheckpointError, match=r"got ps tasks \[0, 0, 1, 2\]"):
        cio.write_manifest(url, 1, [r0, r0, r1, r2])
    with pytest.raises(CheckpointError, match="exactly once"):
        cio.write_manifest(url, 1, [])
    assert cio.list_checkpoints(url) == []
    assert cio.write_manifest(url, 1, [r2, r0, r1]).num_shards == 3  # order does not matter


def test_write_manifest_refuses_a_shard_of_the_wrong_size(url):
    r0 = cio.write_shard(url, 1, small_shard())
    bad = cio.ShardRecord(0, r0.file, r0.sha256, r0.nbytes + 1, r0.global_step)
    with pytest.raises(CheckpointError, match="should hold"):
        cio.write_manifest(url, 1, [bad])
    assert cio.list_checkpoints(url) == []


def test_write_shard_validates_the_record_up_front(url):
    good = small_shard()
    var = good.variables[0]
    with pytest.raises(CheckpointError, match="must be a ShardData, got dict"):
        cio.write_shard(url, 1, good.to_dict())
    bad_state = dataclasses.replace(var, state={"thing": NotATensor()})
    with pytest.raises(CheckpointError, match="NotATensor"):
        cio.write_shard(url, 1, dataclasses.replace(good, variables=[bad_state]))
    wrong_shape = dataclasses.replace(var, shape=[3, 4])
    with pytest.raises(CheckpointError, match=r"'fc.weight'.*shape \[3, 4\] but value"):
        cio.write_shard(url, 1, dataclasses.replace(good, variables=[wrong_shape]))
    not_a_tensor = dataclasses.replace(var, value=[[1.0]])
    with pytest.raises(CheckpointError, match="value must be a tensor, got list"):
        cio.write_shard(url, 1, dataclasses.replace(good, variables=[not_a_tensor]))
    with pytest.raises(CheckpointError, match="names a variable twice"):
        cio.write_shard(url, 1, dataclasses.replace(good, variables=[var, var]))
    with pytest.raises(CheckpointError, match="sync must hold"):
        cio.write_shard(url, 1, dataclasses.replace(good, sync=SyncData(2, 3, "30")))
    with pytest.raises(CheckpointError, match="ps_task"):
        cio.write_shard(url, 1, dataclasses.replace(good, ps_task=2, num_shards=2))
    with pytest.raises(CheckpointError, match="step"):
        cio.write_shard(url, -1, good)
    fs, root = fsspec.core.url_to_fs(url)
    assert not fs.exists(root)  # nothing was written


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _malformed():
    """(dict as found on disk, what the error says), from a good shard's dict."""
    good = small_shard().to_dict()
    var = good["variables"][0]
    return [
        (_without(good, "variables"), r"lacks keys \['variables'\]"),
        (dict(good, variables=[_without(var, "state")]), r"'fc.weight'.*lacks keys \['state'\]"),
        (dict(good, variables=[dict(var, shape=[3, 4])]), r"'fc.weight'.*shape \[3, 4\] but value"),
        (dict(good, variables=[dict(var, value="w")]), "value must be a tensor, got str"),
        (dict(good, extra=1), r"unknown keys \['extra'\]"),
        (
            dict(good, sync=dict(_without(good["sync"], "timeout_seconds"), timeout=30.0)),
            r"sync lacks keys \['timeout_seconds'\]",
        ),  # the old key in the new format
        (dict(good, format_version=7), r"format 7; this psframe reads formats \[1, 2, 3, 4, 5, 6\]"),
        (_without(good, "format_version"), "format_version"),
        ([good], "must be a dict, got list"),
        (dict(good, ps_task=1, num_shards=2), "holds ps task 1 of 2; the manifest expects ps task 0 of 1"),
    ]


@pytest.mark.parametrize("content, message", _malformed())
def test_read_shard_names_what_is_wrong_with_a_malformed_file(url, content, message):
    manifest = commit_raw(url, 1, content)
    with pytest.raises(CheckpointError, match=message) as info:
        cio.read_shard(manifest, 0)
    assert "ckpt-000000000001/shard-00000-of-00001.pt" in str(info.value)


def test_a_manifest_of_an_unknown_format_is_skipped(url, caplog):
    save(url, 1)
    newer = save(url, 2)
    fs, path = fsspec.core.url_to_fs(f"{newer.folder}/MANIFEST.json")
    fs.pipe_file(path, json.dumps(dict(json.loads(fs.cat_file(path)), format_version=7)).encode())
    with caplog.at_level(logging.WARNING, logger="psframe.checkpoint.files"):
        assert [m.step for m in cio.list_checkpoints(url)] == [1]
    assert "format 7" in caplog.text

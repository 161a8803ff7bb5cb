"""psframe serve's parts without a server: the versions holder's switch, each version's model, and
the follower on a checkpoint directory that a real trainer wrote (ps tasks in this process).

The oracle of every version the follower serves is :func:`psframe.export.export_checkpoint` of the
checkpoint at its step, bit for bit.

This file holds the unit tier's tests of the subject; `tests/service/test_serve.py` and
`tests/cluster/test_serve.py` hold the other tiers'.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import psframe
from psframe.errors import ClusterMismatchError
from psframe.export import Snapshot, TableRows, apply_update, export_checkpoint, export_delta
from psframe.serve.delta_update import PartLayout, read_delta_update
from psframe.serve.follower import CheckpointFollower
from psframe.serve.model import InputError, ModelFactory, default_inputs, state_of, to_json
from psframe.serve.versions import ServedVersion, VersionHolder
from psframe.worker.model_state import load_model_state
from tests.support.serve_jobs import Ranker, Saved, batch, committed, publish, ranker, train_ranker
from tests.unit.test_export import assert_same

# ---- the holder


def version_of(number: int) -> ServedVersion:
    """Version ``number``: every value it holds equals ``number``."""
    rows = torch.full((64, 8), float(number))
    snapshot = Snapshot(number, {"w": torch.full((32,), float(number))}, {"t": TableRows(torch.arange(64), rows)})
    return ServedVersion(number, snapshot, base_step=1, deltas_applied=number - 1, committed_at=0.0)


def test_a_reader_sees_each_version_whole_while_versions_switch():
    holder = VersionHolder()
    holder.publish(version_of(1))
    torn: list[str] = []
    seen: set[int] = set()
    stop = threading.Event()

    def read() -> None:
        for _ in range(20_000):  # bounded: the writer ends first in practice, this ends regardless
            if stop.is_set():
                return
            version = holder.current()  # once per request
            assert version is not None
            values = {float(version.snapshot.dense["w"].unique()), float(version.snapshot.tables["t"].rows.unique())}
            if values != {float(version.number)} or version.step != version.number:
                torn.append(f"version {version.number} holds {values}")
            seen.add(version.number)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    for number in range(2, 300):
        holder.publish(version_of(number))
    stop.set()
    for reader in readers:
        reader.join(timeout=60)
    assert not torn, torn[:3]
    assert holder.current().number == 299 and len(seen) > 1


def test_versions_are_published_in_order_each_once():
    holder = VersionHolder()
    assert holder.current() is None and holder.next_number() == 1
    with pytest.raises(ValueError, match="version 2 .* cannot follow version 0"):
        holder.publish(version_of(2))
    holder.publish(version_of(1))
    with pytest.raises(ValueError, match="version 1 .* cannot follow version 1"):
        holder.publish(version_of(1))
    assert holder.current().number == 1


# ---- the model of a version


def test_each_version_gets_its_own_model_loaded_as_load_model_state_loads_it():
    users, items, _ = batch(0)
    ids = torch.unique(users)
    snapshot = Snapshot(
        5,
        {"items.weight": torch.randn(12, 4), "head.weight": torch.randn(1, 8), "head.bias": torch.randn(1)},
        {"users": TableRows(ids[:3], torch.randn(3, 4))},  # the other ids read their initial rows
    )
    factory = ModelFactory.of(ranker(), "tests.support.serve_jobs:ranker")
    first, second = factory.model_of(snapshot), factory.model_of(snapshot)
    assert first is not second and first is not factory.template and not first.training
    expected = Ranker()
    load_model_state(expected, state_of(snapshot))
    expected.eval()
    inputs = {"users": users.tolist(), "items": items.tolist()}
    with torch.no_grad():
        assert factory.predict(first, inputs) == expected(users, items).tolist()
    with pytest.raises(ClusterMismatchError, match="head.bias"):
        factory.model_of(Snapshot(5, {k: v for k, v in snapshot.dense.items() if k != "head.bias"}, snapshot.tables))
    with pytest.raises(InputError, match="to_inputs refused the inputs: 'items'"):
        factory.predict(first, {"users": users.tolist()})
    with pytest.raises(InputError, match="forward refused the inputs"):
        factory.predict(first, {"users": [[1, 2]], "items": [1, 2, 3]})


def test_inputs_without_to_inputs_and_outputs_as_json():
    args = default_inputs([[1, 2], [0.5]])
    assert isinstance(args, tuple) and args[0].dtype == torch.int64 and args[1].dtype == torch.float32
    assert set(default_inputs({"x": 1})) == {"x"}
    for bad, message in (("x", "inputs must be a list"), ([[1, 2], [3]], r"inputs\[0\] must be a number")):
        with pytest.raises(InputError, match=message):
            default_inputs(bad if message.startswith("inputs must") else [bad])
    assert to_json((torch.tensor([1.5]), {"k": torch.tensor(2)}, None)) == [[1.5], {"k": 2}, None]
    with pytest.raises(TypeError, match="has no JSON form"):
        to_json(object())
    with pytest.raises(ValueError, match="must return a torch.nn.Module, or"):
        ModelFactory.of((torch.nn.Linear(1, 1), "not callable"), "f.py:make")


# ---- the follower, on checkpoints a trainer wrote


@pytest.fixture
def checkpoints(in_process_cluster, tmp_path) -> list[Saved]:
    """A run on two ps tasks: a full checkpoint, deltas, a full one again, deltas (ps tasks in this process)."""
    cluster = in_process_cluster(num_ps=2, num_workers=1).cluster
    model = Ranker()
    checkpointing = psframe.Checkpointing(str(tmp_path / "train"), save_steps=10**6, keep=10)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.5), checkpointing=checkpointing) as trainer:
        train_ranker(trainer, model, range(0, 2))
        trainer.save_checkpoint()
        for step in range(2, 6):
            train_ranker(trainer, model, range(step, step + 1))
            trainer.save_delta()
        train_ranker(trainer, model, range(6, 7))
        trainer.save_checkpoint()
        for step in range(7, 9):
            train_ranker(trainer, model, range(step, step + 1))
            trainer.save_delta()
    # The chief's save at the end is a full checkpoint of the last delta's step: left out.
    saved = [s for s in committed(str(tmp_path / "train")) if s.step < 9 or s.kind == "delta"]
    assert [(s.kind, s.step) for s in saved] == [
        ("full", 2), ("delta", 3), ("delta", 4), ("delta", 5), ("delta", 6), ("full", 7), ("delta", 8), ("delta", 9)
    ]  # fmt: skip
    return saved


def test_the_follower_serves_each_committed_checkpoint_as_its_export_bit_for_bit(checkpoints, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    follower = CheckpointFollower(str(served_dir), VersionHolder(), models=ModelFactory.of(ranker()))
    assert follower.poll() is None and follower.status()["state"] == "waiting for a checkpoint"
    train_dir = str(Path(checkpoints[0].manifest.url))
    made = deleted = 0
    for number, saved in enumerate(checkpoints, start=1):
        publish(saved, served_dir)
        before = follower.holder.current()
        version = follower.poll()
        assert version is not None and version.number == number and version.step == saved.step
        assert_same(version.snapshot, export_checkpoint(train_dir, saved.step))
        base = saved if saved.kind == "full" else next(s for s in reversed(checkpoints[:number]) if s.kind == "full")
        assert version.committed_at == saved.manifest.created and version.base_step == base.step
        assert version.deltas_applied == checkpoints.index(saved) - checkpoints.index(base)
        if saved.kind == "delta":
            update = read_delta_update(saved.manifest, follower._layout, before.snapshot)
            assert_same(apply_update(before.snapshot, export_delta(train_dir, saved.step)), version.snapshot)
            made += int((~torch.isin(update.tables["users"].upsert.ids, before.snapshot.tables["users"].ids)).sum())
            deleted += update.tables["users"].delete.numel()
        expected = Ranker()
        load_model_state(expected, psframe.checkpoint.load(train_dir, saved.step))
        expected.eval()
        users, items, _ = batch(saved.step)
        with torch.no_grad():
            assert version.model(users, items).tolist() == expected(users, items).tolist()
        assert follower.poll() is None  # nothing new: no switch
    assert made > 0 and deleted > 0, "the deltas should make rows and evict some"
    status = follower.status()
    assert (status["step"], status["behind"], status["lag_seconds"], status["refused"]) == (
        checkpoints[-1].step,
        0,
        0.0,
        0,
    )


def test_a_restarted_follower_applies_the_same_chain_at_once(checkpoints, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    for saved in checkpoints[:5]:  # the first full checkpoint and its four deltas
        publish(saved, served_dir)
    version = CheckpointFollower(str(served_dir), VersionHolder()).poll()
    assert (version.number, version.step, version.base_step, version.deltas_applied) == (
        1,
        checkpoints[4].step,
        checkpoints[0].step,
        4,
    )
    assert_same(version.snapshot, export_checkpoint(str(Path(checkpoints[0].manifest.url)), checkpoints[4].step))
    assert version.model is None


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_delta_is_refused_and_the_next_full_checkpoint_is_taken(checkpoints, tmp_path, damage):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    follower = CheckpointFollower(str(served_dir), VersionHolder())
    publish(checkpoints[0], served_dir)
    publish(checkpoints[1], served_dir)
    good = follower.poll()
    publish(checkpoints[2], served_dir, damage=damage)
    publish(checkpoints[3], served_dir)  # follows the damaged one: cannot apply
    assert follower.poll() is None and follower.holder.current() is good
    status = follower.status()
    refused = status["last_refused"]
    assert (refused["step"], refused["kind"], status["refused"]) == (checkpoints[2].step, "delta", 1)
    assert ("corrupt" if damage == "flip" else "truncated") in refused["reason"] and "sha256" in refused["reason"]
    assert (status["step"], status["behind"]) == (checkpoints[1].step, 2)
    assert follower.poll() is None and follower.status()["refused"] == 1  # not tried again
    publish(checkpoints[5], served_dir)  # the next full checkpoint
    version = follower.poll()
    assert version.step == checkpoints[5].step and version.base_step == checkpoints[5].step
    assert_same(version.snapshot, export_checkpoint(str(Path(checkpoints[0].manifest.url)), checkpoints[5].step))


def test_a_damaged_full_checkpoint_is_refused_and_an_older_one_served(checkpoints, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    for saved in checkpoints[:5]:
        publish(saved, served_dir)
    publish(checkpoints[5], served_dir, damage="truncate")
    follower = CheckpointFollower(str(served_dir), VersionHolder())
    version = follower.poll()
    assert version.step == checkpoints[4].step and follower.last_refusal.step == checkpoints[5].step
    assert follower.last_refusal.kind == "full" and "truncated" in follower.last_refusal.reason


def test_the_layout_places_strided_parts_of_a_fixed_table(checkpoints):
    shards = psframe.checkpoint.Chain(checkpoints[0].manifest).read_shards()
    layout = PartLayout.of_shards(shards)
    items = sorted((p for p in layout.parts.values() if p.variable == "items.weight"), key=lambda p: p.row_start)
    rows = torch.cat([p.global_rows() for p in items])
    assert sorted(rows.tolist()) == list(range(12))  # every row of the table in exactly one part


def test_a_checkpoint_the_model_does_not_fit_is_refused(checkpoints, tmp_path):
    served_dir = tmp_path / "served"
    served_dir.mkdir()
    publish(checkpoints[0], served_dir)
    follower = CheckpointFollower(str(served_dir), VersionHolder(), models=ModelFactory(torch.nn.Linear(2, 1)))
    assert follower.poll() is None and follower.holder.current() is None
    refused = follower.status()["last_refused"]
    assert refused["step"] == checkpoints[0].step and refused["kind"] == "full"
    assert "the checkpoint does not fit the model (Linear)" in refused["reason"]

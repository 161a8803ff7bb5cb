"""Delta checkpoints: only what changed since the last checkpoint, and chains of them on a full one.

The oracle: a full checkpoint followed by deltas restores, bit for bit, what
a full checkpoint taken at the same instant holds — dense variables, fixed
and dynamic tables, optimizer state, ages, counts and pushes — with rows
made and evicted in between.

This file holds the service tier's tests of the subject; `tests/unit/test_delta_checkpoints.py`
holds the other tiers'.
"""

from __future__ import annotations

import logging

import fsspec
import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe import checkpoint
from psframe.checkpoint import deltas
from psframe.checkpoint import files as checkpoint_files
from psframe.checkpoint.shard import ShardData
from psframe.errors import CheckpointError
from psframe.tables.spec import RowInitializer
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from tests.conftest import free_cluster

DIM = 4
INIT = RowInitializer(std=0.3, seed=7)
FIXED_ROWS = 30


class Clicks(torch.nn.Module):
    """A dynamic table (capped, so rows are evicted), a fixed table and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users = psframe.DynamicEmbedding(
            DIM, initializer=INIT, max_rows=12, admit_after=2, admission_counters=1 << 10
        )
        self.items = torch.nn.Embedding(FIXED_ROWS, DIM, sparse=True)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        features = torch.cat([self.users(users).mean(1), self.items(items).mean(1)], 1)
        return self.head(features).squeeze(1)


def batch(step: int, size: int = 8):
    g = torch.Generator().manual_seed(300 + step)
    users = (torch.rand(size, 3, generator=g) ** 2 * 40).long() * 7919 - 2**40
    items = torch.randint(0, FIXED_ROWS // 3, (size, 2), generator=g)  # a third of the rows: others never change
    return users, items, torch.rand(size, generator=g)


def train(trainer: psframe.Trainer, model: Clicks, steps: range) -> None:
    for step in steps:
        users, items, target = batch(step)
        trainer.step(F.mse_loss(model(users, items), target))


SGD = psframe.optim.SGD(lr=0.1)


def trainer_on(
    cluster: psframe.ClusterSpec, model: Clicks, url: str, optimizer=SGD, **checkpointing
) -> psframe.Trainer:
    """A trainer of ``model`` saving in ``url``; its tables trained by Adagrad."""
    return psframe.Trainer(
        model,
        cluster,
        optimizer=optimizer,
        table_optimizer=psframe.optim.Adagrad(lr=0.1),
        checkpointing=psframe.Checkpointing(url, **checkpointing),
    )


def assert_same(a: object, b: object, where: str) -> None:
    """Equal bit for bit: tensors (dtype, shape, values), and dicts, lists and scalars of them."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_shards(actual: list[ShardData], expected: list[ShardData]) -> None:
    for a, b in zip(actual, expected, strict=True):
        assert_same(a.to_dict(), b.to_dict(), f"shard {b.ps_task}")


def save_full(cluster: psframe.ClusterSpec, url: str, step: int) -> None:
    """A full checkpoint of the ps tasks as they are, in another folder (the oracle)."""
    client = PsClient(cluster, 0, job_name="tool")
    try:
        checkpoint.save(client, url, step, keep=10)
    finally:
        client.close()


@pytest.fixture
def other_url(url):
    return url + "-full"


def test_a_chain_of_deltas_restores_bit_for_bit_what_a_full_checkpoint_holds(local_cluster, url, other_url):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Clicks()
    optimizer = psframe.optim.Adagrad(lr=0.1)
    with psframe.Trainer(
        model,
        cluster,
        optimizer=optimizer,
        table_optimizer=psframe.optim.Adam(lr=0.05),
        checkpointing=psframe.Checkpointing(url, save_steps=1000),
    ) as trainer:
        train(trainer, model, range(0, 3))
        base = trainer.save_checkpoint()
        train(trainer, model, range(3, 6))
        first = trainer.save_delta()
        save_full(cluster, other_url, first.step)
        train(trainer, model, range(6, 10))
        second = trainer.save_delta()
        save_full(cluster, other_url, second.step)
        client = PsClient(cluster, 0, job_name="tool")
        try:
            evicted = sum(t.evicted for k in range(2) for t in control_calls.get_info(client, k).dynamic_tables)
        finally:
            client.close()
    assert (first.parent, second.parent) == (base.step, first.step)
    assert evicted > 0  # rows were made and evicted between the checkpoints
    chain = checkpoint.read(url)
    assert chain.base.step == base.step and [m.step for m in chain.deltas] == [first.step, second.step]
    assert_same_shards(chain.read_shards(), checkpoint.read(other_url, second.step).read_shards())
    # Any step of the chain reads as the full checkpoint of that step.
    assert_same_shards(
        checkpoint.read(url, first.step).read_shards(), checkpoint.read(other_url, first.step).read_shards()
    )
    loaded, expected = checkpoint.load(url), checkpoint.load(other_url)
    assert_same(loaded, expected, "load")
    # A delta holds only what changed: a third of the fixed table's rows at most.
    delta = deltas.read_delta(second, 0)
    changed_rows = sum(r.index.numel() for r in delta.rows.values())
    assert 0 < changed_rows <= FIXED_ROWS // 3
    assert sum(record.nbytes for record in second.shards) < sum(record.nbytes for record in base.shards)


def test_a_cluster_restarts_from_the_chain(local_cluster, url, other_url):
    model = Clicks()
    with trainer_on(local_cluster(num_ps=2), model, url) as t:
        train(t, model, range(0, 2))
        t.save_checkpoint()
        train(t, model, range(2, 5))
        t.save_delta()
        train(t, model, range(5, 7))
        last = t.save_delta()
    # A new cluster (as many ps tasks) restores the chain; onto three ps tasks too.
    for num_ps in (2, 3):
        cluster = local_cluster(num_ps=num_ps)
        again = Clicks()
        with trainer_on(cluster, again, url) as t:
            assert t.global_step == last.step
            save_full(cluster, other_url + str(num_ps), last.step)
        assert_same(checkpoint.load(other_url + str(num_ps)), checkpoint.load(url), f"restored onto {num_ps}")


def test_the_trainer_commits_deltas_between_full_checkpoints(local_cluster, url):
    model = Clicks()
    with psframe.Trainer(
        model,
        local_cluster(num_ps=2),
        optimizer=psframe.optim.SGD(lr=0.1),
        table_optimizer=psframe.optim.Adagrad(lr=0.1),
        checkpointing=psframe.Checkpointing(url, save_steps=6, delta_steps=2),
    ) as trainer:
        train(trainer, model, range(0, 9))
    fulls = [m.step for m in checkpoint_files.list_checkpoints(url)]
    found = [(m.step, m.parent) for m in checkpoint_files.list_checkpoints(url, deltas=True)]
    # The first delta, at step 2, had no checkpoint to follow: saved whole. Then every 6 steps and at the end.
    assert fulls == [2, 6, 9]
    assert found == [(4, 2), (8, 6)]


def test_a_corrupt_delta_ends_the_chain_at_the_one_before(local_cluster, url, caplog):
    model = Clicks()
    with trainer_on(local_cluster(num_ps=2), model, url) as t:
        train(t, model, range(0, 2))
        t.save_checkpoint()
        train(t, model, range(2, 4))
        good = t.save_delta()
        good_state = checkpoint.load(url)
        train(t, model, range(4, 6))
        bad = t.save_delta()
        train(t, model, range(6, 8))
        after = t.save_delta()
    fs, path = fsspec.core.url_to_fs(f"{bad.folder}/{bad.shards[1].file}")
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    with caplog.at_level(logging.WARNING):
        chain = checkpoint.read(url)
    assert chain.step == good.step
    assert any("is corrupt, the chain stops" in r.getMessage() for r in caplog.records)
    assert_same(checkpoint.load(url), good_state, "after a corrupt delta")
    with pytest.raises(CheckpointError, match=f"delta checkpoint of step {after.step}.*missing or corrupt"):
        checkpoint.read(url, after.step)


def test_a_gap_in_the_chain_ends_it_and_a_delta_needs_a_committed_parent(local_cluster, url, caplog):
    model = Clicks()
    cluster = local_cluster(num_ps=2)
    with trainer_on(cluster, model, url) as t:
        train(t, model, range(0, 2))
        base = t.save_checkpoint()
        train(t, model, range(2, 4))
        lost = t.save_delta()
        train(t, model, range(4, 6))
        t.save_delta()
        client = PsClient(cluster, 0, job_name="tool")
        try:
            with pytest.raises(CheckpointError, match="its parent, step 3, is no committed checkpoint"):
                checkpoint.save_delta(client, url, 7, parent=3)
            with pytest.raises(CheckpointError, match="no snapshot of checkpoint step 1"):
                client.save(url, 8, parent=1)
        finally:
            client.close()
    fs, path = fsspec.core.url_to_fs(lost.folder)
    fs.rm(path, recursive=True)
    with caplog.at_level(logging.WARNING):
        assert checkpoint.read(url).step == base.step
    assert any("do not follow it" in r.getMessage() for r in caplog.records)


def test_pruning_drops_deltas_older_than_the_oldest_full_checkpoint_kept(local_cluster, url):
    model = Clicks()
    with trainer_on(local_cluster(num_ps=2), model, url, keep=1) as t:
        train(t, model, range(0, 2))
        t.save_checkpoint()
        train(t, model, range(2, 4))
        t.save_delta()
        train(t, model, range(4, 6))
        t.save_checkpoint()
        train(t, model, range(6, 8))
        t.save_delta()
    # Step 2 and its delta went when step 6 was saved; the delta of step 8 follows step 6 (the end
    # saves nothing more: its step is committed).
    assert [m.step for m in checkpoint_files.list_checkpoints(url)] == [6]
    assert [m.step for m in checkpoint_files.list_checkpoints(url, deltas=True)] == [8]
    assert checkpoint.read(url).step == 8


@pytest.mark.service
def test_a_restarted_ps_task_restores_its_shard_from_the_chain(url, other_url):
    cluster = free_cluster(2, 1)
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1, checkpoint_dir=url) for k in range(2)]
    model = Clicks()
    try:
        with trainer_on(cluster, model, url) as t:
            train(t, model, range(0, 2))
            t.save_checkpoint()
            train(t, model, range(2, 5))
            last = t.save_delta()
            # ps task 1 is lost and comes back: it takes its shard from the full checkpoint and the delta.
            servers[1].stop(grace=0.1)
            servers[1] = psframe.Server(cluster, "ps", 1, serving_processes=1, checkpoint_dir=url)
            save_full(cluster, other_url, last.step)
            assert_same_shards(checkpoint.read(other_url).read_shards(), checkpoint.read(url).read_shards())
            # It can write the next delta from the chain it restored.
            train(t, model, range(5, 7))
            after = t.save_delta()
            assert after.parent == last.step
    finally:
        for server in servers:
            server.stop(grace=0.1)


def test_a_serving_snapshot_kept_current_from_deltas_equals_the_export_of_a_full_checkpoint(
    local_cluster, url, other_url, tmp_path
):
    from psframe import export

    cluster = local_cluster(num_ps=2)
    model = Clicks()
    with trainer_on(cluster, model, url, optimizer=psframe.optim.Adagrad(lr=0.1)) as t:
        train(t, model, range(0, 2))
        base = t.save_checkpoint()
        feed = []
        for first in (2, 5, 8):
            train(t, model, range(first, first + 3))
            feed.append(t.save_delta())
        save_full(cluster, other_url, feed[-1].step)
    serving = export.export_checkpoint(url, base.step)
    for i, delta in enumerate(feed):
        update = export.export_delta(url, delta.step)
        assert (update.base_step, update.step) == (delta.parent, delta.step)
        path = str(tmp_path / f"update-{i}.safetensors")
        export.write_update(update, path)  # through the files serving reads
        serving = export.apply_update(serving, export.read_update(path))
    expected = export.export_checkpoint(other_url)
    assert serving.step == expected.step == feed[-1].step
    assert_same(serving.dense, expected.dense, "dense")
    assert sorted(serving.tables) == sorted(expected.tables) == ["users"]
    assert_same(serving.tables["users"].ids, expected.tables["users"].ids, "ids")
    assert_same(serving.tables["users"].rows, expected.tables["users"].rows, "rows")
    # Tombstones: ids the cap evicted between two deltas are deleted.
    assert sum(
        change.delete.numel() for u in [export.export_delta(url, d.step) for d in feed] for change in u.tables.values()
    )
    # A full checkpoint is no delta; a gap makes the delta after it unreachable.
    with pytest.raises(CheckpointError, match="is a full checkpoint, not a delta"):
        export.export_delta(url, base.step)
    fs, path = fsspec.core.url_to_fs(feed[1].folder)
    fs.rm(path, recursive=True)
    with pytest.raises(CheckpointError, match=f"delta checkpoint of step {feed[2].step}.*missing or corrupt"):
        export.export_delta(url, feed[2].step)


# ---- one cut: every ps task's part holds the same steps of every worker


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def train_until_stopped(cluster, index: int, sync, stop, errors: list) -> None:
    """Worker ``index`` trains a Wide model until ``stop`` is set (a thread's target); errors go in ``errors``."""
    model = Wide()
    try:
        with psframe.Trainer(model, cluster, task_index=index, optimizer=psframe.optim.SGD(lr=0.01), sync=sync) as t:
            for step in range(100_000):
                if stop.is_set():
                    break
                t.step(model(torch.randn(32, 64, generator=torch.Generator().manual_seed(step))))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def test_every_part_of_a_checkpoint_holds_the_same_steps_of_every_worker(local_cluster, url):
    """Asynchronous workers train on while the chief saves: each checkpoint, full or delta, is one cut."""
    import threading

    cluster = local_cluster(num_ps=2, num_workers=2)
    stop, errors = threading.Event(), []
    model = Wide()
    thread = threading.Thread(target=train_until_stopped, args=(cluster, 1, None, stop, errors))
    with psframe.Trainer(
        model, cluster, optimizer=psframe.optim.SGD(lr=0.01), checkpointing=psframe.Checkpointing(url, keep=20)
    ) as trainer:
        thread.start()
        try:
            saved = []
            for round in range(8):
                for _ in range(3):
                    trainer.step(model(torch.randn(32, 64)))
                saved.append(trainer.save_checkpoint() if round % 4 == 0 else trainer.save_delta())
        finally:
            stop.set()
            thread.join(60)
    assert not errors and not thread.is_alive()
    held = []
    for manifest in saved:
        shards = checkpoint.read(url, manifest.step).read_shards()
        steps = [shard.pushes["applied_steps"] for shard in shards]
        assert steps[0] == steps[1], f"checkpoint {manifest.step}: the parts hold {steps}"
        held.append(steps[0][1])
    assert held[-1] > held[0]  # the other worker trained on between the checkpoints


def test_sync_with_backup_workers_every_part_of_a_checkpoint_holds_the_same_round(local_cluster, url):
    """Two of three workers make a round, so rounds go on while the chief saves: each
    checkpoint, full or delta, is one cut at one round on every ps task."""
    import threading

    cluster = local_cluster(num_ps=2, num_workers=3)
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, timeout=60)
    stop, errors = threading.Event(), []
    model = Wide()
    threads = [threading.Thread(target=train_until_stopped, args=(cluster, i, sync, stop, errors)) for i in (1, 2)]
    try:
        with psframe.Trainer(
            model,
            cluster,
            optimizer=psframe.optim.SGD(lr=0.01),
            sync=sync,
            checkpointing=psframe.Checkpointing(url, keep=20),
        ) as trainer:
            for thread in threads:
                thread.start()
            saved = []
            for round in range(8):
                for _ in range(2):
                    trainer.step(model(torch.randn(32, 64)))
                saved.append(trainer.save_checkpoint() if round % 4 == 0 else trainer.save_delta())
    finally:  # the chief has left (the others' rounds no longer wait for it): they stop too
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not errors and not any(thread.is_alive() for thread in threads), errors
    rounds = []
    for manifest in saved:
        steps = [shard.global_step for shard in checkpoint.read(url, manifest.step).read_shards()]
        assert steps[0] == steps[1], f"checkpoint {manifest.step}: the parts hold rounds {steps}"
        rounds.append(steps[0])
    assert rounds == sorted(rounds) and rounds[-1] > rounds[0]


def test_an_evaluator_sees_full_and_delta_checkpoints_in_step_order(local_cluster, url):
    def evaluate(model: Clicks) -> dict[str, float]:
        users, items, target = batch(1000)
        return {"loss": float(F.mse_loss(model(users, items), target))}

    model = Clicks()
    with trainer_on(local_cluster(num_ps=2), model, url) as t:
        train(t, model, range(0, 2))
        t.save_checkpoint()
        train(t, model, range(2, 4))
        t.save_delta()
        train(t, model, range(4, 6))
        t.save_delta()
        with torch.no_grad():
            model.eval()
            live = evaluate(model)
    results = psframe.Evaluator(Clicks(), evaluate, url, max_step=6, timeout=5.0).run()
    assert sorted(results) == [2, 4, 6]
    assert results[6] == live  # the last delta's view is the cluster's


@pytest.mark.service
def test_a_cut_a_lost_worker_never_completes_gives_up_and_the_save_goes_on(url, caplog):
    cluster = free_cluster(2, 2)
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1) for k in range(2)]
    model = Wide()
    try:
        with psframe.Trainer(
            model, cluster, optimizer=psframe.optim.SGD(lr=0.01), checkpointing=psframe.Checkpointing(url)
        ) as trainer:
            trainer.step(model(torch.randn(32, 64)))
            # Worker 1 began a step on ps task 0 and was lost before its pushes reached ps task 1.
            servers[0].service.ledger.record(1, 1, ends_step=False)
            with caplog.at_level(logging.WARNING):
                manifest = trainer.save_checkpoint()
            # Worker 1 has been silent on ps task 1: the cut gives up on it rather than hold to the deadline.
            assert any(
                "saved without one cut" in r.getMessage() and "worker 1 began a step" in r.getMessage()
                for r in caplog.records
            ), [r.getMessage() for r in caplog.records]
            # Training goes on: the hold ended with the save.
            trainer.step(model(torch.randn(32, 64)))
            assert trainer.global_step == manifest.step + 1
    finally:
        for server in servers:
            server.stop(grace=0.1)


def test_a_step_with_both_a_full_checkpoint_and_a_delta_reads_the_full_one(local_cluster, url):
    model = Clicks()
    with trainer_on(local_cluster(num_ps=2), model, url) as t:
        train(t, model, range(0, 2))
        base = t.save_checkpoint()
        train(t, model, range(2, 4))
        delta = t.save_delta()
        full = t.save_checkpoint()  # the same step: both committed
    assert (delta.parent, delta.step) == (base.step, full.step)
    assert full.step in [m.step for m in checkpoint_files.list_checkpoints(url, deltas=True)]
    chain = checkpoint.read(url, full.step)
    assert (chain.base.step, chain.deltas) == (full.step, ())  # the full one, no chain
    assert checkpoint.read(url).base.step == full.step and not checkpoint.read(url).deltas
    # Both hold the model of that step: the full one read, or the delta through its chain.
    through_delta = deltas.chain_of(base, checkpoint_files.list_checkpoints(url, deltas=True), until=delta.step)
    assert through_delta.step == delta.step
    assert_same_shards(chain.read_shards(), through_delta.read_shards())
    assert_same(checkpoint.load(url, step=full.step), checkpoint.load(url), "load")

"""Data read in ranges: each example of each epoch trained on once, whoever joins, leaves or dies.

The queue alone (no network), then workers in threads against ps tasks in
this process: the multiset of examples whose step was applied equals the
epochs', with a worker that dies mid-range (its range goes to another from
where it got to), one that joins late, synchronous rounds that drop late
batches (trained again), and a checkpoint restored (what the restored model
did not train on is handed out again).

This file holds the service tier's tests of the subject; `tests/unit/test_data_ranges.py` holds the
other tiers'.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

import psframe
from psframe.errors import PsframeError
from psframe.ps.protocol.data_ranges import RangeQueue
from tests.service.test_sync import run_workers
from tests.unit.test_elastic import grow

DEADLINE_S = 60.0

# ---- the queue, no network


def queue(gone: set[int] | None = None) -> RangeQueue:
    gone = gone if gone is not None else set()
    return RangeQueue(gone=lambda worker: worker in gone)


# ---- workers in threads, ps tasks in this process

FEATURES = 4


def dataset(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(n, FEATURES, generator=generator), torch.randn(n, 1, generator=generator)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


@pytest.fixture
def ps_tasks():
    servers: list[psframe.Server] = []

    def make(num_ps: int, num_workers: int, **options) -> tuple[psframe.ClusterSpec, list[psframe.Server]]:
        from tests.conftest import free_cluster

        cluster = free_cluster(num_ps, num_workers)
        started = [psframe.Server(cluster, "ps", k, serving_processes=1, **options) for k in range(num_ps)]
        servers.extend(started)
        return cluster, started

    yield make
    for server in servers:
        server.stop(grace=0.1)


class Seen:
    """The examples each worker trained on with an applied step (a Counter of indices)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()

    def train(
        self,
        trainer: psframe.Trainer,
        ranges: psframe.DataRanges,
        data,
        stop_after: int | None = None,
        close: bool = True,
        delay: float = 0.0,
    ) -> int:
        """Train on this worker's batches; ``stop_after`` steps then stop (``close=False``: as if it died)."""
        x, y = data
        steps = 0
        if not close:
            trainer.connect()
        else:
            trainer.__enter__()
        try:
            for indices in trainer.read(ranges):
                time.sleep(delay)
                dropped = trainer.stats.dropped_steps
                trainer.step(torch.nn.functional.mse_loss(trainer.model(x[indices]), y[indices]))
                if trainer.stats.dropped_steps == dropped:
                    with self.lock:
                        self.counts.update(indices.tolist())
                steps += 1
                if stop_after is not None and steps >= stop_after:
                    break
        finally:
            if close:
                trainer.close()
        return steps


def trainer_of(cluster: psframe.ClusterSpec, index: int, **options) -> psframe.Trainer:
    return psframe.Trainer(
        model(),
        cluster,
        task_index=index,
        optimizer=psframe.optim.SGD(lr=0.01),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
        **options,
    )


@pytest.mark.service
def test_each_example_once_with_a_worker_dying_mid_range_and_one_joining(ps_tasks):
    cluster, servers = ps_tasks(2, 3, max_workers=4, worker_timeout=1.0)
    polling = threading.Thread(target=servers[0].join, kwargs={"timeout": DEADLINE_S}, daemon=True)
    polling.start()  # the ps loop that presumes silent workers dead
    n, epochs = 600, 2
    data = dataset(n)
    ranges = psframe.DataRanges("train", n, batch_size=8, range_size=50, epochs=epochs, seed=3)
    seen = Seen()

    def joiner() -> int:
        deadline = time.monotonic() + DEADLINE_S
        while servers[0].service.data.counts().get("train", (0, 0))[0] < 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return seen.train(trainer_of(grow(cluster, 1), 3), ranges, data)

    steps = run_workers(
        {
            0: lambda: seen.train(trainer_of(cluster, 0), ranges, data),
            1: lambda: seen.train(trainer_of(cluster, 1), ranges, data),
            2: lambda: seen.train(trainer_of(cluster, 2), ranges, data, stop_after=3, close=False),  # dies
            3: joiner,
        }
    )
    assert steps[2] == 3 and steps[3] > 0
    assert seen.counts == collections.Counter({i: epochs for i in range(n)})
    assert servers[0].service.data.counts() == {"train": (n * epochs, n * epochs)}
    assert servers[1].service.data.counts() == {}  # the queue lives on the first ps task


@pytest.mark.service
def test_sync_with_a_backup_worker_a_late_batch_is_trained_again(ps_tasks):
    cluster, _ = ps_tasks(1, 3)
    n = 240
    data = dataset(n)
    ranges = psframe.DataRanges("train", n, batch_size=6, range_size=30, seed=1)
    seen = Seen()
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=3, timeout=30.0)
    trainers = {w: trainer_of(cluster, w, sync=sync) for w in range(3)}
    slow = {2: 0.05}  # worker 2 is late to many rounds: its batches are dropped and trained again
    run_workers({w: (lambda w=w: seen.train(trainers[w], ranges, data, delay=slow.get(w, 0.0))) for w in range(3)})
    assert seen.counts == collections.Counter(range(n))


@pytest.mark.service
def test_sync_a_batch_whose_step_came_too_late_comes_again(ps_tasks):
    cluster, _ = ps_tasks(1, 2)
    x, y = dataset(40)
    ranges = psframe.DataRanges("train", 40, batch_size=4, range_size=8, shuffle=False)
    sync = psframe.SyncReplicas(replicas_to_aggregate=1, total_num_replicas=2, timeout=30.0)
    first, second = trainer_of(cluster, 0, sync=sync), trainer_of(cluster, 1, sync=sync)
    run_workers({0: first.connect})
    run_workers({1: second.connect})
    mine, late = first.read(ranges), second.read(ranges)
    late_batch = next(late)  # worker 1 asks first (the first range) and computes at step 0...
    own = next(mine)
    first.step(torch.nn.functional.mse_loss(first.model(x[own]), y[own]))  # ...worker 0 alone makes step 1
    second.step(torch.nn.functional.mse_loss(second.model(x[late_batch]), y[late_batch]))
    assert second.stats.dropped_steps == 1
    again = next(late)
    assert again.tolist() == late_batch.tolist() == [0, 1, 2, 3]
    second.step(torch.nn.functional.mse_loss(second.model(x[again]), y[again]))
    assert second.stats.dropped_steps == 1
    assert next(late).tolist() == [4, 5, 6, 7]


@pytest.mark.service
def test_a_restored_checkpoint_hands_out_again_what_the_restored_model_did_not_train_on(ps_tasks, tmp_path):
    cluster, (server,) = ps_tasks(1, 1, checkpoint_dir=str(tmp_path))
    n = 200
    data = dataset(n)
    ranges = psframe.DataRanges("train", n, batch_size=10, range_size=40, shuffle=False)
    trainer = trainer_of(cluster, 0, checkpointing=psframe.Checkpointing(str(tmp_path), save_steps=None))
    x, y = data
    trainer.connect()  # and never closed: a chief that closes saves a last checkpoint
    batches = trainer.read(ranges)
    for _ in range(6):  # 60 examples: one range and a half
        indices = next(batches)
        trainer.step(torch.nn.functional.mse_loss(trainer.model(x[indices]), y[indices]))
    trainer.save_checkpoint()
    for _ in range(4):
        indices = next(batches)
        trainer.step(torch.nn.functional.mse_loss(trainer.model(x[indices]), y[indices]))
    assert server.service.data.counts() == {"train": (100, 200)}
    batches.close()
    server.stop(grace=0.1)  # the ps task is lost...
    # ...and started again: it restores the checkpoint, and the queue as the restored values had consumed it.
    restarted = psframe.Server(cluster, "ps", 0, serving_processes=1, checkpoint_dir=str(tmp_path))
    try:
        assert restarted.service.data.counts() == {"train": (60, 200)}
        again = trainer_of(restarted.cluster, 0)
        with again:
            first = next(again.read(ranges))
            assert first.tolist() == list(range(60, 70))  # the second range, from where the checkpoint had it
    finally:
        restarted.stop(grace=0.1)


@pytest.mark.service
def test_a_batch_not_stepped_on_is_an_error_that_says_so(ps_tasks):
    cluster, _ = ps_tasks(1, 1)
    with trainer_of(cluster, 0) as trainer:
        batches = trainer.read(psframe.DataRanges("train", 50, batch_size=5))
        next(batches)
        with pytest.raises(PsframeError, match="call trainer.step"):
            next(batches)


@pytest.mark.service
def test_a_checkpoint_restored_onto_fewer_ps_tasks_keeps_what_was_consumed(ps_tasks, tmp_path):
    cluster, servers = ps_tasks(2, 1)
    ranges = psframe.DataRanges("train", 200, batch_size=10, range_size=40, shuffle=False)
    x, y = dataset(200)
    checkpointing = psframe.Checkpointing(str(tmp_path), save_steps=None)
    trainer = trainer_of(cluster, 0, checkpointing=checkpointing)
    trainer.connect()  # and never closed: a chief that closes saves a last checkpoint
    batches = trainer.read(ranges)
    for _ in range(6):
        indices = next(batches)
        trainer.step(torch.nn.functional.mse_loss(trainer.model(x[indices]), y[indices]))
    trainer.save_checkpoint()
    batches.close()
    for server in servers:
        server.stop(grace=0.1)
    smaller, (server,) = ps_tasks(1, 1)  # the job again, on one ps task: the chief restores onto it
    again = trainer_of(smaller, 0, checkpointing=checkpointing)
    with again:
        assert again.global_step == 6
        assert server.service.data.counts() == {"train": (60, 200)}
        assert next(again.read(ranges)).tolist() == list(range(60, 70))

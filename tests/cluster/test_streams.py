"""A stream read by partition, exactly once: a real NATS JetStream broker, ps tasks in this process,
workers in threads.

The oracle: each record carries a unique id, and a step's loss is the sum of its records' rows
of a table of zeros trained by SGD with lr 1, so a row trained once is exactly -1, one trained
twice -2, one lost 0. After workers die and join, a ps task restores a checkpoint, and the
broker restarts, every record's row is -1, and the offsets committed on ps 0 are those of every
record read.

This file holds the cluster tier's tests of the subject (the broker is a child process);
`tests/unit/test_stream_partitions.py` holds the unit tier's.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import psframe
from psframe.errors import PsframeError
from psframe.streams import JetStream, StreamRecord
from psframe.streams.local_broker import LocalBroker
from tests.conftest import free_cluster
from tests.service.test_data_ranges import ps_tasks  # noqa: F401 (the fixture: ps tasks in this process)
from tests.service.test_sync import run_workers
from tests.unit.test_elastic import grow

pytestmark = pytest.mark.cluster

DEADLINE_S = 60.0
PARTITIONS = 4
DEAD: list = []  # the batches of workers that died mid-stream, never closed


@pytest.fixture
def broker(tmp_path):
    broker = LocalBroker(tmp_path / "nats").start()
    yield broker
    broker.stop()


def publish(url: str, stream: str, ids: range, pause: float = 0.0) -> dict[int, int]:
    """Publish one record per id (its id as text), partition ``id % PARTITIONS``, ``pause`` seconds
    apart; the offset after each partition's last record."""
    ends = {}
    with JetStream(url, stream, PARTITIONS) as events:
        events.create()
        for record_id in ids:
            partition = record_id % PARTITIONS
            ends[partition] = events.publish(partition, str(record_id).encode()) + 1
            time.sleep(pause)
    return ends


class Rows(torch.nn.Module):
    """One row per record id, zeros: a step on records ``ids`` subtracts 1 from each of their rows."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.rows = torch.nn.Parameter(torch.zeros(n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids].sum()


def trainer_of(cluster: psframe.ClusterSpec, index: int, n: int, **options) -> psframe.Trainer:
    return psframe.Trainer(
        Rows(n),
        cluster,
        task_index=index,
        optimizer=psframe.optim.SGD(lr=1.0),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
        **options,
    )


def ids_of(records: list[StreamRecord]) -> torch.Tensor:
    return torch.tensor([int(record.value) for record in records])


def train(trainer: psframe.Trainer, source: JetStream, *, stop_after=None, close=True, idle=3.0) -> int:
    """Train on this worker's batches until the stream is idle (or ``stop_after`` steps; ``close=False``:
    then leave as a dead worker does, without a word)."""
    steps = 0
    trainer.connect()
    try:
        batches = trainer.stream(source, batch_size=7, idle_timeout=idle, rebalance_seconds=0.3)
        for records in batches:
            trainer.step(trainer.model(ids_of(records)))
            steps += 1
            if stop_after is not None and steps >= stop_after:
                if not close:
                    DEAD.append(batches)  # kept unclosed: a dead worker gives nothing back
                    return steps
                break
    finally:
        if close:
            trainer.close()
            source.close()
    return steps


def rows_on(server: psframe.Server) -> torch.Tensor:
    with server.service.store.lock:
        (values,) = server.service.store.read(["rows"])
        return values.clone()


def test_each_record_once_with_a_worker_dying_and_one_joining(broker, ps_tasks):
    n, more = 600, 300
    ends = publish(broker.url, "clicks", range(n))
    cluster, (server,) = ps_tasks(1, 3, max_workers=4, worker_timeout=1.0)
    polling = threading.Thread(target=server.join, kwargs={"timeout": DEADLINE_S}, daemon=True)
    polling.start()  # the ps loop that presumes silent workers dead

    def joiner() -> int:
        deadline = time.monotonic() + DEADLINE_S
        while sum(server.service.data.streams.offsets().get("clicks", [0])) < 200 * PARTITIONS:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Records keep coming for a few seconds as it joins (the others may have read the first ones all).
        later = threading.Thread(target=lambda: ends.update(publish(broker.url, "clicks", range(n, n + more), 0.01)))
        later.start()
        try:
            return train(trainer_of(grow(cluster, 1), 3, n + more), JetStream(broker.url, "clicks", PARTITIONS))
        finally:
            later.join(DEADLINE_S)

    steps = run_workers(
        {
            0: lambda: train(trainer_of(cluster, 0, n + more), JetStream(broker.url, "clicks", PARTITIONS)),
            1: lambda: train(trainer_of(cluster, 1, n + more), JetStream(broker.url, "clicks", PARTITIONS)),
            2: lambda: train(
                trainer_of(cluster, 2, n + more),
                JetStream(broker.url, "clicks", PARTITIONS),
                stop_after=4,
                close=False,
            ),
            3: joiner,
        }
    )
    assert steps[2] == 4 and steps[3] > 0
    assert torch.equal(rows_on(server), torch.full((n + more,), -1.0))
    assert server.service.data.streams.offsets() == {"clicks": [ends[p] for p in range(PARTITIONS)]}


def test_a_restored_checkpoint_reads_again_what_the_restored_model_did_not_train_on(broker, ps_tasks, tmp_path):
    n = 200
    ends = publish(broker.url, "clicks", range(n))
    ckpt = str(tmp_path / "ckpt")
    cluster, (server,) = ps_tasks(1, 1, checkpoint_dir=ckpt)
    trainer = trainer_of(cluster, 0, n, checkpointing=psframe.Checkpointing(ckpt, save_steps=None))
    trainer.connect()  # and never closed: a chief that closes saves a last checkpoint
    source = JetStream(broker.url, "clicks", PARTITIONS)
    batches = trainer.stream(source, batch_size=5)
    for _ in range(6):
        trainer.step(trainer.model(ids_of(next(batches))))
    trainer.save_checkpoint()
    saved = server.service.data.streams.offsets()["clicks"]
    for _ in range(5):
        trainer.step(trainer.model(ids_of(next(batches))))
    assert server.service.data.streams.offsets()["clicks"] != saved
    batches.close()
    source.close()
    server.stop(grace=0.1)  # the ps task is lost, with what it trained after the checkpoint...
    broker.restart()  # ...and the broker restarts too: the records stay on its disk
    restarted = psframe.Server(cluster, "ps", 0, serving_processes=1, checkpoint_dir=ckpt)
    try:
        assert restarted.service.data.streams.offsets() == {"clicks": saved}
        assert train(trainer_of(restarted.cluster, 0, n), JetStream(broker.url, "clicks", PARTITIONS), idle=2.0) > 0
        assert torch.equal(rows_on(restarted), torch.full((n,), -1.0))
        assert restarted.service.data.streams.offsets() == {"clicks": [ends[p] for p in range(PARTITIONS)]}
    finally:
        restarted.stop(grace=0.1)


def test_records_published_while_training_are_trained_as_they_come(broker, ps_tasks):
    n = 300
    publish(broker.url, "clicks", range(100))
    cluster, (server,) = ps_tasks(1, 1)

    def producer() -> int:
        time.sleep(0.5)
        publish(broker.url, "clicks", range(100, n))
        return n - 100

    run_workers(
        {
            0: lambda: train(trainer_of(cluster, 0, n), JetStream(broker.url, "clicks", PARTITIONS), idle=3.0),
            1: producer,
        }
    )
    assert torch.equal(rows_on(server), torch.full((n,), -1.0))


def test_stream_is_refused_in_synchronous_training(broker, ps_tasks):
    cluster, _ = ps_tasks(1, 1)
    sync = psframe.SyncReplicas(replicas_to_aggregate=1, total_num_replicas=1, timeout=30.0)
    with trainer_of(cluster, 0, 4, sync=sync) as trainer, JetStream(broker.url, "clicks", PARTITIONS) as source:
        with pytest.raises(PsframeError, match="asynchronous training"):
            next(trainer.stream(source, batch_size=2))


def test_a_source_whose_offsets_go_back_is_an_error_that_says_so(ps_tasks):
    class Backwards:
        name, partitions = "broken", 1

        def read(self, partition, offset, max_records, timeout):
            return [StreamRecord(0, 5, b"0"), StreamRecord(0, 3, b"1")]

        def close(self):
            pass

    cluster, _ = ps_tasks(1, 1)
    with trainer_of(cluster, 0, 4) as trainer:
        with pytest.raises(PsframeError, match="offsets must grow"):
            next(trainer.stream(Backwards(), batch_size=2))


def test_a_broker_restarted_while_workers_read_loses_no_record(broker, ps_tasks):
    n = 300
    publish(broker.url, "clicks", range(150))
    cluster, (server,) = ps_tasks(1, 1)

    def restarter() -> int:
        deadline = time.monotonic() + DEADLINE_S
        while sum(server.service.data.streams.offsets().get("clicks", [0])) < 50:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        broker.restart()  # the readers' consumers, kept in the broker's memory, are gone with it
        publish(broker.url, "clicks", range(150, n))
        return 0

    run_workers(
        {
            0: lambda: train(trainer_of(cluster, 0, n), JetStream(broker.url, "clicks", PARTITIONS), idle=6.0),
            1: restarter,
        }
    )
    assert torch.equal(rows_on(server), torch.full((n,), -1.0))


class RowsAcrossPs(torch.nn.Module):
    """:class:`Rows` of 4 values each, cut into parts small enough that every ps task holds some."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.rows = torch.nn.Parameter(torch.zeros(n, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows[ids].sum()


def test_each_record_once_across_re_layouts_to_more_ps_tasks_and_back(broker):
    from tests.service.test_relayout import assemble, clusters

    n = 480
    ends = publish(broker.url, "clicks", range(n))
    cluster, grown = clusters(2, 2)
    first = [psframe.Server(cluster, "ps", k, serving_processes=1) for k in range(2)]
    added = psframe.Server(grown, "ps", 2, serving_processes=1)

    def work(index: int) -> psframe.Trainer:
        t = psframe.Trainer(
            RowsAcrossPs(n),
            cluster,
            task_index=index,
            optimizer=psframe.optim.SGD(lr=1.0),
            placement=psframe.Placement(min_partition_bytes=256, max_shard_bytes=512),
            transport=psframe.Transport(connect_timeout=DEADLINE_S),
        )
        with t, JetStream(broker.url, "clicks", PARTITIONS) as source:
            for records in t.stream(source, batch_size=4, idle_timeout=3.0, rebalance_seconds=0.3):
                if index == 0 and t.stats.local_step == 10:
                    t.reshard(grown)
                if index == 0 and t.stats.local_step == 40:
                    t.reshard(cluster)
                t.step(t.model(ids_of(records)))
        return t

    try:
        done = run_workers({0: lambda: work(0), 1: lambda: work(1)})
        assert done[0].stats.relayouts == 2
        assert torch.equal(assemble(first)["rows"], torch.full((n, 4), -1.0))
        assert first[0].service.data.streams.offsets() == {"clicks": [ends[p] for p in range(PARTITIONS)]}
    finally:
        for server in [*first, added]:
            server.stop(grace=0.1)


@pytest.mark.parametrize("lost", [0, 1])
def test_a_ps_task_lost_and_restored_mid_stream_each_record_reaches_every_ps_task_once(broker, tmp_path, lost):
    """Two ps tasks, the rows cut across both; ps task ``lost`` stops and starts again from the
    last checkpoint while the worker trains on: the other keeps its values. Each task's updates
    of the records since the checkpoint are made again there only (the other answers them as
    applied), so every row ends at exactly -1."""
    from tests.service.test_relayout import assemble

    n = 400
    ends = publish(broker.url, "clicks", range(n))
    ckpt = str(tmp_path / "ckpt")
    cluster = free_cluster(2, 1)
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1, checkpoint_dir=ckpt) for k in range(2)]
    trainer = psframe.Trainer(
        RowsAcrossPs(n),
        cluster,
        task_index=0,
        optimizer=psframe.optim.SGD(lr=1.0),
        placement=psframe.Placement(min_partition_bytes=256, max_shard_bytes=512),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
        checkpointing=psframe.Checkpointing(ckpt, save_steps=15),
    )

    def worker() -> int:
        with trainer, JetStream(broker.url, "clicks", PARTITIONS) as source:
            for records in trainer.stream(source, batch_size=4, idle_timeout=3.0, rebalance_seconds=0.3):
                trainer.step(trainer.model(ids_of(records)))
                if trainer.stats.local_step == 40:  # past a checkpoint: the task is lost, and comes back
                    servers[lost].stop(grace=0.1)
                    servers[lost] = psframe.Server(cluster, "ps", lost, serving_processes=1, checkpoint_dir=ckpt)
        return trainer.stats.local_step

    try:
        assert run_workers({0: worker})[0] > 40
        rows = assemble(servers)["rows"]
        twice, never = (rows == -2.0).any(1).nonzero().flatten(), (rows == 0.0).any(1).nonzero().flatten()
        assert torch.equal(rows, torch.full((n, 4), -1.0)), f"rows trained twice: {twice[:20]}; never: {never[:20]}"
        assert trainer.stats.recoveries + trainer.stats.dropped_steps >= 1  # the worker saw the task go
        assert servers[0].service.data.streams.offsets() == {"clicks": [ends[p] for p in range(PARTITIONS)]}
    finally:
        for server in servers:
            server.stop(grace=0.1)


def test_a_record_published_again_under_its_id_is_stored_once(broker):
    with JetStream(broker.url, "clicks", PARTITIONS) as events:
        events.create()
        first = events.publish(1, b"a", msg_id="event-1")
        assert events.publish(1, b"a", msg_id="event-1") == first  # a publish tried again after a lost ack
        second = events.publish(1, b"b", msg_id="event-2")
        assert [(r.offset, r.value) for r in events.read(1, 0, 10, 1.0)] == [(first, b"a"), (second, b"b")]

"""Elastic clusters: workers join a running job and leave it (drained, or dead).

Unit tests of the parts (who is a member, the sync rule, the aggregator
following the live workers), then ps tasks in this process with workers in
threads: a worker of a grown worker list joins, another leaves; the job
goes on and ends when every member finished; and in sync training the
result equals one process on the combined batches of each round's members.

This file holds the service tier's tests of the subject; `tests/unit/test_elastic.py` holds the
other tiers'.
"""

from __future__ import annotations

import threading

import pytest
import torch

import psframe
from psframe.errors import ClusterMismatchError
from psframe.ps.protocol.roster import Change
from psframe.wire import messages
from tests.service.test_sync import batches_for, linear_model, run_workers
from tests.unit.test_elastic import DEADLINE_S, aggregator, elastic_ps, grow, held, oracle, trainer, wait_for  # noqa: F401


@pytest.mark.service
def test_async_a_worker_joins_and_one_leaves_while_the_others_train(elastic_ps):
    cluster, (server,) = elastic_ps(1, 2, max_workers=3)
    grown = grow(cluster, 1)
    shard = batches_for(3, 8, 400, seed=3)
    steps: dict[int, int] = {}
    first = trainer(cluster, 0)

    def work(t: psframe.Trainer, index: int, until) -> int:
        with t:
            while not until(t):
                x, y = shard(t.stats.local_step % 400, index)
                t.step(torch.nn.functional.cross_entropy(t.model(x), y))
        return t.stats.local_step

    def chief() -> int:
        # Trains on until the joiner has trained 20 steps (the ps waits for it, then it for the chief).
        return work(first, 0, lambda t: server.service.ledger.applied_steps(2) >= 20 and t.stats.local_step >= 30)

    def leaver() -> int:
        return work(trainer(cluster, 1), 1, lambda t: t.stats.local_step >= 15)

    def joiner() -> int:
        wait_for(lambda: server.service.roster.finished == [1], "worker 1 to leave")
        return work(trainer(grown, 2), 2, lambda t: t.stats.local_step >= 25)

    steps = run_workers({0: chief, 1: leaver, 2: joiner})
    assert steps[1] == 15 and steps[2] == 25 and steps[0] >= 30
    info = messages.task_status(server.service.info())
    assert info.max_workers == 3
    assert info.applied_steps == sum(steps.values())
    assert [w.task_index for w in info.workers] == [0, 1, 2]
    assert [(c.worker, c.kind) for c in info.membership if c.kind != "returned"][:2] == [
        (1, "left"),
        (2, "joined"),
    ]
    assert server.service.roster.all_finished and server.join(timeout=5.0)


@pytest.mark.service
def test_a_fixed_cluster_refuses_a_grown_worker_list_and_says_how_to_let_workers_join(elastic_ps):
    cluster, _ = elastic_ps(1, 1, max_workers=None)
    grown = grow(cluster, 1)
    with pytest.raises(ClusterMismatchError, match="start the ps tasks with max_workers"):
        trainer(grown, 1).connect()


@pytest.mark.service
def test_an_elastic_ps_refuses_a_worker_beyond_its_slots_or_of_other_ps_tasks(elastic_ps):
    cluster, _ = elastic_ps(1, 1, max_workers=2)
    with pytest.raises(ClusterMismatchError, match="only 2 worker slots"):
        trainer(grow(cluster, 2), 2).connect()
    other = psframe.ClusterSpec(
        {"ps": [*cluster.job_tasks("ps"), "127.0.0.1:1"], "worker": cluster.job_tasks("worker")}
    )
    with pytest.raises(ClusterMismatchError, match="should be /job:ps/task:0 of cluster"):
        trainer(other, 0).connect()


@pytest.mark.service
def test_sync_rounds_follow_joins_and_leaves_and_equal_one_process_on_each_rounds_members(elastic_ps):
    cluster, servers = elastic_ps(2, 2, max_workers=3)
    grown = grow(cluster, 1)
    last, join_at, leave_at = 14, 3, 8
    shard = batches_for(3, 4, last + 4, seed=11)
    start = {n: p.detach().clone() for n, p in linear_model().named_parameters()}
    sync = psframe.SyncReplicas(timeout=30.0)
    trainers = {0: trainer(cluster, 0, sync), 1: trainer(cluster, 1, sync)}

    def work(t: psframe.Trainer, index: int, stop_at: int) -> int:
        with t:
            while t.global_step < stop_at:
                x, y = shard(t.global_step, index)
                t.step(torch.nn.functional.cross_entropy(t.model(x), y))
        return t.global_step

    def joiner() -> int:
        wait_for(lambda: servers[0].service.store.global_step >= join_at, f"step {join_at}")
        return work(trainer(grown, 2, sync), 2, last)

    run_workers({0: lambda: work(trainers[0], 0, last), 1: lambda: work(trainers[1], 1, leave_at), 2: joiner})
    assert trainers[0].sync == psframe.SyncReplicas(None, None, 30.0, 1.0)  # resolved at connect: elastic
    aggregator = servers[0].service.aggregator
    final_step = servers[0].service.store.global_step
    members = [tuple(w for w in range(3) if aggregator.was_member(w, s)) for s in range(final_step)]
    assert (0, 1) in members and (0, 1, 2) in members and (0, 2) in members, members
    first_with_2 = members.index((0, 1, 2))
    assert all(m == (0, 1) for m in members[:first_with_2])  # a join takes effect at a round boundary
    # Every ps task applied the same rounds; their parts together are the oracle's model.
    expected = oracle(start, shard, members)
    for server in servers:
        assert server.service.store.global_step == final_step
        for name, value in held(server.service.store).items():
            assert torch.equal(value, expected[name]), name
    changes = [(c.worker, c.change) for c in servers[0].service.roster.changes]
    assert changes[:2] == [(2, Change.JOINED), (1, Change.LEFT)]


@pytest.mark.service
def test_sync_goes_on_without_a_worker_that_died_once_it_is_presumed_dead(elastic_ps):
    cluster, (server,) = elastic_ps(1, 3, max_workers=3, worker_timeout=1.0)
    sync = psframe.SyncReplicas(timeout=30.0)
    shard = batches_for(3, 4, 40, seed=5)
    polling = threading.Thread(target=server.join, kwargs={"timeout": DEADLINE_S}, daemon=True)
    polling.start()  # the server's loop looks for silent workers

    def work(index: int, stop_at: int, finish: bool) -> int:
        t = trainer(cluster, index, sync)
        t.connect()
        while t.global_step < stop_at:
            x, y = shard(t.global_step, index)
            t.step(torch.nn.functional.cross_entropy(t.model(x), y))
        if finish:
            t.close()  # a worker that dies never says so: its trainer is left as it is
        return t.global_step

    steps = run_workers({0: lambda: work(0, 12, True), 1: lambda: work(1, 12, True), 2: lambda: work(2, 4, False)})
    assert steps[2] == 4 and steps[0] >= 12
    changes = [(c.worker, c.change, c.global_step) for c in server.service.roster.changes]
    assert (2, Change.PRESUMED_DEAD, 5) in changes
    members = [tuple(w for w in range(3) if server.service.aggregator.was_member(w, s)) for s in range(12)]
    assert members == [(0, 1, 2)] * 4 + [(0, 1)] * 8
    polling.join(DEADLINE_S)
    assert not polling.is_alive()  # training over: the others finished, worker 2 presumed dead

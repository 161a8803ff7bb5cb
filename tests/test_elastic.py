"""Elastic clusters: workers join a running job and leave it (drained, or dead).

Unit tests of the parts (who is a member, the sync rule, the aggregator
following the live workers), then ps tasks in this process with workers in
threads: a worker of a grown worker list joins, another leaves; the job
goes on and ends when every member finished; and in sync training the
result equals one process on the combined batches of each round's members.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import psframe
from psframe.errors import ClusterMismatchError, WireFormatError
from psframe.launch import pick_free_ports
from psframe.ps.protocol.roster import Change, WorkerRoster, check_max_workers
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.store import VariableStore
from psframe.wire import messages
from tests.conftest import free_cluster
from tests.test_sync import batches_for, linear_model, run_workers

LR = 0.25
DEADLINE_S = 60.0

# ---- the parts, no network


def test_a_grown_worker_list_keeps_the_ps_fingerprint_and_changes_the_cluster_one():
    cluster = psframe.ClusterSpec({"ps": ["h0:1", "h0:2"], "worker": ["h1:1"]})
    grown = psframe.ClusterSpec({"ps": ["h0:1", "h0:2"], "worker": ["h1:1", "h2:1"]})
    other_ps = psframe.ClusterSpec({"ps": ["h0:1", "h0:3"], "worker": ["h1:1"]})
    assert grown.ps_fingerprint == cluster.ps_fingerprint != other_ps.ps_fingerprint
    assert grown.fingerprint != cluster.fingerprint


def test_max_workers_is_checked():
    assert check_max_workers(None, 2) == 2 and check_max_workers(5, 2) == 5
    for bad in (1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="max_workers must be an int >= the cluster's 2 workers"):
            check_max_workers(bad, 2)


def test_a_worker_of_another_slot_joins_when_first_heard_from_and_every_member_must_finish():
    roster = WorkerRoster(2, worker_timeout=60.0, capacity=4)
    assert roster.members() == [0, 1]
    with roster.call(3, step=7):
        pass
    assert roster.members() == [0, 1, 3]
    roster.finish(0, step=9)
    roster.finish(1, step=9)
    assert not roster.all_finished  # worker 3 joined and trains on
    assert roster.finish(3, step=12) and roster.all_finished
    assert roster.join(3, step=12)  # started again after it had left: a member again
    assert not roster.all_finished
    assert not roster.join(3, step=12)  # once
    kinds = [(c.worker, c.change, c.global_step) for c in roster.changes]
    assert kinds == [
        (3, Change.JOINED, 7),
        (0, Change.LEFT, 9),
        (1, Change.LEFT, 9),
        (3, Change.LEFT, 12),
        (3, Change.JOINED, 12),
    ]
    assert [w for w, _, _ in roster.seen()] == [0, 1, 3]  # status lists members, not empty slots


def test_the_sync_rule_follows_the_live_workers():
    everyone = psframe.SyncReplicas().resolve(2, elastic=True)
    assert everyone.fraction_to_aggregate == 1.0 and everyone.total_num_replicas is None
    assert [everyone.required(n) for n in (1, 2, 3, 5)] == [1, 2, 3, 5]
    share = psframe.SyncReplicas(fraction_to_aggregate=0.5).resolve(2, elastic=True)
    assert [share.required(n) for n in (1, 2, 3, 5)] == [1, 1, 2, 3]
    capped = psframe.SyncReplicas(replicas_to_aggregate=2).resolve(9, elastic=True)
    assert [capped.required(n) for n in (1, 2, 3, 5)] == [1, 2, 2, 2]
    # In a fixed cluster a fraction is a count.
    assert psframe.SyncReplicas(fraction_to_aggregate=0.6).resolve(4) == psframe.SyncReplicas(3, 4)
    with pytest.raises(ValueError, match="leave it unset"):
        psframe.SyncReplicas(total_num_replicas=2).resolve(2, elastic=True)
    with pytest.raises(ValueError, match="not both"):
        psframe.SyncReplicas(2, fraction_to_aggregate=0.5)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        psframe.SyncReplicas(fraction_to_aggregate=1.5)


def test_an_elastic_sync_definition_is_checked_both_ways():
    elastic = messages.sync_def(psframe.SyncReplicas().resolve(2, elastic=True))
    fixed = messages.sync_def(psframe.SyncReplicas().resolve(2))
    messages.check_definitions("ps", [], elastic, 2, elastic=True)
    messages.check_definitions("ps", [], fixed, 2)
    with pytest.raises(WireFormatError, match="takes workers joining and leaving"):
        messages.check_definitions("ps", [], fixed, 2, elastic=True)
    with pytest.raises(WireFormatError, match="expected 1 <= replicas_to_aggregate"):
        messages.check_definitions("ps", [], elastic, 2)
    assert messages.describe_sync(elastic) == "SyncReplicas(fraction_to_aggregate=1 of the live workers, timeout=300s)"
    assert messages.sync_from_def(elastic) == psframe.SyncReplicas(fraction_to_aggregate=1.0)


def aggregator(live: set[int]) -> tuple[SyncAggregator, VariableStore]:
    store = VariableStore("/job:ps/task:0")
    store.create({"w": torch.zeros(2)}, psframe.optim.SGD(lr=1.0))
    rule = psframe.SyncReplicas().resolve(len(live), elastic=True)
    sync = SyncAggregator(store, num_workers=len(live), replicas_to_aggregate=0, timeout=5.0, required=rule.required)
    sync.follow(live)
    return sync, store


def held(store: VariableStore) -> dict[str, torch.Tensor]:
    """A copy of what a store holds, by name."""
    names = store.names
    return {name: value.clone() for name, value in zip(names, store.read(names))}


def push(sync: SyncAggregator, worker: int, step: int, value: float) -> bool:
    return sync.push(worker, step, {"w": torch.full((2,), value)}, wait=False)


def test_a_joining_worker_counts_from_the_next_round_and_one_gone_leaves_at_once():
    sync, store = aggregator({0, 1})
    sync.follow({0, 1, 2})  # worker 2 joins during round 0
    push(sync, 2, 0, 100.0)  # not live at the round's start: late, dropped
    push(sync, 0, 0, 1.0)
    push(sync, 1, 0, 3.0)
    assert store.global_step == 1 and torch.equal(held(store)["w"], torch.full((2,), -2.0))
    assert not sync.was_member(2, 0) and sync.was_member(0, 0)
    push(sync, 0, 1, 1.0)
    push(sync, 1, 1, 2.0)
    assert store.global_step == 1  # round 1 waits for worker 2 too
    push(sync, 2, 1, 6.0)
    assert store.global_step == 2 and torch.equal(held(store)["w"], torch.full((2,), -5.0))
    push(sync, 0, 2, 1.0)
    sync.follow({0, 2})  # worker 1 presumed dead: round 2 no longer waits for it
    assert store.global_step == 2
    push(sync, 2, 2, 3.0)
    assert store.global_step == 3 and torch.equal(held(store)["w"], torch.full((2,), -7.0))
    assert sync.dropped_gradients == 1


# ---- ps tasks in this process, workers in threads


def grow(cluster: psframe.ClusterSpec, workers: int) -> psframe.ClusterSpec:
    """The cluster with ``workers`` more workers (on free ports), the same ps tasks."""
    more = [f"127.0.0.1:{port}" for port in pick_free_ports(workers)]
    return psframe.ClusterSpec({"ps": cluster.job_tasks("ps"), "worker": [*cluster.job_tasks("worker"), *more]})


@pytest.fixture
def elastic_ps():
    """Factory: a cluster of ``num_ps`` ps tasks in this process, given ``max_workers``; stopped at the end."""
    servers: list[psframe.Server] = []

    def make(num_ps: int, num_workers: int, max_workers: int | None, **options) -> psframe.ClusterSpec:
        cluster = free_cluster(num_ps, num_workers)
        servers.extend(
            psframe.Server(cluster, "ps", k, serving_processes=1, max_workers=max_workers, **options)
            for k in range(num_ps)
        )
        return cluster, servers[-num_ps:]

    yield make
    for server in servers:
        server.stop(grace=0.1)


def wait_for(condition, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout}s for {what}"
        time.sleep(0.01)


def trainer(cluster: psframe.ClusterSpec, index: int, sync: psframe.SyncReplicas | None = None) -> psframe.Trainer:
    return psframe.Trainer(
        linear_model(),
        cluster,
        task_index=index,
        optimizer=psframe.optim.SGD(lr=LR),
        sync=sync,
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
    )


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


def oracle(start: dict[str, torch.Tensor], shard, members: list[tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """One process training on the combined batches of each round's members, as the ps averages them."""
    model = linear_model()
    model.load_state_dict(start)
    params = list(model.parameters())
    for step, workers in enumerate(members):
        grads = []
        for w in workers:
            model.zero_grad()
            x, y = shard(step, w)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                total = grads[0][i] if len(grads) == 1 else grads[0][i] + grads[1][i]
                for g in grads[2:]:
                    total.add_(g[i])
                mean = total if len(grads) == 1 else total.div_(len(grads))
                p.add_(mean, alpha=-LR)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


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

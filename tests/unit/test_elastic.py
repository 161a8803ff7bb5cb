"""Elastic clusters: workers join a running job and leave it (drained, or dead).

Unit tests of the parts (who is a member, the sync rule, the aggregator
following the live workers), then ps tasks in this process with workers in
threads: a worker of a grown worker list joins, another leaves; the job
goes on and ends when every member finished; and in sync training the
result equals one process on the combined batches of each round's members.

This file holds the unit tier's tests of the subject; `tests/service/test_elastic.py` holds the
other tiers'.
"""

from __future__ import annotations

import time

import pytest
import torch

import psframe
from psframe.errors import WireFormatError
from psframe.launch import pick_free_ports
from psframe.ps.protocol.roster import Change, WorkerRoster, check_max_workers
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.store import VariableStore
from psframe.wire import messages
from tests.conftest import free_cluster
from tests.service.test_sync import linear_model

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

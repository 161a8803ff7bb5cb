"""Synchronous training (SyncReplicas) end to end: exact oracles and no hangs.

This file holds the service tier's tests of the subject; `tests/unit/test_sync.py`,
`tests/cluster/test_sync.py` hold the other tiers'.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import psframe
from psframe.errors import BarrierTimeoutError, ClusterMismatchError
from psframe.hooks import NanGuardHook
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient

THREAD_DEADLINE = 60.0


def run_workers(targets: dict[int, callable]) -> dict[int, object]:
    """Run one callable per worker in threads; return results, re-raise the first error."""
    results: dict[int, object] = {}

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_DEADLINE)
        assert not t.is_alive(), "a worker thread hung"
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return results


def linear_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def batches_for(num_workers: int, per_worker: int, steps: int, seed: int):
    """Worker i's batch at each step, all cut from one data set: ``shard(step, i)``."""
    x_all, y_all = data(seed, num_workers * per_worker * steps)

    def shard(step, worker):
        start = (step * num_workers + worker) * per_worker
        return x_all[start : start + per_worker], y_all[start : start + per_worker]

    return shard


def connect_all(trainers: dict[int, psframe.Trainer]) -> None:
    """The chief first (it creates the variables), then the others together."""
    run_workers({0: trainers[0].connect})
    run_workers({i: trainers[i].connect for i in trainers if i != 0})


def grads_of(model: torch.nn.Module, x, y) -> list[torch.Tensor]:
    copy = linear_model()
    copy.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(copy(x), y).backward()
    return [p.grad for p in copy.parameters()]


def test_two_workers_two_ps_one_update_is_v_minus_lr_mean_exactly(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=2)
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=2, timeout=30)
    lr = 0.5
    batches = {i: data(10 + i, 16) for i in range(2)}
    models = {i: linear_model(seed=i) for i in range(2)}
    initial = [p.detach().clone() for p in linear_model(seed=0).parameters()]  # the chief's
    trainers = {
        i: psframe.Trainer(
            models[i],
            cluster,
            task_index=i,
            optimizer=psframe.optim.SGD(lr=lr),
            sync=sync,
            placement=psframe.Placement(min_partition_bytes=64),
        )
        for i in range(2)
    }
    connect_all(trainers)
    expected_grads = [grads_of(models[i], *batches[i]) for i in range(2)]

    def step(i):
        x, y = batches[i]
        return trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))

    assert run_workers({i: (lambda i=i: step(i)) for i in range(2)}) == {0: 1, 1: 1}
    for p, v, g0, g1 in zip(models[0].parameters(), initial, *expected_grads):
        reference = v.clone().requires_grad_(True)
        reference.grad = (g0 + g1) / 2
        torch.optim.SGD([reference], lr=lr).step()
        assert torch.equal(p.detach(), reference.detach())
    for i in range(2):
        assert torch.equal(
            torch.cat([p.flatten() for p in models[0].parameters()]),
            torch.cat([p.flatten() for p in models[i].parameters()]),
        )
    run_workers({i: trainers[i].close for i in range(2)})


def test_backup_worker_a_slow_gradient_is_dropped_and_counted(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=3)
    lr = 0.25
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=3, timeout=30)
    models = {i: linear_model(seed=0) for i in range(3)}
    trainers = {
        i: psframe.Trainer(models[i], cluster, task_index=i, optimizer=psframe.optim.SGD(lr=lr), sync=sync)
        for i in range(3)
    }
    connect_all(trainers)
    batches = {i: data(20 + i, 16) for i in range(3)}
    initial = [p.detach().clone() for p in models[0].parameters()]
    expected_grads = {i: grads_of(models[i], *batches[i]) for i in range(3)}

    def step(i):
        x, y = batches[i]
        return trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))

    # Worker 2 is the slow one by construction: it pushes its gradient of step 0 only once the
    # round of workers 0 and 1 was applied.
    run_workers({i: (lambda i=i: step(i)) for i in range(2)})
    run_workers({2: lambda: step(2)})
    assert [trainers[i].stats.dropped_steps for i in range(3)] == [0, 0, 1]
    for p, v, g0, g1 in zip(models[0].parameters(), initial, expected_grads[0], expected_grads[1]):
        reference = v.clone().requires_grad_(True)
        reference.grad = (g0 + g1) / 2
        torch.optim.SGD([reference], lr=lr).step()
        assert torch.equal(p.detach(), reference.detach())
    # The slow worker went on with the new parameters, at the new step.
    assert trainers[2].global_step == 1
    for p, q in zip(models[0].parameters(), models[2].parameters()):
        assert torch.equal(p, q)
    client = PsClient(cluster, 0)
    try:
        infos = [control_calls.get_info(client, i) for i in range(2)]
    finally:
        client.close()
    assert [info.dropped_gradients for info in infos] == [1, 1]
    assert [info.global_step for info in infos] == [1, 1]
    run_workers({i: trainers[i].close for i in range(3)})


@pytest.mark.parametrize(
    "max_shard_bytes",
    [1 << 20, 64],  # one message per ps and step; or many (push-only messages, then pulls)
    ids=["one_message", "many_messages"],
)
@pytest.mark.parametrize(
    "optimizer",
    [psframe.optim.SGD(lr=0.2), psframe.optim.SGD(lr=0.1, momentum=0.9), psframe.optim.Adam(lr=0.01)],
    ids=["sgd", "momentum", "adam"],
)
def test_n_sync_workers_equal_one_process_on_the_combined_batch(local_cluster, optimizer, max_shard_bytes):
    num_workers, steps, per_worker = 3, 20, 8
    cluster = local_cluster(num_ps=2, num_workers=num_workers)
    shard = batches_for(num_workers, per_worker, steps, seed=99)
    models = {i: linear_model(seed=0) for i in range(num_workers)}
    reference = linear_model(seed=0)
    local_opt = getattr(torch.optim, optimizer.name)(reference.parameters(), **optimizer.kwargs)
    trainers = {
        i: psframe.Trainer(
            models[i],
            cluster,
            task_index=i,
            optimizer=optimizer,
            sync=psframe.SyncReplicas(timeout=30),
            placement=psframe.Placement(min_partition_bytes=32, max_shard_bytes=max_shard_bytes),
        )
        for i in range(num_workers)
    }
    if max_shard_bytes == 64:
        assert len(trainers[0]._session.replica.plan.pull) > 2 * cluster.num_ps  # several messages per ps task
    connect_all(trainers)

    def train(i):
        for step in range(steps):
            x, y = shard(step, i)
            trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))
        return trainers[i].global_step

    assert run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)}) == {
        i: steps for i in range(num_workers)
    }
    for step in range(steps):
        combined = [shard(step, i) for i in range(num_workers)]
        x = torch.cat([c[0] for c in combined])
        y = torch.cat([c[1] for c in combined])
        local_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        local_opt.step()
    for p, q in zip(models[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    run_workers({i: trainers[i].close for i in range(num_workers)})


def test_a_step_skipped_by_the_nan_guard_is_no_member_of_the_round(local_cluster):
    """Worker 2's loss turns NaN at step 1: NanGuardHook(fail_on_nan=False) drops its
    gradients and stops it. Its skipped step contributes nothing (it used to send zeros,
    averaged in as a member): step 1's update is the mean of workers 0 and 1 alone."""
    num_workers, steps, per_worker = 3, 3, 8
    cluster = local_cluster(num_ps=2, num_workers=num_workers)
    shard = batches_for(num_workers, per_worker, steps, seed=7)
    models = {i: linear_model(seed=0) for i in range(num_workers)}
    optimizer = psframe.optim.SGD(lr=0.2)
    trainers = {
        i: psframe.Trainer(
            models[i],
            cluster,
            task_index=i,
            optimizer=optimizer,
            sync=psframe.SyncReplicas(timeout=30),
            placement=psframe.Placement(min_partition_bytes=32),
            hooks=[NanGuardHook(fail_on_nan=False)] if i == 2 else [],
        )
        for i in range(num_workers)
    }
    connect_all(trainers)

    def train(i):
        for step in range(steps):
            x, y = shard(step, i)
            loss = torch.nn.functional.cross_entropy(models[i](x), y)
            trainers[i].step(loss * float("nan") if (i, step) == (2, 1) else loss)
            if trainers[i].should_stop():
                break
        trainers[i].close()
        return trainers[i].global_step, trainers[i].stats.skipped_steps

    results = run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)})
    assert results[0] == results[1] == (steps, 0)
    assert results[2] == (1, 1)  # one update applied, then a skipped step that only pulled
    reference = linear_model(seed=0)
    local_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step in range(steps):
        members = range(num_workers) if step == 0 else range(2)
        x = torch.cat([shard(step, i)[0] for i in members])
        y = torch.cat([shard(step, i)[1] for i in members])
        local_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        local_opt.step()
    for p, q in zip(models[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_workers_with_different_numbers_of_steps_all_finish(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=3)
    models = {i: linear_model(seed=0) for i in range(3)}
    trainers = {
        i: psframe.Trainer(models[i], cluster, task_index=i, sync=psframe.SyncReplicas(timeout=30)) for i in range(3)
    }
    connect_all(trainers)
    local_steps = {0: 5, 1: 12, 2: 20}

    def train_then_leave(i):
        x, y = data(i, 8)
        for _ in range(local_steps[i]):
            trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))
        trainers[i].close()  # leaves: the others go on with fewer replicas
        return trainers[i].global_step

    results = run_workers({i: (lambda i=i: train_then_leave(i)) for i in range(3)})
    # Steps 1-5 had 3 workers, 6-12 two, 13-20 one: the global step is 20.
    assert results[2] == 20
    assert results[0] == 5 and results[1] == 12


def test_a_worker_set_up_differently_is_refused(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2)
    with psframe.Trainer(linear_model(), cluster, task_index=0, sync=psframe.SyncReplicas(timeout=30)):
        with pytest.raises(ClusterMismatchError, match="SyncReplicas|synchronous|asynchronous"):
            psframe.Trainer(
                linear_model(), cluster, task_index=1, transport=psframe.Transport(connect_timeout=5)
            ).connect()


def test_a_missing_worker_without_backup_fails_the_barrier_naming_it(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=2)
    model = linear_model()
    trainer = psframe.Trainer(model, cluster, sync=psframe.SyncReplicas(timeout=1.0))
    with trainer:
        x, y = data(0, 8)
        started = time.monotonic()
        with pytest.raises(BarrierTimeoutError) as error:
            trainer.step(torch.nn.functional.cross_entropy(model(x), y))
        assert time.monotonic() - started < 30
    message = str(error.value)
    assert "sync step 0" in message
    assert "arrived: /job:worker/task:0" in message
    assert "missing: /job:worker/task:1" in message


# ---- multi-process: real SIGKILLs


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


# ----------------------------------------- the replies of a round (ps service, no network)


def _sync_service():
    from psframe.cluster import ClusterSpec
    from psframe.ps.service import ParameterServerService
    from psframe.wire import codec
    from psframe.wire import psframe_pb2 as pb

    cluster = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
    service = ParameterServerService(cluster, 0)
    service.store.create({"w": torch.zeros(3), "b": torch.zeros(2)}, psframe.optim.SGD(lr=1.0))
    service._start_sync(pb.SyncDef(replicas_to_aggregate=2, total_num_replicas=2, timeout_seconds=THREAD_DEADLINE))

    def push(worker: int, step: int, value: float) -> bytes:
        header = pb.PushPullHeader(
            caller=pb.Caller(job_name="worker", task_index=worker, cluster_fingerprint=cluster.fingerprint),
            step=step,
            pull=["w", "b"],
            end_of_step=True,
        )
        return service.push_pulls.answer(
            codec.encode(header, [("w", torch.full((3,), value)), ("b", torch.full((2,), value))])
        )

    def decoded(reply: bytes) -> tuple[pb.PushPullReplyHeader, list[torch.Tensor]]:
        return codec.decode(reply, pb.PushPullReplyHeader)

    return service, push, decoded

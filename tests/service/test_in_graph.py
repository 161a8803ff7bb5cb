"""In-graph replication: one worker process drives several replicas (``Trainer(replica_devices=...)``).

Oracles: synchronous training pushes the replicas' mean gradient once (the
values equal one SGD step on it, bit for bit); asynchronous training pushes
each replica's gradient as a step of its own (two global steps, each
applied in turn); every replica holds the ps tasks' values after a step.

This file holds the service tier's tests of the subject; `tests/cluster/test_in_graph.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from tests.conftest import params

LR = 0.125


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator)


def grads_at(values: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    replica = model()
    replica.load_state_dict(values)
    x, y = batch(seed)
    torch.nn.functional.mse_loss(replica(x), y).backward()
    return {name: p.grad for name, p in replica.named_parameters()}


def losses_of(trainer: psframe.Trainer) -> list[torch.Tensor]:
    return [torch.nn.functional.mse_loss(r(x), y) for r, (x, y) in zip(trainer.replicas, map(batch, range(3)))]


def trainer_of(cluster, replicas: int, sync: psframe.SyncReplicas | None = None) -> psframe.Trainer:
    return psframe.Trainer(
        model(),
        cluster,
        optimizer=psframe.optim.SGD(lr=LR),
        sync=sync,
        replica_devices=["cpu"] * replicas,
        transport=psframe.Transport(connect_timeout=30.0),
    )


def test_sync_pushes_the_replicas_mean_gradient_once(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    start = params(model())
    trainer = trainer_of(cluster, 3, psframe.SyncReplicas(timeout=30.0))
    with trainer:
        assert len(trainer.replicas) == 3
        assert trainer.step(losses_of(trainer)) == 1
        got = params(trainer.model)
        others = [params(r) for r in trainer.replicas[1:]]
    grads = [grads_at(start, seed) for seed in range(3)]
    for name, value in start.items():
        mean = (grads[0][name] + grads[1][name]).add_(grads[2][name]).div_(3)
        expected = value.clone().add_(mean, alpha=-LR)
        assert torch.equal(got[name], expected), name
        assert all(torch.equal(other[name], expected) for other in others), name


def test_async_pushes_each_replicas_gradient_as_a_step(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    start = params(model())
    trainer = trainer_of(cluster, 2)
    with trainer:
        losses = losses_of(trainer)
        assert trainer.step(losses) == 2  # one global step per replica
        got = params(trainer.replicas[1])
    grads = [grads_at(start, seed) for seed in range(2)]  # both at the step's start
    for name, value in start.items():
        expected = value.clone().add_(grads[0][name], alpha=-LR).add_(grads[1][name], alpha=-LR)
        assert torch.equal(got[name], expected), name


def test_the_replica_arguments_are_checked(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    with psframe.Trainer(model(), cluster, transport=psframe.Transport(connect_timeout=30.0)) as single:
        with pytest.raises(TypeError, match="only with replica_devices"):
            single.step([torch.zeros((), requires_grad=True)])
    with trainer_of(local_cluster(num_ps=1, num_workers=1), 2) as two:  # a job of its own: the one above ended
        with pytest.raises(TypeError, match="one loss per replica, as a list"):
            two.step(losses_of(two)[0])
        with pytest.raises(ValueError, match="one loss per replica: 2, got 1"):
            two.step(losses_of(two)[:1])
    table = torch.nn.Sequential(torch.nn.Embedding(10, 2, sparse=True))
    with pytest.raises(ValueError, match="without embedding tables"):
        psframe.Trainer(table, cluster, replica_devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="must be the first of replica_devices"):
        psframe.Trainer(model(), cluster, device="cpu", replica_devices=["meta", "cpu"])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_replicas_on_two_gpus_hold_the_same_values_after_a_step(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    trainer = psframe.Trainer(
        model(),
        cluster,
        optimizer=psframe.optim.SGD(lr=LR),
        sync=psframe.SyncReplicas(timeout=30.0),
        replica_devices=["cuda:0", "cuda:1"],
    )
    with trainer:
        for _ in range(3):
            trainer.step(
                [
                    torch.nn.functional.mse_loss(r(x.to(d)), y.to(d))
                    for r, d, (x, y) in zip(trainer.replicas, ("cuda:0", "cuda:1"), map(batch, range(2)))
                ]
            )
        first, second = (params(r) for r in trainer.replicas)
    assert all(torch.equal(first[n].cpu(), second[n].cpu()) for n in first)


def test_async_replicas_read_in_ranges_record_each_batch_once(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1)
    ranges = psframe.DataRanges("train", 40, batch_size=4, range_size=8, shuffle=False)
    x, y = torch.randn(40, 6), torch.randn(40, 2)
    seen = []
    with trainer_of(cluster, 2) as trainer:
        for indices in trainer.read(ranges):  # one batch a step, split between the replicas
            halves = indices.chunk(2)
            trainer.step([torch.nn.functional.mse_loss(r(x[h]), y[h]) for r, h in zip(trainer.replicas, halves)])
            seen += indices.tolist()
        assert trainer.stats.dropped_steps == 0 and trainer.global_step == 20
    assert seen == list(range(40))

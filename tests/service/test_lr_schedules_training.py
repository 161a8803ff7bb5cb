"""Learning-rate schedules through the ps tasks: SGD and Adam with a schedule train as one process
with that scheduler (asynchronous and synchronous, embedding tables included), a restore goes on
with the schedule where it stood, and the chief's metric reaches every ps task's ReduceLROnPlateau.

This file holds the service tier's tests of the subject;
`tests/cluster/test_lr_schedules_training.py` holds the other tiers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as torch_schedules

import psframe
from psframe.errors import OptimizerConfigError, PsframeError
from psframe.local import LocalCluster
from psframe.optim import lr_scheduler as schedules
from psframe.optim.rows_kernels import SparseSGD
from tests.service.test_sync import batches_for, connect_all, linear_model, run_workers
from tests.service.test_tables import Recommender, local_step, loss_of, pull_every_row

# The ps tasks serve in this process (psframe.local_cluster): the service tier, marked by hand.
service = pytest.mark.service


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def mlp_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return F.cross_entropy(model(x), y)


class OneProcess:
    """The oracle: ``model`` trained in this process by ``optimizer``'s torch optimizer, with
    ``optimizer.step(); scheduler.step()`` per step (``scheduler.step(metric)`` for a plateau)."""

    def __init__(self, model: torch.nn.Module, optimizer: psframe.optim.OptimizerSpec, make_scheduler) -> None:
        self.model = model
        self.optimizer = getattr(torch.optim, optimizer.name)(model.parameters(), **optimizer.kwargs)
        self.scheduler = make_scheduler(self.optimizer)

    def step(self, step: int) -> None:
        self.optimizer.zero_grad()
        mlp_loss(self.model, step).backward()
        self.optimizer.step()
        if not isinstance(self.scheduler, torch_schedules.ReduceLROnPlateau):
            self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def ps_rates(local: LocalCluster | list[psframe.Server]) -> list[float | None]:
    """Each ps task's dense learning rate at its global step now (of those holding a model)."""
    rates = []
    for server in local.ps_servers if isinstance(local, LocalCluster) else local:
        if not server.service.store.ready:
            continue
        store = server.service.store
        with store.lock:
            rates.append(store.schedules.learning_rate())
    return rates


def assert_same(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs"


ASYNC_CASES = [
    (
        psframe.optim.SGD(lr=0.2, momentum=0.9, schedule=schedules.StepLR(step_size=3, gamma=0.5)),
        lambda o: torch_schedules.StepLR(o, 3, 0.5),
    ),
    (
        psframe.optim.Adam(
            lr=0.02,
            schedule=schedules.SequentialLR(
                schedulers=[schedules.LinearLR(start_factor=0.1, total_iters=4), schedules.CosineAnnealingLR(T_max=8)],
                milestones=[4],
            ),
        ),
        lambda o: torch_schedules.SequentialLR(
            o, [torch_schedules.LinearLR(o, 0.1, total_iters=4), torch_schedules.CosineAnnealingLR(o, 8)], [4]
        ),
    ),
    (
        psframe.optim.Adam(lr=0.02, schedule=schedules.OneCycleLR(max_lr=0.05, total_steps=12)),
        lambda o: torch_schedules.OneCycleLR(o, 0.05, total_steps=12),
    ),
]


@service
@pytest.mark.parametrize(
    "optimizer,make_scheduler", ASYNC_CASES, ids=["sgd_step", "adam_warmup_cosine", "adam_one_cycle"]
)
def test_a_schedule_trains_as_one_process_with_that_scheduler(optimizer, make_scheduler):
    model = make_model()
    reference = OneProcess(make_model(), optimizer, make_scheduler)
    placement = psframe.Placement(min_partition_bytes=64)  # the first layer cut across both ps tasks
    with psframe.local_cluster(num_ps=2, num_workers=1) as local:
        with psframe.Trainer(model, local.cluster, optimizer=optimizer, placement=placement) as trainer:
            for step in range(10):
                assert ps_rates(local) == [reference.lr] * 2  # the rate the next update uses, on every ps task
                assert trainer.step(mlp_loss(model, step)) == step + 1
                reference.step(step)
                assert_same(model, reference.model)
    assert reference.lr != optimizer.kwargs["lr"]


def test_sync_workers_with_a_schedule_equal_one_process_on_the_combined_batch(local_cluster):
    num_workers, steps, per_worker = 2, 8, 6
    cluster = local_cluster(num_ps=2, num_workers=num_workers)
    optimizer = psframe.optim.Adam(lr=0.05, schedule=schedules.MultiStepLR(milestones=[2, 5], gamma=0.3))
    shard = batches_for(num_workers, per_worker, steps, seed=5)
    models = {i: linear_model(seed=0) for i in range(num_workers)}
    reference = linear_model(seed=0)
    local_opt = torch.optim.Adam(reference.parameters(), lr=0.05)
    local_schedule = torch_schedules.MultiStepLR(local_opt, [2, 5], 0.3)
    trainers = {
        i: psframe.Trainer(
            models[i],
            cluster,
            task_index=i,
            optimizer=optimizer,
            sync=psframe.SyncReplicas(timeout=30),
            placement=psframe.Placement(min_partition_bytes=32),
        )
        for i in range(num_workers)
    }
    connect_all(trainers)

    def train(i):
        for step in range(steps):
            x, y = shard(step, i)
            trainers[i].step(F.cross_entropy(models[i](x), y))
        return trainers[i].global_step

    assert run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)}) == {0: steps, 1: steps}
    for step in range(steps):  # one round per global step: one scheduler step per round
        combined = [shard(step, i) for i in range(num_workers)]
        local_opt.zero_grad()
        F.cross_entropy(reference(torch.cat([c[0] for c in combined])), torch.cat([c[1] for c in combined])).backward()
        local_opt.step()
        local_schedule.step()
    for p, q in zip(models[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    run_workers({i: trainers[i].close for i in range(num_workers)})


@service
@pytest.mark.parametrize(
    "optimizer,table_local",
    [
        (psframe.optim.Adam(lr=0.02, schedule=schedules.ExponentialLR(gamma=0.7)), torch.optim.SparseAdam),
        (psframe.optim.SGD(lr=0.1, momentum=0.9, schedule=schedules.ExponentialLR(gamma=0.7)), SparseSGD),
    ],
    ids=["adam", "momentum"],
)
def test_the_rows_of_embedding_tables_follow_the_schedule(optimizer, table_local):
    model, reference = Recommender(), Recommender()
    tables = [reference.emb.weight, reference.bag.weight]
    dense_opt = getattr(torch.optim, optimizer.name)([reference.head.weight, reference.head.bias], **optimizer.kwargs)
    table_opt = table_local(tables, **optimizer.for_tables().kwargs)
    local_schedules = [torch_schedules.ExponentialLR(dense_opt, 0.7), torch_schedules.ExponentialLR(table_opt, 0.7)]
    with psframe.local_cluster(num_ps=2, num_workers=1) as local:
        with psframe.Trainer(model, local.cluster, optimizer=optimizer) as trainer:
            assert trainer.table_optimizer.schedule == optimizer.schedule
            for step in range(6):
                trainer.step(loss_of(model, step))
                local_step(reference, dense_opt, table_opt, step)
                for schedule in local_schedules:
                    schedule.step()
            pull_every_row(model)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert torch.equal(p, q), f"{name} differs"
            for server in local.ps_servers:
                store = server.service.store
                with store.lock:
                    assert store.schedules.tables.hyperparameters()["lr"] == table_opt.param_groups[0]["lr"]


@service
@pytest.mark.parametrize("restores", ["chief", "ps"], ids=["chief_restores", "ps_restores_its_shard"])
def test_a_restore_goes_on_with_the_schedule_where_it_stood(tmp_path, restores):
    url = str(tmp_path / "ckpt")
    optimizer = psframe.optim.SGD(lr=0.2, momentum=0.9, schedule=schedules.StepLR(step_size=3, gamma=0.5))
    reference = OneProcess(make_model(), optimizer, lambda o: torch_schedules.StepLR(o, 3, 0.5))
    options = {"optimizer": optimizer, "checkpointing": psframe.Checkpointing(url)}
    with psframe.local_cluster(num_ps=2, num_workers=1) as local:
        model = make_model()
        with psframe.Trainer(model, local.cluster, **options) as trainer:
            for step in range(5):
                trainer.step(mlp_loss(model, step))
                reference.step(step)
    # Another cluster, a chief with another initialisation: the checkpoint of step 5 is restored.
    server_options = {"checkpoint_dir": url} if restores == "ps" else {}
    with psframe.local_cluster(num_ps=2, num_workers=1, **server_options) as local:
        if restores == "ps":
            for server in local.ps_servers:
                assert server.service.store.ready  # restored its own shard when it started
        model = make_model(seed=7)
        with psframe.Trainer(model, local.cluster, **options) as trainer:
            assert trainer.global_step == 5
            assert ps_rates(local) == [reference.lr] * 2 == [0.1] * 2
            for step in range(5, 10):
                trainer.step(mlp_loss(model, step))
                reference.step(step)
                assert_same(model, reference.model)


@service
def test_the_chiefs_metric_reaches_every_ps_tasks_plateau_schedule(tmp_path):
    url = str(tmp_path / "ckpt")
    schedule = schedules.ReduceLROnPlateau(factor=0.25, patience=1)
    optimizer = psframe.optim.SGD(lr=0.2, schedule=schedule)
    reference = OneProcess(
        make_model(), optimizer, lambda o: torch_schedules.ReduceLROnPlateau(o, factor=0.25, patience=1)
    )
    losses = iter([1.0, 0.8, 0.85, 0.9, 0.7, 0.75, 0.72, 0.8])
    with psframe.local_cluster(num_ps=2, num_workers=2) as local:
        model = make_model()
        with psframe.Trainer(
            model, local.cluster, optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
        ) as chief:
            with psframe.Trainer(make_model(), local.cluster, task_index=1, optimizer=optimizer) as other:
                with pytest.raises(PsframeError, match="the chief .* reports metrics"):
                    other.report_metric(1.0)
            for epoch in range(8):  # an "epoch" of two steps, then a validation loss
                for step in (2 * epoch, 2 * epoch + 1):
                    chief.step(mlp_loss(model, step))
                    reference.step(step)
                loss = next(losses)
                assert chief.report_metric(loss) == chief.global_step == 2 * epoch + 2
                reference.scheduler.step(loss)
                assert ps_rates(local) == [reference.lr] * 2
                assert_same(model, reference.model)
            assert reference.lr == 0.2 * 0.25**2  # divided twice
    # Restored, the plateau goes on with its best and counts.
    with psframe.local_cluster(num_ps=2, num_workers=1) as local:
        model = make_model(seed=3)
        with psframe.Trainer(
            model, local.cluster, optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
        ) as chief:
            assert ps_rates(local) == [reference.lr] * 2
            for loss in (0.9, 0.95):  # no better than the best: the rate falls again
                chief.report_metric(loss)
                reference.scheduler.step(loss)
            assert ps_rates(local) == [reference.lr] * 2 == [0.2 * 0.25**3] * 2


@service
def test_a_metric_without_a_plateau_schedule_is_refused_by_the_ps_tasks():
    with psframe.local_cluster(num_ps=1, num_workers=1) as local:
        model = make_model()
        with psframe.Trainer(model, local.cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
            with pytest.raises(OptimizerConfigError, match="no optimizer here has a ReduceLROnPlateau schedule"):
                trainer.report_metric(1.0)


@service
def test_a_re_layout_moves_the_schedule_with_the_optimizer_state():
    from tests.service.test_relayout import clusters

    schedule = schedules.ReduceLROnPlateau(factor=0.5, patience=0)  # state only the clock keeps
    optimizer = psframe.optim.Adam(lr=0.02, schedule=schedule)
    reference = OneProcess(
        make_model(), optimizer, lambda o: torch_schedules.ReduceLROnPlateau(o, factor=0.5, patience=0)
    )
    cluster, grown = clusters(2, 1)
    servers = [psframe.Server(grown if k == 2 else cluster, "ps", k, serving_processes=1) for k in range(3)]
    try:
        model = make_model()
        placement = psframe.Placement(min_partition_bytes=64)
        with psframe.Trainer(model, cluster, optimizer=optimizer, placement=placement) as chief:
            for step in range(9):
                if step == 3:
                    chief.reshard(grown)  # onto three ps tasks
                if step == 6:
                    chief.reshard(cluster)  # and back
                chief.step(mlp_loss(model, step))
                reference.step(step)
                chief.report_metric(float(10 - step % 2))  # worse every other step: the rate halves
                reference.scheduler.step(float(10 - step % 2))
                assert_same(model, reference.model)
            assert reference.lr == 0.02 * 0.5**7  # halved at every metric but the first two
            assert ps_rates(servers) == [reference.lr] * 2  # the layout trained on at the end
    finally:
        for server in servers:
            server.stop(grace=0.1)


@service
def test_a_delta_checkpoint_keeps_where_the_schedule_stood(tmp_path):
    url = str(tmp_path / "ckpt")
    optimizer = psframe.optim.SGD(lr=0.4, schedule=schedules.ReduceLROnPlateau(factor=0.5, patience=0))
    with psframe.local_cluster(num_ps=1, num_workers=1) as local:
        model = make_model()
        with psframe.Trainer(model, local.cluster, optimizer=optimizer, checkpointing=psframe.Checkpointing(url)) as t:
            t.step(mlp_loss(model, 0))
            t.report_metric(1.0)
            t.save_checkpoint()
            t.step(mlp_loss(model, 1))
            t.report_metric(2.0)  # worse: halved after the full checkpoint
            assert t.save_delta().parent == 1
            t.request_stop()
        rate = ps_rates(local)
    assert rate == [0.2]
    assert psframe.checkpoint.latest_chain(url).last.parent == 1  # the delta is the newest checkpoint
    with psframe.local_cluster(num_ps=1, num_workers=1, checkpoint_dir=url) as local:
        assert ps_rates(local) == [0.2]

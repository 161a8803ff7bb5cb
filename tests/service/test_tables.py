"""Embedding tables through the ps tasks: only the rows a batch uses travel, and the
result is one process's, optimizer by optimizer.

This file holds the service tier's tests of the subject; `tests/unit/test_tables.py` holds the other
tiers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.cluster.placement import ShardPlacement
from psframe.errors import OptimizerConfigError, RowIdError
from psframe.optim.rows_kernels import SparseSGD
from psframe.tables.spec import part_owners
from psframe.worker.client import control_calls

ROWS, BAG_ROWS, DIM = 37, 23, 4


class Recommender(torch.nn.Module):
    """Two tables (an Embedding and an EmbeddingBag, sparse) and a dense head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        self.bag = torch.nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum", sparse=True)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(ids).mean(1), self.bag(bag_ids, offsets)], 1)).squeeze(1)


def batch(step: int, size: int = 8):
    """Ids with repeats, skewed to low ids (as real features are)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = (torch.rand(size, 3, generator=g) ** 3 * ROWS).long()
    bag_ids = torch.randint(0, BAG_ROWS, (2 * size,), generator=g)
    offsets = torch.arange(0, 2 * size, 2)
    target = torch.rand(size, generator=g)
    return ids, bag_ids, offsets, target


def loss_of(model: Recommender, step: int) -> torch.Tensor:
    ids, bag_ids, offsets, target = batch(step)
    return F.mse_loss(model(ids, bag_ids, offsets), target)


TABLES = {"emb.weight", "bag.weight"}


def local_step(model: Recommender, dense_opt, table_opt, step: int) -> None:
    dense_opt.zero_grad()
    table_opt.zero_grad()
    loss_of(model, step).backward()
    for p in (model.emb.weight, model.bag.weight):
        p.grad = p.grad.coalesce()  # duplicates summed first, as the worker pushes them
    dense_opt.step()
    table_opt.step()


def pull_every_row(model: Recommender) -> None:
    """Look up every id once, so the hooks pull the whole tables into the local weights."""
    with torch.no_grad():
        model.emb(torch.arange(ROWS).unsqueeze(0))
        model.bag(torch.arange(BAG_ROWS), torch.tensor([0]))


CASES = [
    # (model optimizer, table optimizer or None, the local torch classes and kwargs)
    (psframe.optim.SGD(lr=0.1), None, (torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1})),
    (
        psframe.optim.SGD(lr=0.1, momentum=0.9),
        None,
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (SparseSGD, {"lr": 0.1, "momentum": 0.9}),
    ),
    (
        psframe.optim.SGD(lr=0.1),
        psframe.optim.SGD(lr=0.05, momentum=0.5, nesterov=True),
        (torch.optim.SGD, {"lr": 0.1}),
        (SparseSGD, {"lr": 0.05, "momentum": 0.5, "nesterov": True}),
    ),
    (psframe.optim.Adagrad(lr=0.1), None, (torch.optim.Adagrad, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1})),
    (psframe.optim.Adam(lr=0.01), None, (torch.optim.Adam, {"lr": 0.01}), (torch.optim.SparseAdam, {"lr": 0.01})),
]


@pytest.mark.parametrize("partition", ["mod", "range"])
@pytest.mark.parametrize(
    "optimizer,table_optimizer,dense_local,table_local",
    CASES,
    ids=["sgd", "momentum", "nesterov-table", "adagrad", "adam"],
)
def test_tables_train_as_one_process(local_cluster, partition, optimizer, table_optimizer, dense_local, table_local):
    train_as_one_process(local_cluster, partition, optimizer, table_optimizer, dense_local, table_local)


@pytest.mark.parametrize("partition", ["mod", "range"])
def test_tables_cut_into_more_parts_than_ps_tasks_train_as_one_process(local_cluster, partition):
    _, _, dense_local, table_local = CASES[-1]  # Adam: element-wise state in every part
    placement = train_as_one_process(
        local_cluster, partition, psframe.optim.Adam(lr=0.01), None, dense_local, table_local, table_parts=5
    )
    parts = [s for s in placement.shards if s.variable == "emb.weight"]
    assert [s.ps_task for s in parts] == list(part_owners(5, 2)) == [0, 0, 0, 1, 1] and {
        s.num_parts for s in parts
    } == {5}


def train_as_one_process(
    local_cluster, partition, optimizer, table_optimizer, dense_local, table_local, table_parts=None
) -> ShardPlacement:
    """Six steps on two ps tasks equal six of one process, bit for bit; the placement trained on."""
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = Recommender(), Recommender()
    tables = [reference.emb.weight, reference.bag.weight]
    dense_opt = dense_local[0]([reference.head.weight, reference.head.bias], **dense_local[1])
    table_opt = table_local[0](tables, **table_local[1])
    with psframe.Trainer(
        model,
        cluster,
        optimizer=optimizer,
        table_optimizer=table_optimizer,
        placement=psframe.Placement(table_partition=partition, table_parts=table_parts),
    ) as trainer:
        parts = [s for s in trainer.placement.shards if s.table]
        assert {s.ps_task for s in parts} == {0, 1} and {s.variable for s in parts} == TABLES
        for step in range(6):
            trainer.step(loss_of(model, step))
            local_step(reference, dense_opt, table_opt, step)
        pull_every_row(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"{name} differs"
        return trainer.placement


def test_a_step_moves_the_rows_it_uses_not_the_table(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Recommender()
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
        pulled = []
        pull_rows = trainer._session.client.pull_rows

        def counting(wanted, step, create=True):
            pulled.append(sum(int(ids.numel()) for pulls in wanted.values() for _, ids in pulls))
            return pull_rows(wanted, step, create)

        trainer._session.client.pull_rows = counting
        ids, bag_ids, offsets, target = batch(0)
        trainer.step(F.mse_loss(model(ids, bag_ids, offsets), target))
        # One pull per table, of its distinct ids only.
        assert pulled == [len(torch.unique(ids)), len(torch.unique(bag_ids))]
        infos = [control_calls.get_info(trainer._session.client, k) for k in range(2)]
        assert sum(info.applied_steps for info in infos) > 0


def test_bad_ids_are_refused_naming_the_table(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Recommender()
    with psframe.Trainer(model, cluster) as trainer:
        before = model.emb.weight.detach().clone()
        for bad in (ROWS, -1):
            with pytest.raises(RowIdError, match=f"id {bad} .*'emb.weight'"):
                model.emb(torch.tensor([[0, bad]]))
        client = trainer._session.client
        part = next(s for s in trainer.placement.shards if s.table and s.ps_task == 1)
        # Straight to a ps task: out of its part, negative, the wrong dtype or width, no such table.
        for ids, rows, match in [
            (torch.tensor([part.shape[0]]), torch.zeros(1, DIM), "outside table"),
            (torch.tensor([-3]), torch.zeros(1, DIM), "outside table"),
            (torch.tensor([0], dtype=torch.int32), torch.zeros(1, DIM), "int64"),
            (torch.tensor([0]), torch.zeros(1, DIM + 1), "shape"),
            (torch.tensor([0]), torch.zeros(1, DIM, dtype=torch.float64), "dtype"),
        ]:
            with pytest.raises(psframe.errors.InvalidGradientError, match=match):
                client.push_pull([], 0, rows={1: [(part.name, ids, rows)]})
        with pytest.raises(psframe.errors.UnknownVariableError, match="no variable 'nope'"):
            client.push_pull([], 0, rows={1: [("nope", torch.tensor([0]), torch.zeros(1, DIM))]})
        with pytest.raises(psframe.errors.UnknownVariableError, match="not an embedding table"):
            client.pull_rows({0: [("head.weight", torch.tensor([0]))]}, 0)
        pull_every_row(model)
        assert torch.equal(model.emb.weight, before)  # nothing stored changed
        assert sum(control_calls.get_info(client, k).rejected_pushes for k in range(2)) == 6


@pytest.mark.parametrize(
    "optimizer,match",
    [
        (psframe.optim.RMSprop(lr=0.1), "table_optimizer"),
        (psframe.optim.SGD(lr=0.1, weight_decay=0.1), "weight_decay"),
        (psframe.optim.Adam(lr=0.1, amsgrad=True), "amsgrad"),
    ],
)
def test_optimizers_without_a_row_by_row_form_are_refused_up_front(local_cluster, optimizer, match):
    cluster = local_cluster(num_ps=1, num_workers=1, start_ps=False)
    with pytest.raises(OptimizerConfigError, match=match):
        psframe.Trainer(Recommender(), cluster, optimizer=optimizer)


def test_tables_that_cannot_be_followed_are_refused(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=1, start_ps=False)
    model = Recommender()
    model.emb.max_norm = 1.0
    with pytest.raises(ValueError, match="max_norm"):
        psframe.Trainer(model, cluster)
    tied = Recommender()
    tied.other = torch.nn.Linear(ROWS, DIM, bias=False)
    tied.other.weight = tied.emb.weight
    with pytest.raises(ValueError, match="tied"):
        psframe.Trainer(tied, cluster)


def test_checkpoints_hold_whole_tables_and_restore_onto_another_number_of_ps_tasks(local_cluster, url):
    optimizer = psframe.optim.Adagrad(lr=0.3)
    reference = Recommender()
    dense_opt = torch.optim.Adagrad([reference.head.weight, reference.head.bias], lr=0.3)
    table_opt = torch.optim.Adagrad([reference.emb.weight, reference.bag.weight], lr=0.3)
    model = Recommender()
    with psframe.Trainer(
        model, local_cluster(num_ps=2, num_workers=1), optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
    ) as trainer:
        for step in range(3):
            trainer.step(loss_of(model, step))
            local_step(reference, dense_opt, table_opt, step)
    # (The chief saved a checkpoint as it closed.) The tables come back whole,
    # every row in its place, from parts holding every other row.
    loaded = psframe.checkpoint.load(url)
    for name, param in reference.named_parameters():
        assert torch.equal(loaded[name], param), name
    # Three ps tasks now: each table part takes every third row of the checkpoint, with its optimizer state.
    again = Recommender(seed=5)
    with psframe.Trainer(
        again, local_cluster(num_ps=3, num_workers=1), optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
    ) as trainer:
        assert {s.ps_task for s in trainer.placement.shards if s.table} == {0, 1, 2}
        pull_every_row(again)
        for name, param in reference.named_parameters():
            assert torch.equal(dict(again.named_parameters())[name], param), name
        trainer.step(loss_of(again, 3))
        local_step(reference, dense_opt, table_opt, 3)
        pull_every_row(again)
        for name, param in reference.named_parameters():
            assert torch.equal(dict(again.named_parameters())[name], param), name


@pytest.mark.parametrize(
    "optimizer,table_local",
    [
        (psframe.optim.SGD(lr=0.2), (torch.optim.SGD, {"lr": 0.2})),
        (psframe.optim.Adagrad(lr=0.1), (torch.optim.Adagrad, {"lr": 0.1})),
        (psframe.optim.Adam(lr=0.01), (torch.optim.SparseAdam, {"lr": 0.01})),
    ],
    ids=["sgd", "adagrad", "adam"],
)
def test_n_sync_workers_equal_one_process_on_the_combined_batch(local_cluster, optimizer, table_local):
    from tests.service.test_sync import connect_all, run_workers

    num_workers, steps = 3, 6
    cluster = local_cluster(num_ps=2, num_workers=num_workers)
    models = {i: Recommender() for i in range(num_workers)}
    # The head on ps 0: ps 1 holds table parts only, so its step is the rows' message alone.
    devices = {"head.weight": "/job:ps/task:0", "head.bias": "/job:ps/task:0"}
    trainers = {
        i: psframe.Trainer(
            models[i],
            cluster,
            task_index=i,
            optimizer=optimizer,
            placement=psframe.Placement(variable_devices=devices),
            sync=psframe.SyncReplicas(timeout=30),
        )
        for i in range(num_workers)
    }
    assert {s.ps_task for s in trainers[0].placement.shards if not s.table} == {0}
    connect_all(trainers)

    def train(i):
        for step in range(steps):
            trainers[i].step(loss_of(models[i], step * num_workers + i))
        return trainers[i].global_step

    assert run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)}) == dict.fromkeys(
        range(num_workers), steps
    )
    reference = Recommender()
    dense_opt = getattr(torch.optim, optimizer.name)([reference.head.weight, reference.head.bias], **optimizer.kwargs)
    table_opt = table_local[0]([reference.emb.weight, reference.bag.weight], **table_local[1])
    for step in range(steps):
        parts = [batch(step * num_workers + i) for i in range(num_workers)]
        ids, bag_ids, _, target = (torch.cat([p[k] for p in parts]) for k in range(4))
        offsets = torch.arange(0, bag_ids.numel(), 2)
        dense_opt.zero_grad()
        table_opt.zero_grad()
        F.mse_loss(reference(ids, bag_ids, offsets), target).backward()
        dense_opt.step()
        table_opt.step()
    pull_every_row(models[1])
    for (name, p), q in zip(models[1].named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    run_workers({i: trainers[i].close for i in range(num_workers)})


class Options(torch.nn.Module):
    """Tables with the options a lookup in the pulled rows alone must keep (torch refuses
    scale_grad_by_freq with sparse gradients, so a table never has it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(ROWS, DIM, padding_idx=3, sparse=True)
        self.mean_bag = torch.nn.EmbeddingBag(
            BAG_ROWS, DIM, mode="mean", padding_idx=0, sparse=True, include_last_offset=True
        )
        self.weighted_bag = torch.nn.EmbeddingBag(BAG_ROWS, DIM, mode="sum", sparse=True)
        self.head = torch.nn.Linear(3 * DIM, 1)

    def forward(self, ids, bag_ids, offsets, weights):
        mean = self.mean_bag(bag_ids, torch.cat([offsets, torch.tensor([bag_ids.numel()])]))
        return self.head(
            torch.cat([self.emb(ids).sum(1), mean, self.weighted_bag(bag_ids, offsets, weights)], 1)
        ).squeeze(1)


def test_padding_and_bag_options_train_as_one_process(local_cluster):
    model, reference = Options(), Options()
    opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    with psframe.Trainer(model, local_cluster(num_ps=2, num_workers=1), optimizer=psframe.optim.SGD(lr=0.3)) as trainer:
        for step in range(4):
            ids, bag_ids, offsets, target = batch(step)
            ids[0, 0] = ids[1, 1] = 3  # the padding id, twice
            bag_ids[:3] = 0
            weights = torch.rand(bag_ids.numel(), generator=torch.Generator().manual_seed(step))
            trainer.step(F.mse_loss(model(ids, bag_ids, offsets, weights), target))
            opt.zero_grad()
            F.mse_loss(reference(ids, bag_ids, offsets, weights), target).backward()
            for p in (reference.emb.weight, reference.mean_bag.weight, reference.weighted_bag.weight):
                p.grad = p.grad.coalesce()
            opt.step()
        with torch.no_grad():  # every row, pulled into the local weights
            model.emb(torch.arange(ROWS).unsqueeze(0))
            model.mean_bag(torch.arange(BAG_ROWS), torch.tensor([0, BAG_ROWS]))
            model.weighted_bag(torch.arange(BAG_ROWS), torch.tensor([0]))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{name} differs"

"""FTRL-Proximal and row-wise Adagrad as the table optimizer of ps tasks: trained through two ps
tasks as one process applying the published formulas, and restored from full and delta
checkpoints to go on bit for bit.

This file holds the service tier's tests of the subject; `tests/unit/test_table_optimizers.py` holds the
other tiers' (and the references used here).
"""

from __future__ import annotations

import fsspec
import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe import checkpoint
from psframe.tables.row_math import initial_rows
from psframe.tables.spec import RowInitializer
from tests.service.test_delta_checkpoints import save_full
from tests.service.test_relayout import clusters, ps_tasks  # noqa: F401
from tests.unit.test_table_optimizers import ftrl_reference, rowwise_adagrad_reference

ROWS, DIM = 20, 4
INIT = RowInitializer(std=0.3, seed=5)
DENSE_LR = 0.1
TABLE_OPTIMIZERS = {
    "ftrl": psframe.optim.Ftrl(lr=0.2, l1=1e-3, l2=1e-2, l2_shrinkage=1e-3),
    "rowwise-adagrad": psframe.optim.RowWiseAdagrad(lr=0.2, eps=1e-8),
}


class Clicks(torch.nn.Module):
    """A fixed table, a dynamic table and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.Embedding(ROWS, DIM, sparse=True)
        self.users = psframe.DynamicEmbedding(DIM, initializer=INIT)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(users).mean(1), self.items(items).mean(1)], 1)).squeeze(1)


def batch(step: int, size: int = 8):
    """Ids with repeats; the fixed table's last rows are never used."""
    g = torch.Generator().manual_seed(500 + step)
    users = torch.randint(0, 15, (size, 3), generator=g) * 7919 - 2**33
    items = torch.randint(0, ROWS - 4, (size, 2), generator=g)
    return users, items, torch.rand(size, generator=g)


class Reference:
    """One process training the same model with the formulas of the unit tier's references:
    SGD on the head, the table optimizer on the rows each batch's gradient names."""

    def __init__(self, name: str, kwargs: dict) -> None:
        model = Clicks()
        self.name, self.kwargs = name, kwargs
        self.head = model.head
        self.tables: dict[str, dict] = {"items": self._table(model.items.weight.detach())}
        self.user_ids: list[int] = []
        self.tables["users"] = self._table(torch.empty(0, DIM))

    def _table(self, weight: torch.Tensor) -> dict:
        rows = weight.double().tolist()
        if self.name == "ftrl":
            start = self.kwargs.get("initial_accumulator_value", 0.1)
            return {"w": rows, "n": [[start] * DIM for _ in rows], "z": [[0.0] * DIM for _ in rows]}
        return {"w": rows, "sum": [self.kwargs.get("initial_accumulator_value", 0.0)] * len(rows)}

    def _user_rows(self, users: torch.Tensor) -> torch.Tensor:
        """Local row numbers of ``users``, making the rows of new ids from the initializer."""
        table = self.tables["users"]
        for new in sorted(set(users.flatten().tolist()) - set(self.user_ids)):
            self.user_ids.append(new)
            made = self._table(initial_rows(INIT, torch.tensor([new]), (DIM,), torch.float32))
            for key in table:
                table[key] += made[key]
        where = {u: i for i, u in enumerate(self.user_ids)}
        return torch.tensor([[where[u] for u in row] for row in users.tolist()])

    def step(self, step: int) -> None:
        users, items, target = batch(step)
        local_users = self._user_rows(users)
        weights = {k: torch.tensor(t["w"], dtype=torch.float32).requires_grad_() for k, t in self.tables.items()}
        features = [F.embedding(local_users, weights["users"]).mean(1), F.embedding(items, weights["items"]).mean(1)]
        self.head.zero_grad()
        F.mse_loss(self.head(torch.cat(features, 1)).squeeze(1), target).backward()
        with torch.no_grad():
            for p in self.head.parameters():
                p -= DENSE_LR * p.grad
        for (key, ids), weight in zip((("users", local_users), ("items", items)), (weights["users"], weights["items"])):
            rows = ids.flatten().unique()  # the rows the batch used; their gradients (repeats summed by backward)
            grads = weight.grad.index_select(0, rows).double().tolist()
            t = self.tables[key]
            if self.name == "ftrl":
                ftrl_reference(t["w"], t["n"], t["z"], rows.tolist(), grads, self.kwargs)
            else:
                rowwise_adagrad_reference(t["w"], t["sum"], rows.tolist(), grads, **self.kwargs)


CLOSE = {"rtol": 1e-4, "atol": 1e-6}  # float32 through the ps, float64 in the reference


def assert_rows_as_the_reference(model: Clicks, reference: Reference) -> None:
    """Both tables' rows (pulled through the trainer still open) are the reference's."""
    with torch.no_grad():
        model.items(torch.arange(ROWS))  # pulls every fixed row into the local weight
        users = model.users(torch.tensor(reference.user_ids)).clone()
    torch.testing.assert_close(
        model.items.weight.detach(), torch.tensor(reference.tables["items"]["w"]).float(), **CLOSE
    )
    torch.testing.assert_close(users, torch.tensor(reference.tables["users"]["w"]).float(), **CLOSE)


def trainer_of(model: Clicks, cluster: psframe.ClusterSpec, name: str, url: str | None = None) -> psframe.Trainer:
    return psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.SGD(lr=DENSE_LR),
        table_optimizer=TABLE_OPTIMIZERS[name],
        checkpointing=psframe.Checkpointing(url, save_steps=1000) if url else None,
    )


def train(trainer: psframe.Trainer, model: Clicks, steps: range) -> None:
    for step in steps:
        users, items, target = batch(step)
        trainer.step(F.mse_loss(model(users, items), target))


@pytest.mark.parametrize("name", sorted(TABLE_OPTIMIZERS))
def test_tables_train_through_ps_tasks_as_one_process_applying_the_formulas(local_cluster, name):
    spec = TABLE_OPTIMIZERS[name]
    reference = Reference(name, dict(spec.kwargs))
    model = Clicks()
    with trainer_of(model, local_cluster(num_ps=2, num_workers=1), name) as trainer:
        for step in range(6):
            users, items, target = batch(step)
            trainer.step(F.mse_loss(model(users, items), target))
            reference.step(step)
        assert_rows_as_the_reference(model, reference)
    torch.testing.assert_close(model.head.weight.detach(), reference.head.weight.detach(), **CLOSE)
    assert torch.equal(model.items.weight.detach()[-4:], Clicks().items.weight.detach()[-4:])  # never used: as made


def copy_folder(url: str, to: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    fs.copy(path, fsspec.core.url_to_fs(to)[1], recursive=True)


def trained_state(url: str) -> dict:
    """Every variable part's values, optimizer state and dynamic ids in the checkpoint of ``url``."""
    held = {}
    for shard in checkpoint.read(url).read_shards():
        for var in shard.variables:
            ids = var.dynamic["ids"] if var.dynamic is not None else None
            held[var.name] = (var.value, dict(var.state), ids)
    return held


@pytest.mark.parametrize("restore_from", ["full", "delta"])
@pytest.mark.parametrize("name", sorted(TABLE_OPTIMIZERS))
def test_a_restore_goes_on_bit_for_bit(local_cluster, url, name, restore_from):
    model, cluster = Clicks(), local_cluster(num_ps=2)
    with trainer_of(model, cluster, name, url) as trainer:
        train(trainer, model, range(0, 3))
        restored_step = trainer.save_checkpoint().step  # 3
        train(trainer, model, range(3, 5))
        if restore_from == "delta":
            restored_step = trainer.save_delta().step  # 5, on the full one of 3
        copy_folder(url, url + "-then")  # as it is now: the trainer saves again when it closes
        train(trainer, model, range(5, 8))
        save_full(cluster, url + "-straight", 8)
    again, cluster = Clicks(), local_cluster(num_ps=2)
    with trainer_of(again, cluster, name, url + "-then") as trainer:
        assert trainer.global_step == restored_step
        train(trainer, again, range(restored_step, 8))
        save_full(cluster, url + "-restored", 8)
    straight, restored = trained_state(url + "-straight"), trained_state(url + "-restored")
    assert sorted(straight) == sorted(restored)
    for part, (value, state, ids) in straight.items():
        other_value, other_state, other_ids = restored[part]
        assert torch.equal(value, other_value), part
        assert sorted(state) == sorted(other_state), part
        for key in state:
            assert torch.equal(state[key], other_state[key]), f"{part} {key}"
        assert (ids is None and other_ids is None) or torch.equal(ids, other_ids), part
    states = {key for _, state, _ in straight.values() for key in state}
    assert states >= ({"accum", "linear"} if name == "ftrl" else {"sum"})


@pytest.mark.parametrize("name", sorted(TABLE_OPTIMIZERS))
def test_the_table_optimizers_state_moves_with_its_rows_in_a_live_re_layout(ps_tasks, name):
    """FTRL's accumulators and row-wise Adagrad's one sum per row move with the rows onto three ps
    tasks and back while a worker trains: the rows end as the formulas make them in one process."""
    cluster, grown = clusters(2, 1)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    spec = TABLE_OPTIMIZERS[name]
    reference = Reference(name, dict(spec.kwargs))
    model = Clicks()
    with trainer_of(model, cluster, name) as trainer:
        for step in range(9):
            if step == 3:
                trainer.reshard(grown)
            if step == 6:
                trainer.reshard(cluster)
            users, items, target = batch(step)
            trainer.step(F.mse_loss(model(users, items), target))
            reference.step(step)
        assert trainer.stats.relayouts == 2
        assert_rows_as_the_reference(model, reference)
    assert all(server.service.store.ready for server in first)

"""Dense variables in sync rounds, embedding tables applied at once: ``SyncReplicas(async_tables=...)``.

Oracles: a worker's rows are on the ps task while its round still waits for
the other worker (applied at once, not averaged); once both stepped, the
dense variables hold one SGD step on the mean of the two workers' gradients
(bit for bit) and the table each worker's own row gradients, one after the
other; a worker of other async tables is refused; a bad name says which
tables there are.

This file holds the service tier's tests of the subject; `tests/unit/test_async_tables.py` holds the
other tiers'.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import psframe
from psframe.errors import ClusterMismatchError
from tests.conftest import free_cluster, params
from tests.service.test_sync import run_workers

LR = 0.5
DEADLINE_S = 30.0


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 3, sparse=True)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def batch(worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[1, 2], [2, 5]]) if worker == 0 else torch.tensor([[5, 7], [7, 7]])
    return ids, torch.full((2, 2, 1), float(worker + 1))


def loss_of(model: torch.nn.Module, worker: int) -> torch.Tensor:
    ids, y = batch(worker)
    return torch.nn.functional.mse_loss(model(ids), y)


def trainer(cluster, index: int, async_tables=("emb",)) -> psframe.Trainer:
    return psframe.Trainer(
        Model(),
        cluster,
        task_index=index,
        optimizer=psframe.optim.SGD(lr=LR),
        sync=psframe.SyncReplicas(timeout=DEADLINE_S, async_tables=async_tables),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
    )


def gradients(worker: int, table: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A worker's gradients on the initial model, or with the table's rows as ``table``."""
    model = Model()
    if table is not None:
        with torch.no_grad():
            model.emb.weight.copy_(table)
    loss_of(model, worker).backward()
    return {name: (p.grad.to_dense() if p.grad.is_sparse else p.grad) for name, p in model.named_parameters()}


@pytest.fixture
def ps_task():
    """One ps task in this process (its store is looked at), and a cluster of two workers."""
    cluster = free_cluster(1, 2)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    yield cluster, server
    server.stop(grace=0.1)


def held(server: psframe.Server, name: str) -> torch.Tensor:
    store = server.service.store
    with store.lock:
        return store.read([name])[0].clone()


@pytest.mark.service
def test_rows_apply_at_once_and_dense_variables_in_the_round(ps_task):
    cluster, server = ps_task
    start = params(Model())
    first, second = trainer(cluster, 0), trainer(cluster, 1)
    run_workers({0: first.connect})
    run_workers({1: second.connect})
    assert first.sync.async_tables == ("emb.weight",)
    stepped = threading.Thread(target=lambda: first.step(loss_of(first.model, 0)), daemon=True)
    stepped.start()
    g0 = gradients(0)
    # Worker 1 looks its rows up after worker 0's were applied: its gradients are taken there.
    g1 = gradients(1, start["emb.weight"] - LR * g0["emb.weight"])
    deadline = time.monotonic() + DEADLINE_S
    while torch.equal(held(server, "emb.weight"), start["emb.weight"]):  # worker 0's rows arrive...
        assert time.monotonic() < deadline, "worker 0's rows were not applied at once"
        time.sleep(0.01)
    assert torch.allclose(held(server, "emb.weight"), start["emb.weight"] - LR * g0["emb.weight"], atol=1e-6)
    assert torch.equal(held(server, "out.weight"), start["out.weight"])  # ...while its round waits for worker 1
    assert stepped.is_alive()
    second.step(loss_of(second.model, 1))
    stepped.join(DEADLINE_S)
    assert not stepped.is_alive()
    first.pull()
    got = params(first.model)
    for name in ("out.weight", "out.bias"):
        mean = (g0[name] + g1[name]).div_(2)
        assert torch.equal(got[name], start[name].clone().add_(mean, alpha=-LR)), name
    table = start["emb.weight"] - LR * g0["emb.weight"] - LR * g1["emb.weight"]  # each worker's own, not averaged
    assert torch.allclose(held(server, "emb.weight"), table, atol=1e-6)
    first.close()
    second.close()


@pytest.mark.service
def test_every_worker_must_name_the_same_async_tables(ps_task):
    cluster, _ = ps_task
    first = trainer(cluster, 0)
    run_workers({0: first.connect})
    with pytest.raises(ClusterMismatchError, match="tables applied at once"):
        trainer(cluster, 1, async_tables=False).connect()
    first.close()

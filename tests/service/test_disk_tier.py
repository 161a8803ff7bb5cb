"""A dynamic table with a RAM budget through ps tasks: its rows beyond the budget on disk, it
trains bit for bit as the same table all in RAM in one process, goes on bit for bit after a
checkpoint restored onto three ps tasks, and its rows on disk move with a live re-layout.

This file holds the service tier's tests of the subject; `tests/unit/test_disk_tier.py` holds the
other tiers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import psframe
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from tests.service.test_compact_rows import OneProcess, rows_of, trainer_of
from tests.service.test_relayout import DEADLINE_S, GRAD, LR, clusters, ps_tasks  # noqa: F401
from tests.unit.test_dynamic_tables import DIM, INIT, Clicks, batch

# About 12 rows of 4 floats with Adagrad's sums per part: the 40 ids of the vocabulary on two or
# three parts do not fit, and a batch's ids do.
BUDGET = 12 * (2 * 4 * DIM + 5 * 8 + 1 + 16)


def tiered_model() -> Clicks:
    return Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT, row_storage="float32", ram_budget=BUDGET))


def rows_on_disk(cluster: psframe.ClusterSpec) -> tuple[int, int]:
    """The rows the cluster's dynamic table parts hold, and those of them on disk (their ps tasks' reports)."""
    client = PsClient(cluster, 0, job_name="tool")
    try:
        parts = [t for k in range(cluster.num_ps) for t in control_calls.get_info(client, k).dynamic_tables]
    finally:
        client.close()
    return sum(t.rows for t in parts), sum(t.rows_on_disk for t in parts)


def test_a_tiered_table_trains_through_ps_tasks_bit_for_bit_as_in_ram_and_goes_on_after_a_restore(local_cluster, url):
    oracle = OneProcess("float32")
    model, cluster = tiered_model(), local_cluster(num_ps=2, num_workers=1)
    with trainer_of(model, cluster, url) as trainer:
        for step in range(8):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            oracle.step(step)
        assert torch.equal(rows_of(model), oracle.rows())
        held, on_disk = rows_on_disk(cluster)
        assert held == len(oracle.tables.rows["users"]) and 0 < on_disk < held
        trainer.save_checkpoint()
    again, cluster = tiered_model(), local_cluster(num_ps=3, num_workers=1)
    with trainer_of(again, cluster, url) as trainer:
        assert trainer.global_step == 8
        for step in range(8, 12):
            ids, target = batch(step)
            trainer.step(F.mse_loss(again(ids), target))
            oracle.step(step)
        rows = rows_of(again)
        assert rows_on_disk(cluster)[1] > 0
    assert torch.equal(rows, oracle.rows())
    assert torch.equal(again.head.weight, oracle.model.head.weight)


class Rotating(torch.nn.Module):
    """A dynamic table over 60 ids with a RAM budget of a few rows a part, each step looking up the
    next 6 of them (a block, step % 10), rows made at 1.0: each row gets GRAD each time its block comes."""

    IDS = torch.arange(60) * 7919 + 11

    def __init__(self, budget: int) -> None:
        super().__init__()
        init = psframe.RowInitializer("constant", value=1.0)
        self.emb = psframe.DynamicEmbedding(4, initializer=init, ram_budget=budget)

    def loss(self, step: int) -> torch.Tensor:
        block = self.IDS[6 * (step % 10) : 6 * (step % 10) + 6]
        return GRAD * self.emb(block).sum()


def test_rows_on_disk_move_with_a_live_re_layout_and_keep_their_updates(ps_tasks):
    """A table whose rows are mostly on disk is re-laid onto three ps tasks and back while a worker
    trains: every row lands on the part its id falls in, with every update it had, none lost."""
    cluster, grown = clusters(2, 1)
    first = [ps_tasks(cluster, k) for k in range(2)]
    ps_tasks(grown, 2)
    budget = 10 * (2 * 4 * 4 + 5 * 8 + 1 + 16)  # about 10 rows a part, of the 20-30 each holds
    model = Rotating(budget)
    on_disk = []
    with psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.SGD(lr=LR),
        table_optimizer=psframe.optim.SGD(lr=LR),
        transport=psframe.Transport(connect_timeout=DEADLINE_S),
    ) as trainer:
        for step in range(40):
            if step == 10:
                on_disk.append(rows_on_disk(cluster)[1])
                trainer.reshard(grown)
            if step == 25:
                on_disk.append(rows_on_disk(grown)[1])
                trainer.reshard(cluster)
            trainer.step(model.loss(step))
        on_disk.append(rows_on_disk(cluster)[1])
    assert all(n > 0 for n in on_disk), on_disk
    rows: dict[int, torch.Tensor] = {}
    for server in first:
        with server.service.store.lock:
            for held in server.service.store.export_dynamic().values():
                rows.update(zip(held["ids"].tolist(), held["rows"]))
    assert sorted(rows) == Rotating.IDS.tolist()  # each id on one ps task, none lost
    for value in rows.values():  # 40 steps: each block looked up 4 times
        assert torch.equal(value, torch.full_like(value, 1.0 - LR * GRAD * 4))

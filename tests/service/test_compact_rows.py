"""Compact rows through ps tasks: a bfloat16 or float16 dynamic table trains through two ps
tasks bit for bit as in one process, and goes on bit for bit after a checkpoint restored
onto three ps tasks.

The oracle is :class:`psframe.DynamicTables` in one process over the same compact table
(its rounding is a function of the id and the row's updates, never of the part or the
process), with SGD on the dense head on both sides.

This file holds the service tier's tests of the subject; `tests/unit/test_compact_rows.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import psframe
from tests.unit.test_dynamic_tables import DIM, INIT, VOCABULARY, Clicks, batch

TABLE_OPTIMIZER = psframe.optim.Adagrad(lr=0.2)
DENSE_LR = 0.1


def compact_model(storage: str) -> Clicks:
    return Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT, row_storage=storage))


class OneProcess:
    """The oracle: the same model trained in this process, its table in :class:`psframe.DynamicTables`."""

    def __init__(self, storage: str) -> None:
        self.model = compact_model(storage)
        self.tables = psframe.DynamicTables(self.model, TABLE_OPTIMIZER)
        self.dense = torch.optim.SGD(self.model.head.parameters(), lr=DENSE_LR)

    def step(self, step: int) -> None:
        ids, target = batch(step)
        self.dense.zero_grad()
        F.mse_loss(self.model(ids), target).backward()
        self.dense.step()
        self.tables.step()

    def rows(self) -> torch.Tensor:
        """The rows of the vocabulary now (an evaluation's lookup); training may go on after."""
        rows = rows_of(self.model)
        self.model.train()
        return rows


def trainer_of(model: Clicks, cluster: psframe.ClusterSpec, url: str | None = None) -> psframe.Trainer:
    return psframe.Trainer(
        model,
        cluster,
        optimizer=psframe.optim.SGD(lr=DENSE_LR),
        table_optimizer=TABLE_OPTIMIZER,
        checkpointing=psframe.Checkpointing(url, save_steps=1000) if url else None,
    )


def rows_of(model: Clicks) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.users(VOCABULARY.unsqueeze(0))[0]


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_a_compact_table_trains_through_ps_tasks_bit_for_bit_as_in_one_process(local_cluster, storage):
    oracle, model = OneProcess(storage), compact_model(storage)
    with trainer_of(model, local_cluster(num_ps=2, num_workers=1)) as trainer:
        for step in range(6):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            oracle.step(step)
        rows = rows_of(model)
    assert torch.equal(rows, oracle.rows())
    assert torch.equal(rows, rows.to(getattr(torch, storage)).float())  # each value one the storage holds
    assert torch.equal(model.head.weight, oracle.model.head.weight)
    # And near the float32 table: within a few units of bfloat16's last place.
    full = OneProcess("float32")
    for step in range(6):
        full.step(step)
    torch.testing.assert_close(rows, full.rows(), rtol=0.03, atol=1e-2)


def test_a_compact_table_goes_on_bit_for_bit_after_a_restore_onto_more_ps_tasks(local_cluster, url):
    oracle = OneProcess("bfloat16")
    model = compact_model("bfloat16")
    with trainer_of(model, local_cluster(num_ps=2, num_workers=1), url) as trainer:
        for step in range(3):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            oracle.step(step)
        trainer.save_checkpoint()
    again = compact_model("bfloat16")
    with trainer_of(again, local_cluster(num_ps=3, num_workers=1), url) as trainer:
        assert trainer.global_step == 3
        for step in range(3, 6):
            ids, target = batch(step)
            trainer.step(F.mse_loss(again(ids), target))
            oracle.step(step)
        rows = rows_of(again)
    assert torch.equal(rows, oracle.rows())
    loaded = psframe.checkpoint.load(url)
    assert loaded["users.rows"].dtype == torch.float32  # checkpoints hold the table's dtype

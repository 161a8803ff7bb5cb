"""A dynamic table with a RAM budget through ps tasks: its rows beyond the budget on disk, it
trains bit for bit as the same table all in RAM in one process, and goes on bit for bit after a
checkpoint restored onto three ps tasks.

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

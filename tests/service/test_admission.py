"""Dynamic tables' admission (by count or by chance) and eviction by norm, and the counts of both.

A table that admits by count gives an id a row only once it was looked up
for training ``admit_after`` times; until then the id reads as its initial
row, its gradients are dropped, and it takes no memory. A row an update
leaves below ``min_norm`` is evicted. Each part counts the ids it admitted,
filtered and evicted; ``status`` and checkpoints carry the counts.

This file holds the service tier's tests of the subject; `tests/unit/test_admission.py` holds the
other tiers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import psframe
from psframe.checkpoint import files as checkpoint_files
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from tests.unit.test_admission import VOCABULARY, batch, table
from tests.unit.test_dynamic_tables import Clicks


def test_a_cluster_admits_and_evicts_as_one_process_and_reports_the_counts(local_cluster, url):
    settings = {"admit_after": 2, "admission_counters": 1 << 12, "min_norm": 0.3}
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, local = Clicks(table(**settings)), Clicks(table(**settings))
    optimizer = psframe.optim.SGD(lr=0.2)
    tables = psframe.DynamicTables(local, optimizer)
    dense_opt = torch.optim.SGD(local.head.parameters(), lr=0.2)
    with psframe.Trainer(model, cluster, optimizer=optimizer, checkpointing=psframe.Checkpointing(url)) as trainer:
        for step in range(8):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            dense_opt.zero_grad()
            F.mse_loss(local(ids), target).backward()
            dense_opt.step()
            tables.step()
        model.eval(), local.eval()
        with torch.no_grad():
            torch.testing.assert_close(model.users(VOCABULARY), local.users(VOCABULARY), rtol=1e-6, atol=0)
        client = PsClient(cluster, 0)
        try:
            statuses = [control_calls.get_info(client, k) for k in range(2)]
        finally:
            client.close()
    # Each id has its own counters on its own part: the parts' counts add up to one process's.
    expected = tables.rows["users"].counts()
    assert expected["filtered"] > 0 and expected["admitted"] > 0
    parts = [t for status in statuses for t in status.dynamic_tables]
    assert sorted(t.name for t in parts) == ["users/part_0", "users/part_1"]
    for key in ("admitted", "filtered", "evicted"):
        assert sum(getattr(t, key) for t in parts) == expected[key], key
    assert sum(t.rows for t in parts) == len(tables.rows["users"])
    # The checkpoint keeps each part's counts, and a restore onto one ps task keeps the totals.
    manifest = checkpoint_files.latest_valid(url)
    saved = [
        next(v for v in checkpoint_files.read_shard(manifest, k).variables if v.dynamic is not None) for k in range(2)
    ]
    assert [p.dynamic["counts"] for p in saved] == [{k: getattr(t, k) for k in expected} for t in parts]
    again = Clicks(table(**settings))
    one_ps = local_cluster(num_ps=1, num_workers=1)
    with psframe.Trainer(again, one_ps, optimizer=optimizer, checkpointing=psframe.Checkpointing(url)):
        client = PsClient(one_ps, 0)
        try:
            (restored,) = control_calls.get_info(client, 0).dynamic_tables
        finally:
            client.close()
    assert {k: getattr(restored, k) for k in expected} == expected

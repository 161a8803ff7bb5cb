"""Dynamic embedding tables: any int64 id, a row made on first touch, evicted by a cap or age.

The oracle of training is one process with an ``nn.Embedding(sparse=True)``
over the same ids numbered 0, 1, 2, ... in order of first use, whose rows
start as the dynamic table's initializer makes them: the ps tasks' dynamic
parts must train exactly as that table does.

This file holds the service tier's tests of the subject; `tests/unit/test_dynamic_tables.py` holds
the other tiers'.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.checkpoint import files as checkpoint_files
from psframe.tables.row_math import initial_rows, part_of
from tests.unit.test_dynamic_tables import (  # noqa: F401
    CASES,
    DIM,
    INIT,
    VOCABULARY,
    Clicks,
    batch,
    positions_of,
    reference_model,
    reference_step,
    spec,
)


@pytest.mark.parametrize("table_optimizer,table_local", CASES, ids=["sgd", "momentum", "adagrad", "adam"])
def test_dynamic_table_trains_as_one_process(local_cluster, table_optimizer, table_local):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT))
    reference = reference_model()
    dense_opt = torch.optim.SGD(reference.head.parameters(), lr=0.1)
    table_opt = table_local[0]([reference.users.weight], **table_local[1])
    with psframe.Trainer(
        model, cluster, optimizer=psframe.optim.SGD(lr=0.1), table_optimizer=table_optimizer
    ) as trainer:
        assert {s.ps_task for s in trainer.placement.shards if s.dynamic is not None} == {0, 1}
        for step in range(6):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            reference_step(reference, dense_opt, table_opt, step)
        assert torch.equal(model.head.weight, reference.head.weight)
        model.eval()
        with torch.no_grad():
            rows = model.users(VOCABULARY.unsqueeze(0))[0]
        assert torch.equal(rows, reference.users.weight.detach())


def test_checkpoints_hold_the_ids_seen_and_restore_onto_another_number_of_ps_tasks(local_cluster, url):
    optimizer = psframe.optim.Adagrad(lr=0.2)
    reference = reference_model()
    dense_opt = torch.optim.Adagrad(reference.head.parameters(), lr=0.2)
    table_opt = torch.optim.Adagrad([reference.users.weight], lr=0.2)

    model = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT))
    with psframe.Trainer(
        model, local_cluster(num_ps=2, num_workers=1), optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
    ) as trainer:
        for step in range(4):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            reference_step(reference, dense_opt, table_opt, step)
        model.eval()
        with torch.no_grad():
            model.users(VOCABULARY)  # an evaluation's lookups make no rows
    # Only the ids trained on were kept, each by the part its id says, with its row.
    seen = torch.unique(torch.cat([batch(step)[0].flatten() for step in range(4)]))
    assert len(seen) < len(VOCABULARY)
    loaded = psframe.checkpoint.load(url)
    assert torch.equal(loaded["users.ids"], seen)
    assert torch.equal(loaded["users.rows"], reference.users.weight.detach()[positions_of(seen[None])[0]])
    manifest = checkpoint_files.latest_valid(url)
    for k in range(2):
        shard = checkpoint_files.read_shard(manifest, k)
        (part,) = [v for v in shard.variables if v.dynamic is not None]
        assert torch.equal(part_of(part.dynamic["ids"], 2), torch.full_like(part.dynamic["ids"], k))
    # Three ps tasks now: every id moves to its new part with its row and Adagrad state.
    again = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT))
    with psframe.Trainer(
        again, local_cluster(num_ps=3, num_workers=1), optimizer=optimizer, checkpointing=psframe.Checkpointing(url)
    ) as trainer:
        for step in range(4, 7):
            ids, target = batch(step)
            trainer.step(F.mse_loss(again(ids), target))
            reference_step(reference, dense_opt, table_opt, step)
        again.eval()
        with torch.no_grad():
            rows = again.users(VOCABULARY)
    assert torch.equal(rows, reference.users.weight.detach())
    assert torch.equal(again.head.weight, reference.head.weight)


def test_one_process_dynamic_tables_match_the_cluster(local_cluster):
    cluster = local_cluster(num_ps=2, num_workers=1)
    model = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT))
    local = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT))
    optimizer = psframe.optim.Adagrad(lr=0.1)
    tables = psframe.DynamicTables(local, optimizer)
    dense_opt = torch.optim.Adagrad(local.head.parameters(), lr=0.1)
    with psframe.Trainer(model, cluster, optimizer=optimizer) as trainer:
        for step in range(5):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
            dense_opt.zero_grad()
            F.mse_loss(local(ids), target).backward()
            dense_opt.step()
            tables.step()
        model.eval(), local.eval()
        with torch.no_grad():
            torch.testing.assert_close(model.users(VOCABULARY), local.users(VOCABULARY), rtol=1e-6, atol=0)
    assert len(tables.rows["users"]) == len(torch.unique(torch.cat([batch(s)[0].flatten() for s in range(5)])))


def test_sync_workers_average_dynamic_rows(local_cluster):
    """Two sync workers == one process on both batches with the mean loss."""
    import threading

    cluster = local_cluster(num_ps=2, num_workers=2)
    sync = psframe.SyncReplicas(replicas_to_aggregate=2, total_num_replicas=2, timeout=60)
    models = [Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT)) for _ in range(2)]
    reference = reference_model()
    dense_opt = torch.optim.SGD(reference.head.parameters(), lr=0.1)
    table_opt = torch.optim.SGD([reference.users.weight], lr=0.2)
    steps = 4
    errors, rows = [], {}

    def work(index: int) -> None:
        try:
            with psframe.Trainer(
                models[index],
                cluster,
                task_index=index,
                optimizer=psframe.optim.SGD(lr=0.1),
                table_optimizer=psframe.optim.SGD(lr=0.2),
                sync=sync,
            ) as trainer:
                for step in range(steps):
                    ids, target = batch(2 * step + index)
                    trainer.step(F.mse_loss(models[index](ids), target))
                models[index].eval()
                with torch.no_grad():
                    rows[index] = models[index].users(VOCABULARY)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    for step in range(steps):
        dense_opt.zero_grad()
        table_opt.zero_grad()
        losses = []
        for index in range(2):
            ids, target = batch(2 * step + index)
            losses.append(F.mse_loss(reference(positions_of(ids)), target))
        (sum(losses) / 2).backward()
        reference.users.weight.grad = reference.users.weight.grad.coalesce()
        dense_opt.step()
        table_opt.step()
    # The mean of per-worker sums rounds differently from one backward over both batches.
    torch.testing.assert_close(models[0].head.weight, reference.head.weight, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rows[0], reference.users.weight.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(rows[0], initial_rows(INIT, VOCABULARY, (DIM,), torch.float32))


def test_a_ttl_reaches_the_ps_tasks_and_checkpoints_keep_when_rows_were_seen(local_cluster, url):
    model = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT, ttl_seconds=3600.0))
    before = time.time()
    with psframe.Trainer(
        model,
        local_cluster(num_ps=2, num_workers=1),
        optimizer=psframe.optim.SGD(lr=0.1),
        checkpointing=psframe.Checkpointing(url),
    ) as trainer:
        for step in range(3):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
    after = time.time()
    manifest = checkpoint_files.latest_valid(url)
    for k in range(2):
        shard = checkpoint_files.read_shard(manifest, k)
        (part,) = [v for v in shard.variables if v.dynamic is not None]
        assert part.dynamic["spec"]["ttl_seconds"] == 3600.0
        seen = part.dynamic["seen"]
        assert seen.dtype == torch.float64 and seen.shape == part.dynamic["ids"].shape
        assert bool(((seen >= before) & (seen <= after)).all())


def test_a_cap_per_ps_task_bounds_the_rows_each_holds(local_cluster, url):
    model = Clicks(psframe.DynamicEmbedding(DIM, initializer=INIT, max_rows=12, eviction="lfu"))
    with psframe.Trainer(
        model,
        local_cluster(num_ps=2, num_workers=1),
        optimizer=psframe.optim.SGD(lr=0.1),
        checkpointing=psframe.Checkpointing(url),
    ) as trainer:
        for step in range(10):
            ids, target = batch(step)
            trainer.step(F.mse_loss(model(ids), target))
    seen = torch.unique(torch.cat([batch(step)[0].flatten() for step in range(10)]))
    manifest = checkpoint_files.latest_valid(url)
    held = [
        next(v for v in checkpoint_files.read_shard(manifest, k).variables if v.dynamic is not None) for k in range(2)
    ]
    assert (
        [len(part.dynamic["ids"]) for part in held] == [12, 12] < [int((part_of(seen, 2) == k).sum()) for k in range(2)]
    )

"""``trainer.pull()``: what a worker's local model holds afterwards, checked against the ps tasks.

Every dense variable is copied whole; an embedding table's local weight gets the
current value of each row this worker looked up (the rows it holds), and keeps
the rows it never looked up as they were.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.worker.model import tables
from tests.service.test_relayout import clusters, ps_tasks  # noqa: F401 (ps_tasks: a fixture)
from tests.service.test_tables import BAG_ROWS, ROWS, Recommender, batch, loss_of, pull_every_row


@pytest.mark.parametrize("refresh_bytes", [None, 3 * 4 * 4], ids=["one_pull", "three_rows_a_pull"])
def test_pull_refreshes_every_variable_and_the_table_rows_the_worker_looked_up(
    local_cluster, monkeypatch, refresh_bytes
):
    if refresh_bytes is not None:  # the rows pulled in batches of 3 (a row: 4 floats)
        monkeypatch.setattr(tables, "REFRESH_BYTES", refresh_bytes)
    cluster = local_cluster(num_ps=2, num_workers=2)
    mine, theirs = Recommender(seed=0), Recommender(seed=1)
    optimizer = psframe.optim.SGD(lr=0.1)
    with psframe.Trainer(mine, cluster, task_index=0, optimizer=optimizer) as me:
        with psframe.Trainer(theirs, cluster, task_index=1, optimizer=optimizer) as other:
            me.step(loss_of(mine, 0))  # looks batch 0's rows up: this worker holds them
            ids, bag_ids, _, _ = batch(0)
            held = {"emb": torch.unique(ids), "bag": torch.unique(bag_ids)}
            never = {
                "emb": torch.tensor([i for i in range(ROWS) if i not in held["emb"]]),
                "bag": torch.tensor([i for i in range(BAG_ROWS) if i not in held["bag"]]),
            }
            before = {name: getattr(mine, name).weight.detach().clone() for name in held}
            for step in range(1, 6):  # the other worker moves the model on, rows this one holds among them
                other.step(loss_of(theirs, step))
            step = me.pull()
            assert step == other.global_step == 6
            pull_every_row(theirs)  # the other worker's local model: the ps tasks' values, whole
            for name, rows in held.items():
                weight, current = getattr(mine, name).weight, getattr(theirs, name).weight
                assert not torch.equal(before[name][rows], current[rows])  # they moved since
                assert torch.equal(weight[rows], current[rows]), f"{name}: the rows looked up are the ps tasks'"
                assert torch.equal(weight[never[name]], before[name][never[name]]), f"{name}: the others as they were"
            assert torch.equal(mine.head.weight, theirs.head.weight)
            assert torch.equal(mine.head.bias, theirs.head.bias)


@pytest.mark.service
def test_pull_refreshes_the_rows_looked_up_before_a_relayout(ps_tasks):
    cluster, grown = clusters(2, 1)
    for k in range(2):
        ps_tasks(cluster, k)
    ps_tasks(grown, 2)
    model = Recommender()
    transport = psframe.Transport(connect_timeout=60.0)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.1), transport=transport) as trainer:
        trainer.step(loss_of(model, 0))  # batch 0's rows, held as pulled, then updated on the ps tasks
        trainer.reshard(grown)  # the tables are placed anew: 3 parts
        trainer.step(loss_of(model, 1))
        assert trainer.stats.relayouts == 1
        trainer.pull()
        pulled = model.emb.weight.detach().clone()
        before_only = torch.tensor(sorted(set(batch(0)[0].flatten().tolist()) - set(batch(1)[0].flatten().tolist())))
        assert before_only.numel()
        pull_every_row(model)  # every row's current value, through the lookups
        assert torch.equal(pulled[before_only], model.emb.weight[before_only])

"""A worker's row cache: rows kept between steps, pulled again only when their version moved too far.

With ``max_lag=0`` training is exactly as without a cache (a row that did
not change is not sent again); with a larger ``max_lag``, hot rows travel less.

This file holds the unit tier's tests of the subject; `tests/service/test_row_cache.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.optim import OptimizerSpec
from psframe.ps.store import VariableStore
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.rows import NOT_CACHED, to_refresh
from psframe.tables.spec import DynamicTableSpec, RowInitializer
from psframe.worker.model.row_cache import RowCache
from tests.conftest import params

DIM = 4


def test_a_row_is_refreshed_when_not_cached_made_anew_or_too_old():
    cached = torch.tensor([NOT_CACHED, 10, 10, 10, 10])
    current = torch.tensor([5, 10, 12, 13, 7])
    assert to_refresh(cached, current, max_lag=2).tolist() == [True, False, False, True, True]
    assert to_refresh(cached, current, max_lag=0).tolist() == [True, False, True, True, True]


def test_the_cache_keeps_rows_and_versions_and_evicts_those_used_longest_ago():
    cache = RowCache((DIM,), torch.float32, max_rows=3, max_lag=0)
    ids = torch.tensor([1, 2, 3])
    slots, versions = cache.versions(ids)
    assert versions.tolist() == [NOT_CACHED] * 3
    rows = torch.arange(12.0).reshape(3, DIM)
    got = cache.fill(ids, slots, torch.tensor([7, 8, 9]), torch.ones(3, dtype=torch.bool), rows)
    assert torch.equal(got, rows) and len(cache) == 3
    # 2 comes from the cache; 4 is new and takes the slot of 1 or 3, not 2's (in use).
    ids = torch.tensor([2, 4])
    slots, versions = cache.versions(ids)
    assert versions.tolist() == [8, NOT_CACHED]
    fresh = torch.full((1, DIM), -1.0)
    got = cache.fill(ids, slots, torch.tensor([8, 3]), torch.tensor([False, True]), fresh)
    assert torch.equal(got, torch.stack([rows[1], fresh[0]]))
    assert len(cache) == 3 and cache.versions(torch.tensor([2, 4]))[1].tolist() == [8, 3]
    assert (cache.looked_up, cache.received) == (5, 4)
    # More new ids than fit: the first that fit are kept, all are returned.
    ids = torch.tensor([10, 11, 12, 13])
    slots, _ = cache.versions(ids)
    fresh = torch.arange(16.0).reshape(4, DIM)
    got = cache.fill(ids, slots, torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.bool), fresh)
    assert torch.equal(got, fresh) and len(cache) == 3
    assert (cache.versions(ids)[0] >= 0).tolist() == [True, True, True, False]


def test_a_ps_task_sends_only_the_rows_that_moved_past_the_cached_versions():
    store = VariableStore()
    table = torch.zeros(6, DIM)
    store.create(
        {"emb": table}, OptimizerSpec("SGD", {"lr": 1.0}), tables=["emb"], table_optimizer=psframe.optim.SGD(lr=1.0)
    )
    ids = torch.tensor([0, 1, 2])
    versions, rows = store.read_rows_since("emb", ids, True, torch.full((3,), NOT_CACHED), 0)
    assert rows.shape == (3, DIM) and len(set(versions.tolist())) == 1
    store.apply_rows([("emb", torch.tensor([1]), torch.ones(1, DIM))])
    now, rows = store.read_rows_since("emb", ids, True, versions, 0)
    assert (now > versions).tolist() == [False, True, False] and torch.equal(rows, -torch.ones(1, DIM))
    store.apply_rows([("emb", torch.tensor([1]), torch.ones(1, DIM))])
    _, rows = store.read_rows_since("emb", ids, True, now, 1)  # one version behind: within max_lag
    assert rows.shape == (0, DIM)
    _, rows = store.read_rows_since("emb", ids, True, versions, 1)  # two behind: sent
    assert torch.equal(rows, -2 * torch.ones(1, DIM))


def test_a_dynamic_part_gives_a_remade_row_a_version_past_the_old_one():
    part = DynamicRows("t", (DIM,), torch.float32, DynamicTableSpec(RowInitializer(seed=1)), psframe.optim.SGD(lr=0.5))
    ids = torch.tensor([5, 6])
    versions, rows = part.read_since(ids, torch.full((2,), NOT_CACHED), 0)
    assert rows.shape == (2, DIM)  # nothing cached: every row
    part.apply(ids[:1], torch.ones(1, DIM))
    now, fresh = part.read_since(ids, versions, 0)
    assert now[0] > versions[0] and now[1] == versions[1] and fresh.shape == (1, DIM)
    # Made anew (a new part, as after a restart): every version is past the old ones.
    again = DynamicRows("t", (DIM,), torch.float32, DynamicTableSpec(RowInitializer(seed=1)), psframe.optim.SGD(lr=0.5))
    later, _ = again.read_since(ids, now, 0)
    assert bool((later > now).all())


@pytest.mark.parametrize("kwargs,message", [({"max_lag": -1}, "max_lag"), ({"max_rows": 0}, "max_rows")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        psframe.RowCaching(**kwargs)


# ---- training through the cache


class Clicks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = torch.nn.Embedding(200, DIM, sparse=True)
        self.users = psframe.DynamicEmbedding(DIM, initializer=RowInitializer(std=0.1, seed=3))
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.items(items).mean(1), self.users(users).mean(1)], 1)).squeeze(1)


def batch(step: int):
    """Power-law ids: a few in every batch, most rare."""
    g = torch.Generator().manual_seed(step)
    items = (torch.rand(16, 4, generator=g) ** 4 * 200).long()
    users = (torch.rand(16, 2, generator=g) ** 4 * 500).long() * 7919
    return items, users, torch.rand(16, generator=g)


def train(local_cluster, steps: int, row_cache=None, push_every: int = 1):
    model = Clicks()
    with psframe.Trainer(
        model,
        local_cluster(num_ps=2),
        optimizer=psframe.optim.SGD(lr=0.1),
        table_optimizer=psframe.optim.SGD(lr=0.1),
        row_cache=row_cache,
    ) as trainer:
        for step in range(steps):
            items, users, target = batch(step)
            trainer.step(F.mse_loss(model(items, users), target))
        model.eval()
        with torch.no_grad():
            every = torch.arange(200), torch.arange(500) * 7919
            tables = model.items(every[0]), model.users(every[1])
        return params(model), tables, (trainer.stats.rows_looked_up, trainer.stats.rows_pulled)

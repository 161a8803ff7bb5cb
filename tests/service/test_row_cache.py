"""A worker's row cache: rows kept between steps, pulled again only when their version moved too far.

With ``max_lag=0`` training is exactly as without a cache (a row that did
not change is not sent again); with a larger ``max_lag``, hot rows travel less.

This file holds the service tier's tests of the subject; `tests/unit/test_row_cache.py` holds the
other tiers'.
"""

from __future__ import annotations

import torch

import psframe
from tests.conftest import assert_params_equal
from tests.unit.test_row_cache import train


def test_an_exact_cache_trains_as_no_cache_and_a_lagging_one_pulls_fewer_rows(local_cluster):
    plain, plain_tables, (looked_up, pulled) = train(local_cluster, 12)
    assert looked_up == pulled > 0  # every row asked for came back
    exact, exact_tables, (cached_looked_up, cached_pulled) = train(local_cluster, 12, psframe.RowCaching(max_lag=0))
    assert_params_equal(exact, plain)
    assert all(torch.equal(a, b) for a, b in zip(exact_tables, plain_tables))
    assert cached_looked_up == looked_up and cached_pulled <= pulled
    _, _, (_, lagging_pulled) = train(local_cluster, 12, psframe.RowCaching(max_lag=8))
    assert lagging_pulled < cached_pulled

"""Dense variables in sync rounds, embedding tables applied at once: ``SyncReplicas(async_tables=...)``.

Oracles: a worker's rows are on the ps task while its round still waits for
the other worker (applied at once, not averaged); once both stepped, the
dense variables hold one SGD step on the mean of the two workers' gradients
(bit for bit) and the table each worker's own row gradients, one after the
other; a worker of other async tables is refused; a bad name says which
tables there are.

This file holds the unit tier's tests of the subject; `tests/service/test_async_tables.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest

from tests.conftest import free_cluster
from tests.service.test_async_tables import trainer


def test_a_name_that_is_no_table_says_which_there_are():
    cluster = free_cluster(1, 1)
    with pytest.raises(ValueError, match=r"no embedding table of the model; its tables are \['emb.weight'\]"):
        trainer(cluster, 0, async_tables=("out",))
    assert trainer(cluster, 0, async_tables=True).sync.async_tables == ("emb.weight",)

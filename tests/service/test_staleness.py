"""Bounded staleness (SSP): a worker runs at most ``steps`` ahead of the slowest live worker.

Unit tests of the ps task's gate (:mod:`psframe.ps.protocol.staleness`), then workers on ps
tasks served in this process (``in_process_cluster``), one of them slowed on purpose: the steps ahead every push found
(counted by the ps task, and by each worker) never exceed the bound, and without
a bound the fast worker does run ahead (the same test would fail).

This file holds the service tier's tests of the subject; `tests/unit/test_staleness.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe


def test_a_bound_is_for_asynchronous_training_only(local_cluster):
    cluster = local_cluster(num_ps=1, num_workers=2, start_ps=False)
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="staleness bounds asynchronous training"):
        psframe.Trainer(model, cluster, sync=psframe.SyncReplicas(), staleness=psframe.BoundedStaleness(1))
    with pytest.raises(TypeError, match="staleness must be a psframe.BoundedStaleness or None, got int"):
        psframe.Trainer(model, cluster, staleness=1)

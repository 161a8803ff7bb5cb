"""Synchronous training (SyncReplicas) end to end: exact oracles and no hangs.

This file holds the unit tier's tests of the subject; `tests/service/test_sync.py`,
`tests/cluster/test_sync.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from tests.conftest import free_cluster
from tests.service.test_sync import _sync_service, linear_model, run_workers


def test_sync_arguments_are_checked():
    cluster = free_cluster(1, 2)
    with pytest.raises(ValueError, match=r"replicas_to_aggregate \(3\) must be <= total_num_replicas \(2\)"):
        psframe.SyncReplicas(replicas_to_aggregate=3, total_num_replicas=2)
    with pytest.raises(ValueError, match=r"total_num_replicas \(3\) must equal the number of workers"):
        psframe.Trainer(linear_model(), cluster, sync=psframe.SyncReplicas(2, 3))
    opt = psframe.optim.SyncReplicasOptimizer(psframe.optim.SGD(lr=0.1), replicas_to_aggregate=1, total_num_replicas=2)
    trainer = psframe.Trainer(linear_model(), cluster, optimizer=opt)
    assert trainer.sync == psframe.SyncReplicas(1, 2)
    assert trainer.optimizer == psframe.optim.SGD(lr=0.1)


def test_the_members_of_a_round_get_one_reply_encoded_once():
    _service, push, decoded = _sync_service()
    replies = run_workers({0: lambda: push(0, 0, 1.0), 1: lambda: push(1, 0, 3.0)})
    assert replies[0] is replies[1]  # the second member sent the bytes the first encoded
    header, (w, b) = decoded(replies[0])
    assert (header.global_step, header.dropped) == (1, False)
    torch.testing.assert_close(w, torch.full((3,), -2.0), rtol=0, atol=0)  # 0 - 1.0 * mean(1, 3)
    torch.testing.assert_close(b, torch.full((2,), -2.0), rtol=0, atol=0)


def test_a_reply_after_a_restore_at_the_same_step_carries_the_restored_values():
    service, push, decoded = _sync_service()
    run_workers({0: lambda: push(0, 0, 1.0), 1: lambda: push(1, 0, 1.0)})
    stale = decoded(push(0, 0, 5.0))  # step 0 is over: dropped, answered with the current values
    assert stale[0].dropped and stale[1][0].tolist() == [-1.0] * 3
    service.store.restore({"w": torch.full((3,), 7.0), "b": torch.full((2,), 7.0)}, {}, global_step=1)
    header, (w, b) = decoded(push(0, 0, 5.0))  # the same step, pull and answer: new values
    assert (header.global_step, header.dropped) == (1, True)
    assert w.tolist() == [7.0] * 3 and b.tolist() == [7.0] * 2

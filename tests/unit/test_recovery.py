"""Recovery from lost tasks: a ps task's shard saved and restored (in process), then
real SIGKILLs at a random step and restarts with the same command (cluster).

This file holds the unit tier's tests of the subject; `tests/cluster/test_recovery.py` holds the
other tiers'.
"""

from __future__ import annotations

import torch

from psframe.optim import OptimizerSpec
from psframe.ps import recovery
from psframe.wire import psframe_pb2 as pb
from tests.cluster.test_recovery import ADAM, row_defs, save_all, trained_stores


def test_a_ps_task_restores_its_own_shard_as_it_saved_it(url):
    defs = row_defs([0, 6, 10])
    stores = trained_stores(torch.randn(10, 3), defs)
    sync = pb.SyncDef(replicas_to_aggregate=2, total_num_replicas=3, timeout_seconds=12.5)
    save_all(url, stores, defs, sync)

    for k, (store, d) in enumerate(zip(stores, defs)):
        restored = recovery.restore_own_shard(url, k, 2)
        global_step, values, states = store.snapshot()
        assert (restored.step, restored.global_step) == (100, global_step) == (100, 3)
        assert restored.defs == [d] and restored.sync == sync and restored.optimizer == ADAM
        assert torch.equal(restored.values[d.name], values[d.name])
        assert set(restored.states[d.name]) == set(states[d.name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, x in states[d.name].items():
            assert torch.equal(restored.states[d.name][key], x), key
    assert recovery.restore_own_shard(url, 0, 3) is None  # shard boundaries moved
    assert recovery.restore_own_shard(f"{url}/nothing", 0, 2) is None


def test_restore_onto_another_partitioning_takes_rows_from_every_shard(url):
    emb = torch.randn(10, 3)
    saved = row_defs([0, 6, 10])
    stores = trained_stores(emb, saved)
    save_all(url, stores, saved, None)
    exp_avg = torch.cat([s.snapshot()[2][d.name]["exp_avg"] for s, d in zip(stores, saved)])
    values = torch.cat([s.snapshot()[1][d.name] for s, d in zip(stores, saved)])

    wanted = row_defs([0, 4, 7, 10])
    restored = recovery.restore_onto(url, wanted[1:2], ADAM)
    assert restored.defs == wanted[1:2] and restored.sync is None and restored.global_step == 3
    assert torch.equal(restored.values["emb.weight/part_1"], values[4:7])
    assert torch.equal(restored.states["emb.weight/part_1"]["exp_avg"], exp_avg[4:7])

    other = recovery.restore_onto(url, wanted[1:2], OptimizerSpec("SGD", {"lr": 0.1}))
    assert other.states == {"emb.weight/part_1": {}}  # another optimizer's state is dropped

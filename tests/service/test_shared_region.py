"""Tensors through a same-host shared region (psframe.wire.same_host), against messages.

Oracles: a worker's requests answered through a region give the replies and
variables that messages give, bit for bit, and after the offer carry no
tensors; a region the ps task cannot use is refused with nothing changed,
and the worker goes back to messages; no region file outlives its worker.

This file holds the service tier's tests of the subject; `tests/unit/test_shared_region.py` holds
the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.wire import same_host
from tests.conftest import assert_params_equal, params
from tests.service.test_trainer import loss_of, make_model
from tests.unit.test_shared_region import _files_left_before, _region_files  # noqa: F401

pytestmark = pytest.mark.skipif(not same_host.available(), reason="no writable /dev/shm on this host")


def test_a_trainer_through_shared_memory_matches_one_through_messages_and_leaves_no_file(local_cluster):
    results = {}
    for shared_memory in (True, False):
        cluster = local_cluster(num_ps=2, num_workers=1)
        model = make_model()
        with psframe.Trainer(
            model,
            cluster,
            optimizer=psframe.optim.Adam(lr=0.01),
            placement=psframe.Placement(min_partition_bytes=64),
            transport=psframe.Transport(same_host_memory=shared_memory),
        ) as trainer:
            for step in range(5):
                trainer.step(loss_of(model, step))
            # Each step's requests (one per ps task at least) went through regions; the
            # pull at connect, sent once, never got past its offer.
            in_region = sum(p.in_region for p in trainer._session.client._streams.encoder.prepared.values())
            assert in_region >= 2 if shared_memory else in_region == 0
            trainer.pull()
        results[shared_memory] = params(model)
    assert_params_equal(results[True], results[False])
    assert not _region_files()


@pytest.mark.parametrize("max_shard_bytes", [4 << 20, 64], ids=["one-message", "several-messages"])
def test_sync_workers_through_shared_memory_match_messages_and_leave_no_file(local_cluster, max_shard_bytes):
    """A round keeps its members' gradients until it is applied, and writes each member's
    reply into its own region: the result is that of messages, bit for bit."""
    from tests.service.test_sync import batches_for, connect_all, linear_model, run_workers

    num_workers, steps = 2, 6
    shard = batches_for(num_workers, 4, steps, seed=5)
    results = {}
    for shared_memory in (True, False):
        cluster = local_cluster(num_ps=2, num_workers=num_workers)
        models = {i: linear_model(seed=0) for i in range(num_workers)}
        trainers = {
            i: psframe.Trainer(
                models[i],
                cluster,
                task_index=i,
                optimizer=psframe.optim.Adam(lr=0.01),
                sync=psframe.SyncReplicas(timeout=30),
                placement=psframe.Placement(min_partition_bytes=32, max_shard_bytes=max_shard_bytes),
                transport=psframe.Transport(same_host_memory=shared_memory),
            )
            for i in range(num_workers)
        }
        connect_all(trainers)

        def train(i):  # run (and done) within this iteration of the loop over settings
            for step in range(steps):
                x, y = shard(step, i)
                trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))  # noqa: B023
            return sum(p.in_region for p in trainers[i]._session.client._streams.encoder.prepared.values())  # noqa: B023

        in_region = run_workers({i: (lambda i=i: train(i)) for i in range(num_workers)})
        assert all(count >= 2 for count in in_region.values()) if shared_memory else not any(in_region.values())
        run_workers({i: trainers[i].close for i in range(num_workers)})
        results[shared_memory] = [params(models[i]) for i in range(num_workers)]
    for i in range(num_workers):
        assert_params_equal(results[True][i], results[False][i])
    assert_params_equal(results[True][0], results[True][1])
    assert not _region_files()


def test_a_failed_sync_step_leaves_its_regions_to_the_ps_and_goes_on_in_new_ones(local_cluster):
    """A round that timed out may still hold a worker's gradients as views of its region:
    the worker's next requests must not write there."""
    from psframe.errors import BarrierTimeoutError
    from tests.service.test_sync import batches_for, connect_all, linear_model, run_workers

    cluster = local_cluster(num_ps=1, num_workers=2)
    shard = batches_for(2, 4, 4, seed=3)
    models = {i: linear_model(seed=0) for i in range(2)}
    trainers = {
        i: psframe.Trainer(models[i], cluster, task_index=i, sync=psframe.SyncReplicas(timeout=2.0)) for i in range(2)
    }
    connect_all(trainers)

    def step(i, k):
        x, y = shard(k, i)
        trainers[i].step(torch.nn.functional.cross_entropy(models[i](x), y))

    for k in range(2):
        run_workers({i: (lambda i=i, k=k: step(i, k)) for i in range(2)})
    prepared = [p for p in trainers[0]._session.client._streams.encoder.prepared.values() if p.in_region]
    regions = [p._region for p in prepared]
    assert prepared
    with pytest.raises(BarrierTimeoutError):
        step(0, 2)  # worker 1 never comes
    after = trainers[0]._session.client._streams.encoder.prepared.values()
    assert not any(p.in_region or p._region in regions for p in after)
    run_workers({i: trainers[i].close for i in range(2)})
    assert not _region_files()

"""A task's TaskInfo reads as a plain TaskStatus: names and Python values, no wire messages.

This file holds the service tier's tests of the subject; `tests/unit/test_status.py` holds the other
tiers'.
"""

from __future__ import annotations

import logging
import threading

import pytest

import psframe
from psframe import optim
from psframe.wire import messages
from tests.conftest import free_cluster
from tests.unit.test_status import _Clicks


@pytest.mark.service
@pytest.mark.parametrize(
    "sync, table",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["async", "async_table", "sync", "sync_table"],
)
def test_applied_steps_count_the_workers_steps_the_ps_applied(caplog, sync, table):
    """Each worker's step whose gradients the ps applied counts once, however many messages or optimizers it
    took: asynchronous training, one per global step; synchronous with R=2, two a round. ``psframe status``
    (TaskStatus.applied_steps) and the ps task's last line say the same number."""
    steps, cluster = 3, free_cluster(1, 2)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        replicas = psframe.SyncReplicas(replicas_to_aggregate=2, timeout=30) if sync else None
        models = {i: _Clicks(table) for i in range(2)}
        trainers = {
            i: psframe.Trainer(models[i], cluster, task_index=i, optimizer=optim.SGD(lr=0.1), sync=replicas)
            for i in range(2)
        }
        trainers[0].connect()

        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                if i:  # the chief is connected: it created the model
                    trainers[i].connect()
                for step in range(steps):
                    trainers[i].step(models[i].loss(step, i))
                trainers[i].close()
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a worker hung"
        assert not errors, errors
        status = messages.task_status(server.service.info())
        with caplog.at_level(logging.INFO, logger="psframe.ps.serving.server"):
            assert server.join(timeout=30)
    finally:
        server.stop(grace=0.1)
    global_step = steps if sync else 2 * steps
    applied = 2 * steps  # two workers' steps each: async, one a global step; sync, both members of each round
    assert status.global_step == global_step
    assert status.applied_steps == applied == sum(w.applied_steps for w in status.workers)
    assert (
        f"/job:ps/task:0: training is over at global step {global_step} ({applied} worker steps applied, "
        "0 dropped as stale or late, 0 pushes refused as invalid); exiting"
    ) in caplog.text

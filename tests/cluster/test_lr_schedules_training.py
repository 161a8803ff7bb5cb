"""Learning-rate schedules through the ps tasks: SGD and Adam with a schedule train as one process
with that scheduler (asynchronous and synchronous, embedding tables included), a restore goes on
with the schedule where it stood, and the chief's metric reaches every ps task's ReduceLROnPlateau.

This file holds the cluster tier's tests of the subject;
`tests/service/test_lr_schedules_training.py` holds the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.optim import lr_scheduler as schedules
from tests.service.test_sync import connect_all, run_workers


@pytest.mark.cluster  # the ps task's serving processes are child processes
def test_a_ps_task_served_from_several_processes_steps_the_schedule_by_its_one_global_step():
    from tests.conftest import free_cluster

    grad, steps, workers = 0.25, 12, 3  # powers of two: every update and sum exact, in any order

    class Known(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64))

        def loss(self) -> torch.Tensor:
            return grad * self.w.sum()

    cluster = free_cluster(1, workers)
    optimizer = psframe.optim.SGD(lr=0.5, schedule=schedules.StepLR(step_size=5, gamma=0.5))
    server = psframe.Server(cluster, "ps", 0, serving_processes=2)
    try:
        trainers = {i: psframe.Trainer(Known(), cluster, task_index=i, optimizer=optimizer) for i in range(workers)}
        connect_all(trainers)

        def train(i: int) -> int:
            for _ in range(steps):
                trainers[i].step(trainers[i].model.loss())
            return trainers[i].stats.pushed_steps

        assert sum(run_workers({i: (lambda i=i: train(i)) for i in range(workers)}).values()) == workers * steps
        trainers[0].pull()
        # One process: the rate of global step k is StepLR's after k steps, whichever process applied it.
        expected = -sum(grad * 0.5 * 0.5 ** (k // 5) for k in range(workers * steps))
        assert torch.equal(trainers[0].model.w.detach(), torch.full((64,), expected))
        assert server._shared is not None and server._shared.version >= 1  # the serving processes had the model
        run_workers({i: trainers[i].close for i in range(workers)})
    finally:
        server.stop(grace=0.1)

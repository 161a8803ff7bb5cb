"""The trainer against real in-process ps servers on free loopback ports.

This file holds the unit tier's tests of the subject; `tests/service/test_trainer.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.errors import PlacementError
from tests.conftest import free_cluster
from tests.service.test_trainer import make_model


def test_a_device_string_for_a_missing_ps_task_is_an_error_unless_soft():
    cluster = free_cluster(2, 1)  # nothing started: placement fails before any connection
    with pytest.raises(PlacementError, match="/job:ps/task:5"):
        psframe.Trainer(
            make_model(), cluster, placement=psframe.Placement(variable_devices={"0.weight": "/job:ps/task:5"})
        )
    with pytest.warns(UserWarning, match="/job:ps/task:5"):
        trainer = psframe.Trainer(
            make_model(),
            cluster,
            placement=psframe.Placement(variable_devices={"0.weight": "/job:ps/task:5"}, soft=True),
        )
    assert trainer.placement.shards_of("0.weight")[0].ps_task in (0, 1)


def test_bad_trainer_arguments_fail_up_front():
    cluster = free_cluster(1, 1)
    model = make_model()
    with pytest.raises(TypeError, match="psframe.optim"):
        psframe.Trainer(model, cluster, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not trainable parameters"):
        psframe.Trainer(model, cluster, placement=psframe.Placement(variable_devices={"nope.weight": "/job:ps/task:0"}))
    with pytest.raises(psframe.ClusterSpecError, match="task_index"):
        psframe.Trainer(model, cluster, task_index=3)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        psframe.Trainer(frozen, cluster)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            psframe.Trainer(model, cluster, device="cuda")


def test_step_outside_the_with_block_is_refused():
    trainer = psframe.Trainer(make_model(), free_cluster(1, 1))
    with pytest.raises(psframe.PsframeError, match="with trainer"):
        trainer.step()

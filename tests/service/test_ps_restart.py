"""A ps task started again without a checkpoint never silently resets the model.

The chief gives it the values of its replica (at most a step old) and the
global step it had reached; the task says so with a WARNING, and training
goes on exactly where it was (SGD with a known gradient: exact values).
"""

from __future__ import annotations

import logging

import pytest
import torch

import psframe
from psframe.launch import pick_free_ports

pytestmark = pytest.mark.service

STEPS_BEFORE, STEPS_AFTER = 5, 6


def test_a_ps_started_again_without_a_checkpoint_takes_the_chiefs_values_and_step(caplog):
    ps_port, worker_port = pick_free_ports(2)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]})
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    x = torch.ones(1, 4)
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        trainer = psframe.Trainer(
            model,
            cluster,
            optimizer=psframe.optim.SGD(lr=0.25),
            transport=psframe.Transport(connect_timeout=30.0, same_host_memory=False),
        )
        with trainer:
            for _ in range(STEPS_BEFORE):
                trainer.step(model(x).sum())  # the gradient is 1 everywhere
            server.stop(grace=0.0)  # the ps task is lost, with everything it held
            server = psframe.Server(cluster, "ps", 0, serving_processes=1)  # and started again, empty
            with caplog.at_level(logging.WARNING, logger="psframe.ps.service"):
                for _ in range(STEPS_AFTER):
                    trainer.step(model(x).sum())
            assert trainer.stats.recoveries == 1
            info = server.service.info()
            # Not from 0: the step the chief had reached, then the steps after.
            assert info.global_step == trainer.global_step == STEPS_BEFORE + STEPS_AFTER
            trainer.pull()
            assert model.weight.detach().tolist() == [[-0.25 * (STEPS_BEFORE + STEPS_AFTER)] * 4]
        warnings = [r.getMessage() for r in caplog.records if "without a checkpoint" in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert f"goes on at global step {STEPS_BEFORE}" in warnings[0]
        assert "optimizer state starts afresh" in warnings[0]
    finally:
        server.stop(grace=0.1)

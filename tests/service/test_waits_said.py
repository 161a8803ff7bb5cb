"""A task that waits says so at WARNING, naming whom it waits for, in a script that set up no logging.

Each task runs in a fresh Python process whose script configures no logging:
Python's default then prints WARNING and above, bare, on stderr (and nothing
below), so a line seen at all was logged at WARNING. Every wait for a line
is bounded by a generous deadline; none checks how soon it came.

This file holds the service tier's tests of the subject; `tests/cluster/test_waits_said.py` holds
the other tiers'.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

import psframe
from psframe.ps.service import ParameterServerService, membership
from psframe.wire import psframe_pb2 as pb
from tests.conftest import free_cluster


@pytest.mark.service
def test_a_ps_task_holding_the_model_says_it_waits_for_the_workers_until_one_calls(monkeypatch, caplog):
    monkeypatch.setattr(membership, "WAIT_SAID_AFTER_S", 0.0)
    monkeypatch.setattr(membership, "WAIT_SAID_EVERY_S", 0.0)
    cluster = free_cluster(1, 2)
    service = ParameterServerService(cluster, 0)  # its model as a restored one: held from the start
    assert service.store.create({"w": torch.zeros(3)}, psframe.optim.SGD(lr=0.1))
    workers = ", ".join(f"/job:worker/task:{i} at {cluster.task_address('worker', i)}" for i in range(2))
    with caplog.at_level(logging.WARNING, logger="psframe.ps.service.membership"):
        assert not service.check_training_over()
        (said,) = [r.getMessage() for r in caplog.records]
        assert re.fullmatch(
            rf"/job:ps/task:0: holds the model; waiting for {re.escape(workers)} to connect \(\d+s so far\)", said
        )
        caplog.clear()
        service.get_info(
            pb.InfoRequest(caller=pb.Caller(job_name="worker", task_index=1, cluster_fingerprint=cluster.fingerprint))
        )
        for _ in range(3):  # training began here: nothing more to say
            assert not service.check_training_over()
    assert not caplog.records, caplog.text
    service.close()

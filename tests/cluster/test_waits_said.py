"""A task that waits says so at WARNING, naming whom it waits for, in a script that set up no logging.

Each task runs in a fresh Python process whose script configures no logging:
Python's default then prints WARNING and above, bare, on stderr (and nothing
below), so a line seen at all was logged at WARNING. Every wait for a line
is bounded by a generous deadline; none checks how soon it came.

This file holds the cluster tier's tests of the subject; `tests/service/test_waits_said.py` holds
the other tiers'.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import free_cluster

DEADLINE_S = 90.0  # for a line to appear: the child imports torch first

# A bare ps task, as a user's script starts one: no logging set up.
PS = """
import sys
import psframe
psframe.Server(psframe.ClusterSpec.from_string(sys.argv[1]), "ps", 0, serving_processes=1).join()
"""

# A worker whose ps task never comes up: no logging set up either.
WORKER = """
import sys
import torch
import psframe
cluster = psframe.ClusterSpec.from_string(sys.argv[1])
psframe.Trainer(torch.nn.Linear(2, 1), cluster, transport=psframe.Transport(connect_timeout=600)).connect()
"""


def lines_like(pattern: str):
    """``done`` for :meth:`ProcessGroup.wait_until`: two whole lines match ``pattern`` (said, and said again)."""
    return lambda output: len(re.findall(pattern, output, flags=re.MULTILINE)) >= 2


@pytest.mark.cluster
def test_a_lone_ps_task_says_it_waits_for_the_chief_s_model(processes):
    cluster = free_cluster(1, 2)
    processes.start("ps0", [sys.executable, "-c", PS, cluster.to_string()])
    chief = re.escape(f"/job:worker/task:0 at {cluster.task_address('worker', 0)}")
    pattern = rf"^/job:ps/task:0: waiting for {chief} \(the chief\) to send the model "
    pattern += r"\(\d+s so far; workers heard from: none\)$"
    processes.wait_until("ps0", lines_like(pattern), "say twice whom it waits for", DEADLINE_S)


@pytest.mark.cluster
def test_a_worker_says_it_waits_for_a_missing_ps_task(processes):
    cluster = free_cluster(1, 1)  # nothing listens on the ps port
    processes.start("worker0", [sys.executable, "-c", WORKER, cluster.to_string()])
    ps = re.escape(f"/job:ps/task:0 at {cluster.task_address('ps', 0)}")
    pattern = rf"^/job:worker/task:0 waiting for {ps} to come up \(\d+s of 600s\)$"
    processes.wait_until("worker0", lines_like(pattern), "say twice whom it waits for", DEADLINE_S)

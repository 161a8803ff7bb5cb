"""Tasks asked to stop: SIGTERM (Kubernetes, Spark, spot machines, ``psframe launch``) and Ctrl-C.

A worker given SIGTERM finishes its step and leaves as a finished worker does, within
``PSFRAME_STOP_GRACE`` (psframe.worker.leaving); a ps task given SIGTERM saves a checkpoint where
it can and ends with one line (psframe.ps.serving.leaving); a ps task given Ctrl-C ends with one
line, with or without ``flags.run``; ``flags.run`` gives a stopped task's code, and 0 for
``Server.join()``'s True.

Unit tests of the parts, then real processes (tests/support/cluster_job.py, which does not use
``flags.run``) on loopback ports the OS picks, every wait bounded and every process killed by PID
at the end.

This file holds the cluster tier's tests of the subject; `tests/unit/test_leaving.py` holds the
other tiers'.
"""

from __future__ import annotations

import re
import signal
import sys

import pytest

from psframe import checkpoint
from tests.conftest import CLUSTER_JOB, cluster_flags, free_cluster
from tests.unit.test_leaving import WAIT_S, _no_traceback


@pytest.mark.cluster
def test_a_ps_task_given_ctrl_c_ends_with_one_line_without_flags_run(processes):
    cluster = free_cluster(1, 1)
    ps = processes.start_task(cluster, "ps", 0)
    processes.wait_for_output("ps0", "serving at", timeout=WAIT_S)
    ps.popen.send_signal(signal.SIGINT)
    assert ps.popen.wait(timeout=WAIT_S) == 130
    _no_traceback(ps.output)
    assert ps.output.count("cluster_job.py: interrupted by Ctrl-C (SIGINT); stopped\n") == 1, ps.output


@pytest.mark.cluster
def test_a_ps_task_given_sigterm_saves_a_checkpoint_and_ends_with_one_line(processes, tmp_path):
    cluster = free_cluster(1, 1)
    folder = tmp_path / "ckpt"
    ps = processes.start_task(cluster, "ps", 0, f"--checkpoint_dir={folder}")
    processes.start_task(cluster, "worker", 0, "--train_steps=1000000", "--step_delay=0.05")
    processes.wait_for_output("worker0", "local step 5 ", timeout=WAIT_S)
    ps.popen.send_signal(signal.SIGTERM)
    assert ps.popen.wait(timeout=WAIT_S) == 143
    _no_traceback(ps.output)
    found = re.findall(
        r"cluster_job\.py: stopped by SIGTERM; /job:ps/task:0 saved a checkpoint of global step "
        r"(\d+) in (\S+)\n",
        ps.output,
    )
    assert len(found) == 1, ps.output[-3000:]
    step = int(found[0][0])
    assert step >= 5 and [m.step for m in checkpoint.files.list_checkpoints(str(folder))] == [step]
    assert set(checkpoint.load(str(folder))) == {"linear.weight", "linear.bias"}


@pytest.mark.cluster
def test_a_sync_worker_given_sigterm_finishes_its_step_and_the_rounds_go_on_without_it(processes):
    # worker_timeout and sync_timeout far beyond the wait: without the handler, worker 0 would wait at
    # the barrier for the killed worker 1 for minutes.
    cluster = free_cluster(1, 2)
    processes.start_task(cluster, "ps", 0, "--worker_timeout=600")
    sync = ["--sync_replicas", "--sync_timeout=600", "--train_steps=40", "--step_delay=0.05"]
    processes.start_task(cluster, "worker", 0, *sync)
    worker1 = processes.start_task(cluster, "worker", 1, *sync)
    processes.wait_for_output("worker1", "local step 5 ", timeout=WAIT_S)
    worker1.popen.send_signal(signal.SIGTERM)
    procs = processes.wait(timeout=WAIT_S, expect_success=False)
    assert {name: p.returncode for name, p in procs.items()} == {"ps0": 0, "worker0": 0, "worker1": 143}, (
        processes.report()
    )
    _no_traceback(worker1.output)
    assert worker1.output.count("cluster_job.py: stopped by SIGTERM; worker 1 finished its step and left\n") == 1
    assert "worker 1 finished (1 of 2)" in procs["ps0"].output  # told the ps task, as a finished worker does


@pytest.mark.cluster
def test_a_worker_that_cannot_end_its_step_in_the_grace_tells_the_ps_and_ends(processes):
    cluster = free_cluster(1, 1)
    ps = processes.start_task(cluster, "ps", 0, "--worker_timeout=600")
    worker = processes.start(
        "worker0",
        # It connects, then sleeps before its first step.
        [sys.executable, str(CLUSTER_JOB), *cluster_flags(cluster, "worker", 0), "--step_delay=600"],
        env={"PSFRAME_STOP_GRACE": "1"},
    )
    processes.wait_for_output("worker0", "connected to 1 ps tasks", timeout=WAIT_S)
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(timeout=WAIT_S) == 143
    assert (
        worker.output.count(
            "cluster_job.py: stopped by SIGTERM; worker 0 did not end its step within 1s (PSFRAME_STOP_GRACE) and left "
            "without it\n"
        )
        == 1
    ), worker.output
    assert ps.popen.wait(timeout=WAIT_S) == 0  # every worker finished: training is over
    assert "worker 0 finished (1 of 1)" in ps.output

"""Synchronous training (SyncReplicas) end to end: exact oracles and no hangs.

This file holds the cluster tier's tests of the subject; `tests/unit/test_sync.py`,
`tests/service/test_sync.py` hold the other tiers'.
"""

from __future__ import annotations

import json
import re
import signal
import sys

import pytest

from tests.conftest import MNIST_FLAGS, MNIST_STEPS, ROOT, free_cluster
from tests.service.test_sync import last_json


@pytest.mark.cluster
def test_killing_a_worker_with_a_backup_present_does_not_stop_training(processes):
    cluster = free_cluster(2, 3)
    sync = ["--sync_replicas", "--replicas_to_aggregate=2", "--total_num_replicas=3", "--sync_timeout=60"]
    for i in range(2):
        processes.start_task(cluster, "ps", i, "--worker_timeout=3")
    for i in range(3):
        processes.start_task(cluster, "worker", i, "--train_steps=60", "--step_delay=0.02", *sync)
    processes.wait_for_output("worker2", "local step 5 ", timeout=120)
    processes.procs["worker2"].popen.send_signal(signal.SIGKILL)
    procs = processes.wait(timeout=180, expect_success=False)
    assert procs["worker2"].returncode == -signal.SIGKILL
    for name in ("ps0", "ps1", "worker0", "worker1"):
        assert procs[name].returncode == 0, processes.report()
    assert last_json(procs["worker0"].output)["global_step"] >= 60


@pytest.mark.cluster
def test_killing_a_worker_without_a_backup_fails_the_others_within_the_deadline(processes):
    cluster = free_cluster(1, 2)
    processes.start_task(cluster, "ps", 0, "--worker_timeout=3")
    for i in range(2):
        processes.start_task(
            cluster, "worker", i, "--train_steps=100000", "--step_delay=0.02", "--sync_replicas", "--sync_timeout=3"
        )
    processes.wait_for_output("worker1", "local step 5 ", timeout=120)
    processes.procs["worker1"].popen.send_signal(signal.SIGKILL)
    processes.procs["worker0"].popen.wait(timeout=60)
    worker0 = processes.procs["worker0"]
    assert worker0.popen.returncode != 0
    assert "BarrierTimeoutError" in worker0.output
    assert "missing: /job:worker/task:1" in worker0.output
    # It waited its --sync_timeout (3 s) for the dead worker's gradient, no less.
    waited = re.search(r"waited ([\d.]+)s for", worker0.output)
    assert waited and float(waited.group(1)) >= 3.0, worker0.output[-2000:]
    # The ps exits 0 on its own: worker 0 reported that it stopped, and the
    # dead worker stayed silent past the ps's --worker_timeout.
    processes.procs["ps0"].popen.wait(timeout=60)
    assert processes.procs["ps0"].popen.returncode == 0


@pytest.mark.cluster
def test_processes_with_different_numbers_of_steps_all_exit(processes):
    cluster = free_cluster(2, 3)
    for i in range(2):
        processes.start_task(cluster, "ps", i)
    for i, steps in enumerate((10, 25, 40)):
        processes.start_task(
            cluster,
            "worker",
            i,
            "--train_steps=100000",
            f"--max_local_steps={steps}",
            "--sync_replicas",
            "--sync_timeout=60",
        )
    procs = processes.wait(timeout=180)
    assert all(p.returncode == 0 for p in procs.values())
    assert last_json(procs["worker2"].output)["global_step"] == 40


@pytest.mark.mnist
@pytest.mark.cluster
def test_mnist_example_sync_reaches_97_percent(processes, mnist_dir):
    data_dir = mnist_dir
    processes.start(
        "launch",
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "launch",
            "--num_ps",
            "1",
            "--num_workers",
            "2",
            "--timeout",
            "500",
            str(ROOT / "examples" / "mlp_mnist_dist.py"),
            "--",
            f"--data_dir={data_dir}",
            *MNIST_FLAGS,
            "--sync_replicas",
        ],
    )
    procs = processes.wait(timeout=520)
    chief = [
        line.removeprefix("[worker0] ")
        for line in procs["launch"].output.splitlines()
        if line.startswith("[worker0] {")
    ]
    result = json.loads(chief[-1])
    assert result["sync_replicas"] is True
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= MNIST_STEPS


@pytest.mark.cluster
@pytest.mark.parametrize("victim", [0, 1], ids=["chief", "worker"])
def test_a_killed_worker_restarted_mid_run_rejoins_at_the_current_step(processes, victim):
    cluster = free_cluster(2, 2)
    flags = ["--train_steps=40", "--step_delay=0.05", "--sync_replicas", "--sync_timeout=60"]
    for i in range(2):
        processes.start_task(cluster, "ps", i)
    for i in range(2):
        processes.start_task(cluster, "worker", i, *flags)
    name = f"worker{victim}"
    processes.wait_for_output(name, "local step 10 ", timeout=120)
    processes.procs[name].popen.send_signal(signal.SIGKILL)
    processes.procs[name].popen.wait(timeout=30)
    del processes.procs[name]
    restarted = processes.start_task(cluster, "worker", victim, *flags)
    procs = processes.wait(timeout=180)
    assert all(p.returncode == 0 for p in procs.values())
    result = last_json(restarted.output)
    # It rejoined where training was (not at step 0) and finished with the others.
    first_step = int(restarted.output.split("connected to 2 ps tasks at global step ")[1].split()[0])
    assert first_step >= 10
    assert result["global_step"] == 40
    assert result["local_steps"] == 40 - first_step
    assert last_json(procs[f"worker{1 - victim}"].output)["global_step"] == 40

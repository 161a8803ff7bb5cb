"""Kubernetes: the TF_CONFIG operators set, the manifests in examples/k8s/, and python -m psframe.k8s.

This file holds the cluster tier's tests of the subject; `tests/unit/test_k8s.py` holds the other
tiers'.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from psframe.launch import pick_free_ports
from tests.conftest import ROOT
from tests.unit.test_k8s import _entrypoint


@pytest.mark.cluster
def test_a_tfjob_tf_config_alone_trains_a_cluster_on_loopback(processes):
    """Chief, worker and ps processes told nothing but the TF_CONFIG a TFJob gives them."""
    ps_port, chief_port, worker_port, evaluator_port = pick_free_ports(4)
    cluster = {
        "chief": [f"127.0.0.1:{chief_port}"],
        "evaluator": [f"127.0.0.1:{evaluator_port}"],
        "ps": [f"127.0.0.1:{ps_port}"],
        "worker": [f"127.0.0.1:{worker_port}"],
    }

    def env(task_type: str) -> dict[str, str]:
        return {
            "TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": task_type, "index": 0}, "environment": "cloud"},
                separators=(",", ":"),
            )
        }

    processes.start(
        "ps0",
        [sys.executable, "-m", "psframe.cli", "server", f"--bind_address=127.0.0.1:{ps_port}", "--serving_processes=1"],
        env=env("ps"),
    )
    for name, task_type in (("chief", "chief"), ("worker", "worker")):
        processes.start(
            name,
            [sys.executable, str(ROOT / "tests" / "support" / "cluster_job.py"), "--train_steps=60"],
            env=env(task_type),
        )
    procs = processes.wait(timeout=120)
    chief = json.loads([line for line in procs["chief"].output.splitlines() if line.startswith("{")][-1])
    worker = json.loads([line for line in procs["worker"].output.splitlines() if line.startswith("{")][-1])
    assert (chief["task"], worker["task"]) == ("worker0", "worker1")
    assert chief["global_step"] >= 60 and chief["final_loss"] < chief["initial_loss"]
    assert "/job:ps/task:0 serving at" in procs["ps0"].output


@pytest.mark.cluster
def test_entrypoint_runs_the_command_with_tf_config():
    proc = _entrypoint(
        "--hostname",
        "job-ps-0",
        "--",
        sys.executable,
        "-c",
        "import os, psframe.cluster.tf_config as t; print(t.resolve_cluster()[1:])",
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip().endswith("('ps', 0)"), out


@pytest.mark.cluster
def test_entrypoint_stays_up_after_success_until_sigterm():
    proc = _entrypoint(
        "--hostname",
        "job-worker-0",
        "--stay_after_success",
        "--",
        sys.executable,
        "-c",
        "print('task done', flush=True)",
    )
    try:
        deadline, lines = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
            if "staying up" in lines[-1] or proc.poll() is not None:
                break
        assert "task done\n" in lines and "staying up" in lines[-1], lines
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.cluster
def test_entrypoint_ends_with_a_failed_tasks_code():
    proc = _entrypoint(
        "--hostname", "job-worker-0", "--stay_after_success", "--", sys.executable, "-c", "raise SystemExit(3)"
    )
    proc.communicate(timeout=60)
    assert proc.returncode == 3

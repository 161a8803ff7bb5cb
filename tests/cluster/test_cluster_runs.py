"""Multi-process clusters on loopback: training runs end to end and every process exits 0."""

from __future__ import annotations

import json
import re
import sys

import pytest

from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES
from tests.conftest import CLUSTER_JOB, MNIST_FLAGS, MNIST_STEPS, ROOT, free_cluster

pytestmark = pytest.mark.cluster


def last_json(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in output:\n{output[-3000:]}"
    return json.loads(lines[-1])


def test_two_ps_two_workers_train_and_every_process_exits_0(processes):
    cluster = free_cluster(2, 2)
    for i in range(2):
        processes.start_task(cluster, "ps", i)
    for i in range(2):
        processes.start_task(cluster, "worker", i, "--train_steps=300")
    procs = processes.wait(timeout=120)
    assert all(p.returncode == 0 for p in procs.values())
    for i in range(2):
        result = last_json(procs[f"worker{i}"].output)
        assert result["global_step"] >= 300
        assert result["final_loss"] < result["initial_loss"] / 20, result
        assert last_json(procs[f"ps{i}"].output) == {"task": f"ps{i}", "exit": "clean"}
    # Both workers trained: their local steps add up to the global step.
    workers = [last_json(procs[f"worker{i}"].output) for i in range(2)]
    assert all(w["local_steps"] > 0 for w in workers)
    assert sum(w["local_steps"] for w in workers) == max(w["global_step"] for w in workers)


def test_workers_started_before_the_ps_wait_and_then_train(processes):
    cluster = free_cluster(1, 2)
    for i in range(2):
        processes.start_task(cluster, "worker", i, "--train_steps=100")
    processes.wait_for_output("worker0", "waiting for /job:ps/task:0", timeout=60)
    processes.wait_for_output("worker1", "waiting for /job:ps/task:0", timeout=60)
    processes.start_task(cluster, "ps", 0)
    procs = processes.wait(timeout=120)
    assert all(p.returncode == 0 for p in procs.values())
    assert last_json(procs["worker0"].output)["global_step"] >= 100


def test_a_300_mb_variable_round_trips_intact_across_parts(processes):
    cluster = free_cluster(2, 1)
    for i in range(2):
        processes.start_task(cluster, "ps", i)
    processes.start_task(cluster, "worker", 0, "--train_steps=3", "--big_mb=300")
    procs = processes.wait(timeout=300)
    result = last_json(procs["worker0"].output)
    assert result["big_bytes"] >= 300_000_000
    assert result["big_parts"] >= 300_000_000 // DEFAULT_MAX_SHARD_BYTES  # no part above the message size
    assert result["global_step"] == 3
    # Every element is its row index minus exactly one per step: any lost,
    # doubled or misplaced part would show.
    assert result["big_max_error"] == 0.0


def test_a_worker_pointing_at_a_missing_ps_fails_within_its_deadline(processes):
    cluster = free_cluster(1, 1)  # nothing listens on the ps port
    processes.start_task(cluster, "worker", 0, "--connect_timeout=2")
    procs = processes.wait(timeout=60, expect_success=False)
    worker = procs["worker0"]
    assert worker.returncode != 0
    assert "ConnectTimeoutError" in worker.output
    assert f"/job:ps/task:0 at {cluster.task_address('ps', 0)}" in worker.output
    # It gave up at its deadline, as the error says: 2 s (and a wait's last ask) after it began.
    waited = re.search(r"waited ([\d.]+)s for", worker.output)
    assert waited and 2.0 <= float(waited.group(1)) <= 2.0 + 1.0, worker.output[-2000:]


def test_psframe_launch_runs_a_whole_cluster(processes):
    processes.start(
        "launch",
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "launch",
            "--num_ps",
            "2",
            "--num_workers",
            "2",
            "--timeout",
            "120",
            str(CLUSTER_JOB),
            "--",
            "--train_steps=100",
        ],
    )
    procs = processes.wait(timeout=150)
    output = procs["launch"].output
    assert "[launch] done: ps0=0 ps1=0 worker0=0 worker1=0" in output
    assert '[worker0] {"task": "worker0"' in output
    assert '[ps1] {"task": "ps1", "exit": "clean"}' in output


@pytest.mark.parametrize("serving", [[], ["--serving_processes=3"]], ids=["one_process", "three_processes"])
def test_psframe_server_serves_a_bare_ps_task_until_the_workers_finish(processes, serving):
    cluster = free_cluster(1, 1)
    processes.start(
        "ps0",
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "server",
            f"--cluster_spec={cluster.to_string()}",
            "--job_name=ps",
            "--task_index=0",
            *serving,
        ],
    )
    processes.start_task(cluster, "worker", 0, "--train_steps=50")
    procs = processes.wait(timeout=120)
    assert "/job:ps/task:0 serving at" in procs["ps0"].output
    assert last_json(procs["worker0"].output)["global_step"] == 50


def launch_mnist(processes, mnist_dir, *flags: str, timeout: int) -> str:
    """The MNIST example on 1 ps task and 2 workers under ``psframe launch``; its output, prefixed by task."""
    argv = [sys.executable, "-m", "psframe.cli", "launch", "--num_ps", "1", "--num_workers", "2"]
    example = str(ROOT / "examples" / "mlp_mnist_dist.py")
    processes.start("launch", [*argv, "--timeout", str(timeout), example, "--", f"--data_dir={mnist_dir}", *flags])
    return processes.wait(timeout=timeout + 20)["launch"].output


def chief_result(output: str) -> dict:
    """The chief's JSON result in ``psframe launch``'s output."""
    return json.loads([line for line in output.splitlines() if line.startswith("[worker0] {")][-1].split(" ", 1)[1])


@pytest.mark.mnist
@pytest.mark.parametrize(
    "flags",
    [[], ["--wire_dtype=bfloat16"], ["--serving_processes=2"]],
    ids=["float32", "bfloat16_wire", "two_serving_processes"],
)
def test_mnist_example_async_reaches_97_percent(processes, mnist_dir, flags):
    result = chief_result(launch_mnist(processes, mnist_dir, *MNIST_FLAGS, *flags, timeout=400))
    assert result["test_accuracy"] >= 0.97, result
    assert result["global_step"] >= MNIST_STEPS
    assert {"global_step", "test_accuracy", "wall_seconds", "steps_per_sec"} <= set(result)


@pytest.mark.mnist
def test_mnist_example_reads_each_example_once_an_epoch(processes, mnist_dir):
    """``--epochs_exactly_once 2`` at batches of 500: the two workers' steps are exactly the
    2 x 120 batches of two epochs (asynchronous: one global step a batch), whoever took which."""
    flags = ("--epochs_exactly_once=2", "--batch_size=500", "--train_steps=100000")
    output = launch_mnist(processes, mnist_dir, *flags, timeout=300)
    chief = chief_result(output)
    other = re.search(r"\[worker1\] .*worker 1 done after (\d+) local steps", output)
    assert other, output
    assert chief["global_step"] == 240 == chief["local_steps"] + int(other.group(1)), chief
    assert chief["test_accuracy"] >= 0.9, chief

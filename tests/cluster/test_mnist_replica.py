"""examples/mnist_replica.py (TF's mnist_replica.py on psframe) trains as real processes on loopback.

The data is an MNIST-shaped set written here (IDX files in ``DIR/MNIST/raw``, as
``examples/mnist_data.py`` reads them): each digit lights a band of rows of its
own over noise, so a few dozen steps learn it. Nothing is downloaded.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, free_cluster, psframe_server_command

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "examples" / "mnist_replica.py"
NUM_IMAGES = 1000
VALIDATION_SIZE = 200
TRAIN_STEPS = 50
FLAGS = (
    f"--train_steps={TRAIN_STEPS}",
    "--batch_size=50",
    f"--validation_size={VALIDATION_SIZE}",
    "--num_gpus=0",
)


def write_mnist(data_dir: Path, num_images: int, seed: int = 0) -> None:
    """A learnable MNIST-shaped training split: digit d brightens rows 2d+2..2d+3 of noisy images
    (enough noise that the loss stays above zero after a few dozen steps)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, num_images).astype(np.uint8)
    pixels = rng.integers(0, 128, (num_images, 28, 28))
    for digit in range(10):
        pixels[labels == digit, 2 + 2 * digit : 4 + 2 * digit, 4:24] += 96
    images = np.clip(pixels, 0, 255).astype(np.uint8)
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, num_images, 28, 28) + images.tobytes())
    (raw / "train-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, num_images) + labels.tobytes())


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    write_mnist(folder, NUM_IMAGES)
    return folder


def last_json(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line in the output:\n{output[-3000:]}"
    return json.loads(lines[-1])


def check_learned(result: dict, output: str) -> None:
    """The validation line TF prints, and a loss and accuracy far better than chance (ln 10 = 2.30)."""
    assert f"After {result['global_step']} training step(s), validation cross entropy = " in output
    assert result["validation_examples"] == VALIDATION_SIZE
    assert 0 <= result["validation_cross_entropy"] / VALIDATION_SIZE < 1.0, result
    assert result["validation_accuracy"] >= 0.8, result


def run_example(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync_replicas"])
def test_one_ps_and_two_workers_train_and_exit_0(processes, data_dir, sync):
    cluster = free_cluster(1, 2)
    flags = [f"--data_dir={data_dir}", *FLAGS, *(["--sync_replicas"] if sync else [])]
    processes.start_task(cluster, "ps", 0, *flags, script=EXAMPLE)
    for i in range(2):
        processes.start_task(cluster, "worker", i, *flags, script=EXAMPLE)
    procs = processes.wait(timeout=240)
    assert all(p.returncode == 0 for p in procs.values())
    assert "job name = ps" in procs["ps0"].output
    assert "Worker 0: Initializing session..." in procs["worker0"].output
    assert "Worker 1: Waiting for session to be initialized..." in procs["worker1"].output
    assert "/job:worker/task:1 serving at" in procs["worker1"].output  # TF's in-process server of the task
    results = [last_json(procs[f"worker{i}"].output) for i in range(2)]
    for i, result in enumerate(results):
        assert result["task"] == f"worker{i}"
        assert result["sync_replicas"] is sync
        check_learned(result, procs[f"worker{i}"].output)
    if sync:
        # Every update averaged both workers' gradients of the same step: one update per round.
        assert [r["global_step"] for r in results] == [TRAIN_STEPS, TRAIN_STEPS], results
        assert [r["local_steps"] - r["dropped_local_steps"] for r in results] == [TRAIN_STEPS, TRAIN_STEPS], results
    else:
        # Each worker stops once it sees the last step; the other's step in flight may add one.
        assert all(TRAIN_STEPS <= r["global_step"] <= TRAIN_STEPS + 1 for r in results), results
        # Every push was applied once: the last values pulled count every worker's steps.
        assert max(r["global_step"] for r in results) == sum(r["local_steps"] for r in results), results


def test_workers_with_existing_servers_train_against_psframe_server(processes, data_dir):
    cluster = free_cluster(1, 2)
    processes.start("ps0", psframe_server_command(cluster, 0, "--serving_processes=1"))
    for i in range(2):
        processes.start_task(
            cluster, "worker", i, f"--data_dir={data_dir}", *FLAGS, "--existing_servers", script=EXAMPLE
        )
    procs = processes.wait(timeout=240)
    assert all(p.returncode == 0 for p in procs.values())
    for i in range(2):
        output = procs[f"worker{i}"].output
        assert f"Using existing servers at: grpc://{cluster.task_address('ps', 0)}" in output
        assert "serving at" not in output  # no server of its own: the cluster's servers exist already
        check_learned(last_json(output), output)
    # A ps task is what --existing_servers says already runs: the example refuses to be one.
    refused = run_example(
        f"--ps_hosts={cluster.task_address('ps', 0)}",
        f"--worker_hosts={','.join(cluster.job_tasks('worker'))}",
        "--job_name=ps",
        "--task_index=0",
        "--existing_servers",
    )
    assert refused.returncode == 2, refused.stderr
    assert "start only workers with it" in refused.stderr


def test_download_only_checks_the_local_data_and_never_fetches(data_dir, tmp_path):
    found = run_example("--download_only", f"--data_dir={data_dir}")
    assert found.returncode == 0, found.stderr
    assert f"{NUM_IMAGES} training images" in found.stdout
    missing = run_example("--download_only", f"--data_dir={tmp_path / 'empty'}")
    assert missing.returncode == 1
    assert "scripts/fetch_mnist.py" in missing.stderr

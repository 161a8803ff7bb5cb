"""Recovery from lost tasks: a ps task's shard saved and restored (in process), then
real SIGKILLs at a random step and restarts with the same command (cluster).

This file holds the cluster tier's tests of the subject; `tests/unit/test_recovery.py` holds the
other tiers'.
"""

from __future__ import annotations

import json
import random
import re
import signal

import pytest
import torch

from psframe.checkpoint import files as checkpoint_io
from psframe.optim import OptimizerSpec
from psframe.ps import recovery
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb
from tests.conftest import MNIST_FLAGS, MNIST_STEPS, ROOT, free_cluster

SAVE_EVERY = 40
ADAM = OptimizerSpec("Adam", {"lr": 0.01})


# ---- save_shard and restoring, in process


def row_defs(bounds: list[int], full_shape=(10, 3)) -> list[pb.VariableDef]:
    """emb.weight cut into parts at ``bounds`` (one part per ps task), as the chief places it."""
    return [
        pb.VariableDef(
            name=f"emb.weight/part_{i}",
            variable="emb.weight",
            dtype="float32",
            shape=[hi - lo, *full_shape[1:]],
            full_shape=full_shape,
            row_start=lo,
            part_index=i,
            num_parts=len(bounds) - 1,
        )
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
    ]


def trained_stores(emb: torch.Tensor, defs: list[pb.VariableDef], steps: int = 3):
    """One store per part, each stepped by Adam a few times."""
    stores = []
    for d in defs:
        store = VariableStore()
        store.create({d.name: emb[d.row_start : d.row_start + d.shape[0]]}, ADAM)
        for i in range(steps):
            store.apply({d.name: torch.full(tuple(d.shape), float(i + 1))})
            store.advance_step()
        stores.append(store)
    return stores


def save_all(url, stores, defs, sync, step=100):
    records = [
        recovery.save_shard(store, [d], sync, url, step, k, len(stores))
        for k, (store, d) in enumerate(zip(stores, defs))
    ]
    return checkpoint_io.write_manifest(url, step, records)


# ---- real processes


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def global_steps_seen(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"local step \d+ global step (\d+)", output)]


def wait_for_step(processes, at_step: int) -> None:
    processes.wait_until(
        "worker0",
        lambda out: max(global_steps_seen(out), default=0) >= at_step,
        f"reach global step {at_step}",
        timeout=120,
    )


def kill_and_restart(processes, cluster, name: str, flags: list[str], at_step: int) -> tuple[int, object]:
    """SIGKILL task ``name`` once worker 0 reached ``at_step``; start it again with the same flags."""
    wait_for_step(processes, at_step)
    proc = processes.procs.pop(name)
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(timeout=30)
    killed_at = max(global_steps_seen(processes.procs["worker0"].output))
    job, index = name[:-1], int(name[-1])
    return killed_at, processes.start_task(cluster, job, index, *flags)


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_ps_restarted_restores_its_shard_and_training_finishes(processes, tmp_path, mode):
    seed = random.randrange(10**6)
    at_step = random.Random(seed).randint(60, 140)
    cluster = free_cluster(2, 2)
    flags = [
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        f"--save_checkpoint_steps={SAVE_EVERY}",
        "--train_steps=250",
        "--step_delay=0.01",
        "--optimizer=Adam",
        "--lr=0.01",
    ]
    if mode == "sync":
        flags += ["--sync_replicas", "--sync_timeout=60"]
    processes.start_cluster(cluster, *flags)
    killed_at, restarted = kill_and_restart(processes, cluster, "ps1", flags, at_step)
    procs = processes.wait(timeout=240)
    assert all(p.returncode == 0 for p in procs.values()), f"seed {seed}"
    restored = re.search(
        r"restored \d+ variables from checkpoint step (\d+) \(its global step (\d+)\)", restarted.output
    )
    assert restored, restarted.output[-2000:]
    checkpoint_step = int(restored.group(1))
    assert killed_at - checkpoint_step <= SAVE_EVERY + 10, (killed_at, checkpoint_step, seed)
    for i in range(2):
        result = last_json(procs[f"worker{i}"].output)
        assert result["global_step"] >= 250
        assert result["recoveries"] == 1, result
        assert result["final_loss"] < result["initial_loss"] / 20, result


@pytest.mark.cluster
def test_the_whole_job_killed_and_run_again_resumes_from_the_checkpoint(processes, tmp_path):
    cluster = free_cluster(1, 2)
    flags = [
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        f"--save_checkpoint_steps={SAVE_EVERY}",
        "--train_steps=300",
        "--step_delay=0.01",
    ]
    processes.start_cluster(cluster, *flags)
    at_step = random.randint(100, 200)
    wait_for_step(processes, at_step)
    processes.kill_all()
    # Read after the kill: the job trains on until SIGKILL lands.
    killed_at = max(global_steps_seen(processes.procs["worker0"].output))
    processes.procs.clear()
    cluster = free_cluster(1, 2)  # new ports: the old ones may linger
    processes.start_cluster(cluster, *flags)
    procs = processes.wait(timeout=240)
    chief = procs["worker0"].output
    resumed_at = int(re.search(r"connected to 1 ps tasks at global step (\d+)", chief).group(1))
    # It resumed from a checkpoint near where it died. The last step printed may
    # lag the last one saved: a loaded machine delays the chief's output (and
    # SIGKILL loses what it had not written yet), so the checkpoint may be ahead of it.
    assert resumed_at > 0, (killed_at, resumed_at)
    assert -SAVE_EVERY <= killed_at - resumed_at <= SAVE_EVERY + 10, (killed_at, resumed_at)
    result = last_json(chief)
    assert result["global_step"] >= 300
    assert result["local_steps"] < 300 - resumed_at + 20  # it did not start over


@pytest.mark.cluster
@pytest.mark.parametrize("victim", ["worker0", "worker1"])
def test_a_killed_worker_restarted_rejoins_async(processes, tmp_path, victim):
    cluster = free_cluster(1, 2)
    flags = [
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        f"--save_checkpoint_steps={SAVE_EVERY}",
        "--train_steps=300",
        "--step_delay=0.01",
    ]
    processes.start_cluster(cluster, *flags)
    at_step = random.randint(60, 160)
    wait_for_step(processes, at_step)
    proc = processes.procs.pop(victim)
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(timeout=30)
    restarted = processes.start_task(cluster, "worker", int(victim[-1]), *flags)
    procs = processes.wait(timeout=240)
    assert all(p.returncode == 0 for p in procs.values())
    rejoined_at = int(re.search(r"connected to 1 ps tasks at global step (\d+)", restarted.output).group(1))
    assert rejoined_at >= at_step - 5
    assert last_json(restarted.output)["global_step"] >= 300


@pytest.mark.cluster
@pytest.mark.mnist
def test_mnist_example_survives_a_ps_kill_and_reaches_97_percent(processes, tmp_path, mnist_dir):
    data_dir = mnist_dir
    cluster = free_cluster(1, 2)
    example = ROOT / "examples" / "mlp_mnist_dist.py"
    flags = [
        f"--data_dir={data_dir}",
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        "--save_checkpoint_steps=500",
        "--log_every=100",
        *MNIST_FLAGS,
    ]
    processes.start_cluster(cluster, *flags, script=example)
    at_local_step = random.randint(3, 10) * 100  # of each worker's 1,500 or so
    processes.wait_for_output("worker0", f"local step {at_local_step},", timeout=300)
    proc = processes.procs.pop("ps0")
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(timeout=30)
    restarted = processes.start_task(cluster, "ps", 0, *flags, script=example)
    procs = processes.wait(timeout=400)
    assert "restored 4 variables from checkpoint" in restarted.output
    result = last_json(procs["worker0"].output)
    assert result["recoveries"] == 1
    assert result["global_step"] >= MNIST_STEPS
    assert result["test_accuracy"] >= 0.97, result

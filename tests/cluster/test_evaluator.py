"""The evaluator beside training: each committed checkpoint evaluated once, in order, from files alone.

Oracles: the metrics of a checkpoint computed by hand from ``psframe.checkpoint.load``,
and, for dynamic tables, those a live cluster gives at the same global step. The
evaluator never touches the training job: the process test trains twice, once with an
evaluator killed mid-way beside it, and compares the final checkpoints bit for bit.

This file holds the cluster tier's tests of the subject; `tests/unit/test_evaluator.py`,
`tests/service/test_evaluator.py` hold the other tiers'.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import psframe
from tests.conftest import cluster_flags, free_cluster, psframe_command
from tests.unit.test_evaluator import EXAMPLE, evaluator  # noqa: F401

JOB = "tests/support/cluster_job.py"


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_training_beside_an_evaluator_killed_midway_ends_as_without_it(processes, tmp_path):
    runs = {}
    for name in ("alone", "beside"):
        cluster = free_cluster(1, 1)
        ckpt = str(tmp_path / name)
        args = ["--train_steps=300", f"--checkpoint_dir={ckpt}", "--save_checkpoint_steps=20", "--step_delay=0.02"]
        processes.start(f"{name}_ps", [sys.executable, JOB, *cluster_flags(cluster, "ps", 0), *args])
        processes.start(
            f"{name}_worker",
            [sys.executable, JOB, *cluster_flags(cluster, "worker", 0), *args],
        )
        runs[name] = ckpt
    evaluate = psframe_command(
        "evaluate",
        f"--checkpoint_dir={runs['beside']}",
        "--poll_seconds=0.1",
        "--timeout=120",
        "tests.support.evaluator_jobs:cluster_job",
    )
    processes.start("evaluator", evaluate)
    processes.wait_until("evaluator", lambda out: '{"global_step"' in out, "print a checkpoint's metrics", 120)
    victim = processes.procs.pop("evaluator")
    victim.popen.kill()  # SIGKILL mid-way, by its PID
    victim.popen.wait(timeout=30)
    first = json.loads(next(line for line in victim.output.splitlines() if line.startswith('{"global_step"')))
    procs = processes.wait(timeout=240)

    def result(name: str) -> dict:
        return json.loads([line for line in procs[f"{name}_worker"].output.splitlines() if line.startswith("{")][-1])

    assert result("alone") == result("beside") and result("alone")["global_step"] == 300
    alone, beside = (psframe.checkpoint.load(runs[name]) for name in ("alone", "beside"))
    assert alone.keys() == beside.keys() and all(torch.equal(alone[k], beside[k]) for k in alone)
    # It had evaluated a checkpoint of this run (pruned since: the chief keeps 5).
    assert first["global_step"] % 20 == 0 and 0 < first["global_step"] <= 300 and first["mse"] >= 0, first


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_ctr_example_s_evaluator_follows_training_to_the_chief_s_final_auc(processes, tmp_path):
    cluster = free_cluster(1, 1)
    flags = [
        "--train_samples=20000",
        "--test_samples=4000",
        "--hash_buckets=4096",
        "--batch_size=64",
        "--train_steps=120",
        f"--checkpoint_dir={tmp_path / 'ckpt'}",
        "--save_checkpoint_steps=40",
        "--log_every=40",
    ]
    tf_config = {
        "cluster": {"ps": cluster.job_tasks("ps"), "worker": cluster.job_tasks("worker"), "evaluator": ["127.0.0.1:1"]},
        "task": {"type": "evaluator", "index": 0},
    }
    processes.start(
        "evaluator",
        [sys.executable, str(EXAMPLE), *flags, f"--log_dir={tmp_path / 'runs'}", "--eval_timeout=200"],
        env={"TF_CONFIG": json.dumps(tf_config)},
    )
    processes.start_cluster(cluster, *flags, script=EXAMPLE)
    procs = processes.wait(timeout=280)
    chief = json.loads([line for line in procs["worker0"].output.splitlines() if line.startswith("{")][-1])
    evaluated = [json.loads(line) for line in procs["evaluator"].output.splitlines() if line.startswith('{"mode"')]
    steps = [e["global_step"] for e in evaluated]
    assert steps == sorted(set(steps)) and set(steps) <= {40, 80, 120} and steps[-1] == 120, steps
    assert chief["global_step"] == 120
    assert (evaluated[-1]["auc"], evaluated[-1]["log_loss"]) == (chief["auc"], chief["log_loss"])
    assert list((tmp_path / "runs").glob("events.out.tfevents.*")), "no TensorBoard event file"

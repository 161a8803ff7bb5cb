"""``psframe serve`` as a command in its own process: the line saying where it serves, the API,
SIGTERM and Ctrl-C, a port in use and a bad ``--model`` each ending it in one line.

This file holds the cluster tier's tests of the subject; `tests/unit/test_serve.py` and
`tests/service/test_serve.py` hold the other tiers'.
"""

from __future__ import annotations

import re
import signal

import pytest
import torch

import psframe
from tests.conftest import free_cluster, psframe_command
from tests.support.serve_jobs import Ranker, batch, call, committed, status_at, train_ranker, wait_for

FACTORY = "tests.support.serve_jobs:ranker"
URL_LINE = re.compile(r"psframe serve: serving (http://127\.0\.0\.1:\d+) \(following .*\)")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    """Full checkpoints and deltas of a short run (two ps tasks in this process)."""
    url = str(tmp_path_factory.mktemp("serve-cli") / "ckpt")
    cluster = free_cluster(2, 1)
    servers = [psframe.Server(cluster, "ps", i, serving_processes=1) for i in range(2)]
    try:
        model = Ranker()
        checkpointing = psframe.Checkpointing(url, save_steps=2, delta_steps=1)
        with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=0.5), checkpointing=checkpointing) as t:
            train_ranker(t, model, range(4))
    finally:
        for server in servers:
            server.stop(grace=0.1)
    return url


def served_url(processes, name: str) -> str:
    processes.wait_until(name, lambda out: URL_LINE.search(out) is not None, "say where it serves")
    match = URL_LINE.search(processes.procs[name].output)
    assert match is not None
    return match.group(1)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_psframe_serve_says_where_it_serves_answers_and_stops_in_one_line(processes, checkpoint_dir, stop):
    step = committed(checkpoint_dir)[-1].step
    proc = processes.start(
        "serve", psframe_command("serve", f"--checkpoint_dir={checkpoint_dir}", f"--model={FACTORY}")
    )
    url = served_url(processes, "serve")
    status = wait_for(f"serving step {step}", status_at(url, step))
    assert status["model"] and status["refused"] == 0
    users, items, _ = batch(0)
    code, answer = call(url, "/v1/predict", {"inputs": {"users": users.tolist(), "items": items.tolist()}})
    assert code == 200 and answer["step"] == step and len(answer["outputs"]) == users.shape[0]
    assert torch.tensor(answer["outputs"]).isfinite().all()
    proc.popen.send_signal(stop)
    processes.wait(timeout=60, expect_success=False)
    lines = proc.output.strip().splitlines()
    if stop == signal.SIGTERM:
        assert (
            proc.returncode == 143 and lines[-1] == f"psframe serve: stopped by SIGTERM; served version 1 (step {step})"
        )
    else:
        assert proc.returncode == 130 and lines[-1] == "psframe serve: interrupted by Ctrl-C (SIGINT); stopped"
    assert "Traceback" not in proc.output


def test_a_port_in_use_and_a_bad_model_end_psframe_serve_in_one_line(processes, checkpoint_dir):
    processes.start("first", psframe_command("serve", f"--checkpoint_dir={checkpoint_dir}"))
    port = served_url(processes, "first").rsplit(":", 1)[1]
    second = processes.start("second", psframe_command("serve", f"--checkpoint_dir={checkpoint_dir}", f"--port={port}"))
    bad = processes.start(
        "bad",
        psframe_command(
            "serve", f"--checkpoint_dir={checkpoint_dir}", "--model=tests.support.evaluator_jobs:linear_data"
        ),
    )
    for proc, message in (
        (second, f"psframe serve: error: port {port} on 127.0.0.1 is in use: give another --port, or 0"),
        (
            bad,
            "psframe serve: error: tests.support.evaluator_jobs:linear_data must return a torch.nn.Module, or",
        ),
    ):
        assert proc.popen.wait(timeout=60) == 1, proc.output
        assert proc.output.strip().splitlines()[-1].startswith(message), proc.output

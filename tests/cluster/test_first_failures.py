"""The failures a newcomer meets first, on each entry point: one line saying what to do, and an exit code.

No ps task ever comes up, a port in use, a malformed ``--ps_hosts``, a task
index out of range, two tasks given different clusters, Ctrl-C: each ends the
process with exactly one line on stderr besides its log records, no traceback,
and the exit code ``docs/guides/failures.md`` lists (1, or 130 after Ctrl-C).
The entry points: ``psframe server`` (and ``ping``, ``status``, ``shutdown``
where the failure applies) and a training script run by hand or under
``psframe launch`` (``examples/mlp_mnist_dist.py``, ``examples/ctr_dist.py``,
through :func:`psframe.flags.run`).

In-process calls (``cli.main``, the examples' ``main`` through ``flags.run``)
are unit or service tier; child processes are cluster tier, on free loopback
ports, every wait bounded, and every process started here killed by PID (a
launch by the session it leads) at the end.

This file holds the cluster tier's tests of the subject; `tests/unit/test_first_failures.py`,
`tests/service/test_first_failures.py` hold the other tiers'.
"""

from __future__ import annotations

import re

import pytest

import psframe
from psframe.launch import pick_free_ports
from tests.conftest import psframe_command
from tests.unit.test_first_failures import (  # noqa: F401
    CTR,
    INTERRUPTED,
    LOG_RECORD,
    MNIST,
    SAME_CLUSTER,
    Child,
    busy_port,
    children,
    ctr_or_mnist_flags,
    hosts,
    script,
    the_line,
    tiny_mnist,
)


@pytest.mark.cluster
@pytest.mark.parametrize("path", [MNIST, CTR], ids=["mlp_mnist_dist", "ctr_dist"])
def test_no_ps_is_one_line_from_a_worker(children, tiny_mnist, path):
    ps, worker = pick_free_ports(2)  # nothing listens on the ps port
    argv = script(path, *hosts(ps, worker), "--job_name=worker", "--task_index=0", "--connect_timeout=1")
    child = children("worker0", argv + ctr_or_mnist_flags(path, tiny_mnist))
    assert child.finish() == 1
    assert re.fullmatch(
        rf"{path.name}: error: /job:worker/task:0 waited \d+\.\ds for /job:ps/task:0 at 127\.0\.0\.1:{ps} to come up; "
        rf"is it started, and is the address right\? \(raise connect_timeout to wait longer\)",
        the_line(child.err),
    ), child.err


@pytest.mark.cluster
def test_a_port_in_use_is_one_line_from_a_ps_task(children, busy_port):
    (worker,) = pick_free_ports(1)
    child = children("ps0", script(MNIST, *hosts(busy_port, worker), "--job_name=ps", "--task_index=0"))
    assert child.finish() == 1
    assert the_line(child.err) == (
        f"mlp_mnist_dist.py: error: /job:ps/task:0 cannot listen on 127.0.0.1:{busy_port}: port {busy_port} is in "
        f"use by another process (an earlier run still going?); stop it (`ss -ltnp 'sport = :{busy_port}'` names "
        f"it) or give this task a free port"
    )


@pytest.mark.cluster
def test_a_malformed_ps_hosts_and_an_index_out_of_range_are_one_line_from_the_script_itself(children):
    bad = children(
        "bad_hosts", script(MNIST, "--ps_hosts=h0:22x2", "--worker_hosts=h1:2224", "--job_name=ps", "--task_index=0")
    )
    out_of_range = children("out_of_range", script(CTR, *hosts(2222, 2224), "--job_name=ps", "--task_index=3"))
    assert bad.finish() == 1 and out_of_range.finish() == 1
    assert the_line(bad.err) == (
        "mlp_mnist_dist.py: error: --ps_hosts='h0:22x2': task address 'h0:22x2' has port '22x2'; "
        "expected an integer in 0..65535"
    )
    assert the_line(out_of_range.err) == (
        "ctr_dist.py: error: task_index 3 is out of range for job 'ps' with 1 task (expected 0..0): "
        "give --task_index from 0 to 0, or add this task's address to --ps_hosts"
    )


@pytest.mark.cluster
def test_a_worker_given_another_cluster_than_the_ps_is_one_line(children, tiny_mnist):
    ps, worker, other = pick_free_ports(3)
    ps_cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})
    server = psframe.Server(ps_cluster, "ps", 0, serving_processes=1)
    try:
        workers = f"127.0.0.1:{worker},127.0.0.1:{other}"
        argv = script(MNIST, *hosts(ps, workers), "--job_name=worker", "--task_index=0", f"--data_dir={tiny_mnist}")
        child = children("worker0", [*argv, "--connect_timeout=30"])
        assert child.finish() == 1
    finally:
        server.stop(grace=0.1)
    assert the_line(child.err) == (
        f"mlp_mnist_dist.py: error: 127.0.0.1:{ps} should be /job:ps/task:0 of cluster "
        f"'ps|127.0.0.1:{ps},worker|{workers.replace(',', ';')}', but it is /job:ps/task:0 of cluster "
        f"'{ps_cluster}'; {SAME_CLUSTER} (the same ps tasks, but /job:ps/task:0 has no slots for joining "
        f"workers: for workers to join a running job, start the ps tasks with max_workers / --max_workers)"
    )


@pytest.mark.cluster
@pytest.mark.parametrize(
    "task",
    ["psframe_server", "mlp_mnist_dist_ps", "mlp_mnist_dist_worker_waiting", "ctr_dist_worker_waiting"],
)
def test_ctrl_c_is_one_line_and_130(children, tiny_mnist, task):
    ps, worker = pick_free_ports(2)
    if task == "psframe_server":
        argv, ready, prog = (
            psframe_command("server", *hosts(ps, worker), "--job_name=ps", "--task_index=0"),
            "serving at",
            "psframe server",
        )
    elif task == "mlp_mnist_dist_ps":
        argv, ready, prog = (
            script(MNIST, *hosts(ps, worker), "--job_name=ps", "--task_index=0"),
            "serving at",
            MNIST.name,
        )
    else:  # a worker waiting for a ps task that is not there yet
        path = MNIST if task.startswith("mlp") else CTR
        argv = script(
            path, *hosts(ps, worker), "--job_name=worker", "--task_index=0", *ctr_or_mnist_flags(path, tiny_mnist)
        )
        ready, prog = "waiting for /job:ps/task:0", path.name
    child = children(task, argv)
    child.wait_for(lambda output: ready in output, f"print {ready!r}")
    child.interrupt()
    assert child.finish() == 130
    assert the_line(child.err) == f"{prog}: {INTERRUPTED}"


@pytest.mark.cluster
def test_ctrl_c_is_one_line_and_130_from_a_worker_while_it_trains(children, tiny_mnist):
    ps, worker = pick_free_ports(2)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        argv = script(MNIST, *hosts(ps, worker), "--job_name=worker", "--task_index=0", f"--data_dir={tiny_mnist}")
        child = children("worker0", [*argv, "--batch_size=4", "--log_every=5", "--train_steps=10000000"])
        child.wait_for(lambda output: "local step 5," in output, "train 5 steps")
        child.interrupt()
        assert child.finish() == 130
    finally:
        server.stop(grace=0.1)
    assert the_line(child.err) == f"mlp_mnist_dist.py: {INTERRUPTED}"


@pytest.mark.cluster
def test_ctrl_c_under_psframe_launch_is_one_line_from_every_task_and_130(children, tiny_mnist):
    argv = psframe_command("launch", "--num_ps=1", "--num_workers=2", "--timeout=300", str(MNIST), "--")
    argv += [f"--data_dir={tiny_mnist}", "--batch_size=4", "--log_every=5", "--train_steps=10000000"]
    launch = children("launch", argv, new_session=True)  # a terminal's Ctrl-C reaches every task
    launch.wait_for(
        lambda output: all(f"[worker{i}] " in output and f"worker {i}: local step 5," in output for i in (0, 1)),
        "train",
    )
    launch.interrupt()
    assert launch.finish() == 130
    lines = [line for line in launch.out.splitlines() if not LOG_RECORD.match(line.partition("] ")[2])]
    assert "Traceback" not in launch.out + launch.err
    for task in ("ps0", "worker0", "worker1"):
        assert [line for line in lines if line.startswith(f"[{task}] ")] == [
            f"[{task}] mlp_mnist_dist.py: {INTERRUPTED}"
        ], launch.out
    assert lines[-1] == "[launch] done: ps0=130 worker0=130 worker1=130", launch.out

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

This file holds the service tier's tests of the subject; `tests/unit/test_first_failures.py`,
`tests/cluster/test_first_failures.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest

import psframe
from psframe.launch import pick_free_ports
from tests.unit.test_first_failures import busy_port, hosts, run_cli, the_line  # noqa: F401


@pytest.mark.service
def test_a_port_in_use_is_one_line_from_psframe_server(capsys, busy_port):
    (worker,) = pick_free_ports(1)
    code, err = run_cli(capsys, "server", *hosts(busy_port, worker), "--job_name=ps", "--task_index=0")
    assert code == 1
    assert the_line(err) == (
        f"psframe server: error: /job:ps/task:0 cannot listen on 127.0.0.1:{busy_port}: port {busy_port} is in use "
        f"by another process (an earlier run still going?); stop it (`ss -ltnp 'sport = :{busy_port}'` names it) "
        f"or give this task a free port"
    )


@pytest.mark.service
def test_no_ps_is_one_line_from_psframe_ping_and_shutdown(capsys):
    ps, worker = pick_free_ports(2)  # nothing listens on either
    code, err = run_cli(capsys, "ping", f"grpc://127.0.0.1:{ps}", "--timeout=0.5")
    assert code == 1
    assert the_line(err) == (
        f"psframe ping: error: no psframe task answered at 127.0.0.1:{ps} within 0.5s; "
        f"is it started, and is the address right?"
    )
    code, err = run_cli(capsys, "shutdown", *hosts(ps, worker), "--timeout=5")
    assert code == 1
    line = the_line(err)
    assert line.startswith(f"psframe shutdown: error: /job:ps/task:0 at 127.0.0.1:{ps} is unavailable: "), line
    assert line.endswith("; is it running, and is the cluster the one it was started with?"), line


@pytest.mark.service
def test_a_different_cluster_is_one_line_from_psframe_shutdown(capsys):
    ps, worker, other = pick_free_ports(3)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{ps}"], "worker": [f"127.0.0.1:{worker}"]})
    server = psframe.Server(cluster, "ps", 0, serving_processes=1)
    try:
        code, err = run_cli(capsys, "shutdown", *hosts(ps, f"127.0.0.1:{worker},127.0.0.1:{other}"), "--timeout=10")
        assert code == 1
        line = the_line(err)
        assert line.startswith(
            f"psframe shutdown: error: /job:ps/task:0 takes this call only from a worker or tool of cluster '{cluster}'"
        ), line
        assert line.endswith(": give it the cluster the tasks were started with"), line
        assert not server.service.check_training_over()  # refused: the ps task still serves
    finally:
        server.stop(grace=0.1)

"""A server on port 0 reports its port; a cluster's ps tasks serving in this process.

In-process gRPC on ports the OS picked: ``psframe.Server`` given port 0,
``psframe.local_cluster`` (a Trainer against it matches local torch exactly,
and its servers are stopped on leaving ``with`` and at interpreter exit), and
the ``security=`` argument of ``Server`` and ``Trainer``.

This file holds the cluster tier's tests of the subject; `tests/unit/test_local_cluster.py`,
`tests/service/test_local_cluster.py` hold the other tiers'.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import psframe
from tests.conftest import ROOT
from tests.service.test_local_cluster import refuses_connections


@pytest.mark.cluster
def test_a_local_clusters_servers_stop_at_interpreter_exit():
    code = (
        "import atexit, psframe\n"
        "servers = []\n"
        # Registered first, so it runs last: after the cluster's own handler.
        "atexit.register(lambda: print('stopped:', all(s.join(timeout=0.0) for s in servers), flush=True))\n"
        "local = psframe.local_cluster(num_ps=2, num_workers=2)\n"
        "servers.extend(local.ps_servers)\n"
        "print(local.cluster.to_string(), flush=True)\n"  # and exit without stopping it
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    spec, stopped = done.stdout.strip().splitlines()
    assert stopped == "stopped: True"
    cluster = psframe.ClusterSpec.from_string(spec)
    assert not cluster.tasks_on_any_port("ps")
    assert all(refuses_connections(int(a.rpartition(":")[2])) for a in cluster.job_tasks("ps"))

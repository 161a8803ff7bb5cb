"""The operator commands, run in-process: ``psframe status``, ``shutdown`` and ``ping``.

Clusters are in-process ps servers on free loopback ports; every call has a
deadline (``--timeout``, connect/rpc timeouts) and every server is stopped.

This file holds the cluster tier's tests of the subject; `tests/service/test_cli_tools.py` holds the
other tiers'.
"""

from __future__ import annotations

import torch

from psframe.wire import psframe_pb2 as pb
from tests.conftest import free_cluster
from tests.service.test_cli_tools import run_cli


def test_psframe_server_takes_a_message_cap_and_refuses_one_out_of_range(processes, capsys):
    import subprocess
    import sys

    import grpc

    from psframe.wire import codec, transport

    cluster = free_cluster(1, 1)
    ps = processes.start(
        "ps0",
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "server",
            f"--cluster_spec={cluster.to_string()}",
            "--job_name=ps",
            "--task_index=0",
            "--max_message_bytes=1048576",
            "--timeout=120",
        ],
    )
    code, out = run_cli(capsys, "ping", cluster.task_address("ps", 0), "--timeout", "60")
    assert code == 0, out + ps.output
    caller = pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=cluster.fingerprint)
    with grpc.insecure_channel(cluster.task_address("ps", 0)) as channel:
        push = channel.unary_unary(transport.METHODS["Init"].path)
        for size, refused in ((1 << 20, True), (512 << 10, False)):
            data = codec.encode(pb.InitHeader(caller=caller), [("w", torch.zeros(size // 4 + 16))])
            try:
                push(data, timeout=30)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            # Over the cap: refused unread. Under it: read, and refused as an Init that defines nothing.
            assert (code == grpc.StatusCode.RESOURCE_EXHAUSTED) == refused, (size, code)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "psframe.cli",
            "server",
            f"--cluster_spec={cluster.to_string()}",
            "--job_name=ps",
            "--task_index=0",
            "--max_message_bytes=1000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "max_message_bytes must be an int from 65536 (64 KiB) to 2**31 - 1" in result.stderr

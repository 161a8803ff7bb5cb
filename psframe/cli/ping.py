"""``psframe ping``: check that one task is up, and print who it is (its role, state and version)."""

from __future__ import annotations

import argparse

from psframe.cluster import ClusterSpec
from psframe.flags import add_security_flags, security_from_flags


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ping`` and its flags to ``commands``."""
    ping = commands.add_parser("ping", help="check that a task is up and print who it is")
    ping.add_argument("target", help="grpc://host:port or host:port")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    add_security_flags(ping)
    ping.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print one line on the task at ``args.target``; a task that does not answer raises."""
    from psframe.worker.client.reports import ping  # gRPC and protobuf: no torch

    info = ping(args.target, timeout=args.timeout, security=security_from_flags(args))
    state = info.state.value
    line = f"{info.address} is {ClusterSpec.caller_name(info.job_name, info.task_index)} ({state}"
    if info.job_name == "ps":
        line += f", global step {info.global_step}, {len(info.variables)} variables, {info.bytes_held} bytes"
    print(f"{line}), psframe {info.version}, pid {info.pid}, cluster {info.cluster_spec}")
    return 0

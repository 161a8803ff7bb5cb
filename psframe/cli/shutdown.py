"""``psframe shutdown``: save a checkpoint of a running cluster (where one is configured), then stop its ps tasks."""

from __future__ import annotations

import argparse

from psframe.cli.cluster_args import cluster_named
from psframe.cluster import ClusterSpec
from psframe.errors import RpcTimeoutError, TaskUnavailableError
from psframe.flags import add_cluster_flags, add_security_flags, security_from_flags


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``shutdown`` and its flags to ``commands``."""
    shutdown = commands.add_parser("shutdown", help="save a checkpoint (if configured) and stop the ps tasks")
    add_cluster_flags(shutdown)
    shutdown.add_argument(
        "--checkpoint_dir", default=None, help="save here (default: the ps tasks' own checkpoint_dir, if any)"
    )
    shutdown.add_argument("--no_save", action="store_true", help="stop without saving")
    shutdown.add_argument("--keep_checkpoints", type=int, default=5)
    shutdown.add_argument("--timeout", type=float, default=60.0, help="seconds each call may take")
    add_security_flags(shutdown)
    shutdown.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Save (unless ``--no_save``, and only when every ps task is ready), then ask each ps task to stop."""
    from psframe import checkpoint
    from psframe.status import TaskState
    from psframe.worker.client import control_calls
    from psframe.worker.client.ps_client import PsClient

    cluster = cluster_named(args)
    client = PsClient(cluster, 0, job_name="tool", rpc_timeout=args.timeout, security=security_from_flags(args))
    try:
        try:
            infos = [control_calls.get_info(client, k) for k in range(cluster.num_ps)]
        except (TaskUnavailableError, RpcTimeoutError) as e:
            raise type(e)(f"{e}; is it running, and is the cluster the one it was started with?") from e
        checkpoint_dir = args.checkpoint_dir or infos[0].checkpoint_dir
        if checkpoint_dir and not args.no_save and all(i.state is TaskState.READY for i in infos):
            manifest = checkpoint.save(client, checkpoint_dir, infos[0].global_step, args.keep_checkpoints)
            print(f"saved checkpoint of global step {manifest.step} in {manifest.folder}")
        for k in range(cluster.num_ps):
            control_calls.shutdown(client, k)
            print(f"{ClusterSpec.task_name('ps', k)} at {cluster.task_address('ps', k)} is shutting down")
    finally:
        client.close()
    return 0

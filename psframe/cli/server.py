"""``psframe server``: run one bare task (like TF's ``grpc_tensorflow_server``) until training is over.

A ps task serves the variables (and restores its shard from
``--checkpoint_dir`` on a restart); the command exits 0 when every worker
has finished, 1 when ``--timeout`` runs out first.
"""

from __future__ import annotations

import argparse
import logging

from psframe.flags import (
    add_cluster_flags,
    add_liveness_flags,
    add_security_flags,
    cluster_from_flags,
    liveness_from_flags,
    security_from_flags,
)
from psframe.version import __version__

log = logging.getLogger("psframe")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``server`` and its flags to ``commands``."""
    server = commands.add_parser("server", help="run one bare task (like TF's grpc_tensorflow_server)")
    add_cluster_flags(server)
    server.add_argument(
        "--bind_address", default=None, help="listen here instead of the task's cluster address, e.g. [::]:2222"
    )
    server.add_argument(
        "--checkpoint_dir", default=None, help="(ps) checkpoints live here; on a restart the ps restores its shard"
    )
    server.add_argument(
        "--worker_timeout",
        type=float,
        default=60.0,
        help="(ps) once some workers finished, stop waiting for workers (not the chief) silent this long",
    )
    server.add_argument(
        "--chief_timeout",
        type=float,
        default=None,
        help="(ps) the same for the chief, waited for longer (default: 10 x --worker_timeout)",
    )
    server.add_argument(
        "--serving_processes",
        type=int,
        default=None,
        help="(ps) processes listening on the task's port; this one holds the variables "
        "(default: one per 4 cores this task may use, at most 8)",
    )
    server.add_argument(
        "--max_workers",
        type=int,
        default=None,
        help="(ps) worker slots of an elastic cluster: workers started with a longer worker list join the "
        "running job up to this many, and workers may leave (default: the workers are fixed)",
    )
    server.add_argument(
        "--max_message_bytes",
        type=int,
        default=None,
        help="the largest request accepted; larger ones are answered RESOURCE_EXHAUSTED "
        "(default 256 MiB: raise it for workers whose max_shard_bytes comes near it)",
    )
    server.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="give up (exit 1) after this many seconds if the workers have not all finished",
    )
    add_security_flags(server)
    add_liveness_flags(server)
    server.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve the task the flags name until every worker finished (0) or ``--timeout`` ran out (1)."""
    from psframe.memory import malloc
    from psframe.ps.serving.server import Server

    malloc.tune_malloc()  # a process of its own: tune it before the server starts its gRPC threads

    cluster, job_name, task_index = cluster_from_flags(args)
    server = Server(
        cluster,
        job_name,
        task_index,
        bind_address=args.bind_address,
        worker_timeout=args.worker_timeout,
        chief_timeout=args.chief_timeout,
        checkpoint_dir=args.checkpoint_dir,
        liveness=liveness_from_flags(args),
        serving_processes=args.serving_processes,
        max_workers=args.max_workers,
        security=security_from_flags(args),
        **({} if args.max_message_bytes is None else {"max_message_bytes": args.max_message_bytes}),
    )
    print(f"psframe {__version__}: {server.task_name} serving at {server.address}", flush=True)
    finished = server.join(timeout=args.timeout)  # Ctrl-C: join stops the server; main says so, exit 130
    if not finished:
        log.error("%s: --timeout of %ss ran out before every worker finished", server.task_name, args.timeout)
        server.stop(grace=0.5)
        return 1
    return 0

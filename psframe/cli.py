"""The ``psframe`` command: ``server``, ``ping``, ``status``, ``shutdown`` and ``launch``.

    psframe server --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224' --job_name=ps --task_index=0
    psframe ping grpc://h0:2222
    psframe status --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe shutdown --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe launch --num_ps 2 --num_workers 2 examples/mlp_mnist_dist.py -- --train_steps 2000

Every command takes ``--auth_token_file`` and the ``--tls_*`` flags
(:func:`psframe.flags.add_security_flags`; see :mod:`psframe.security`).
An expected failure ends a command with one line, ``psframe COMMAND: error:
...``, and exit code 1; Ctrl-C with one line and 130, as a script's
:func:`psframe.flags.run` does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from psframe import allocator
from psframe.cluster import ClusterSpec
from psframe.errors import AuthenticationError, PsframeError, RpcTimeoutError, TaskUnavailableError
from psframe.flags import (
    add_cluster_flags,
    add_liveness_flags,
    add_security_flags,
    cluster_from_flags,
    liveness_from_flags,
    run,
    security_from_flags,
)
from psframe.version import __version__

if TYPE_CHECKING:
    from psframe.status import WorkerStatus

log = logging.getLogger("psframe")


def _server(args: argparse.Namespace) -> int:
    from psframe.ps.server import Server

    allocator.tune_malloc()  # a process of its own: tune it before the server starts its gRPC threads

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


def _ping(args: argparse.Namespace) -> int:
    from psframe.worker.ps_client import ping

    info = ping(args.target, timeout=args.timeout, security=security_from_flags(args))
    state = info.state.value
    line = f"{info.address} is {ClusterSpec.caller_name(info.job_name, info.task_index)} ({state}"
    if info.job_name == "ps":
        line += f", global step {info.global_step}, {len(info.variables)} variables, {info.bytes_held} bytes"
    print(f"{line}), psframe {info.version}, pid {info.pid}, cluster {info.cluster_spec}")
    return 0


def _cluster_only(args: argparse.Namespace):
    """The cluster named by the flags or TF_CONFIG (no task needed)."""
    from psframe.cluster.tf_config import cluster_from_tf_config

    if args.ps_hosts or args.worker_hosts:
        return ClusterSpec.from_hosts(args.ps_hosts or "", args.worker_hosts or "")
    if args.cluster_spec:
        return ClusterSpec.from_string(args.cluster_spec)
    return cluster_from_tf_config()[0]


def _status(args: argparse.Namespace) -> int:
    from psframe.worker.ps_client import PsClient

    cluster = _cluster_only(args)
    rows = [
        ("task", "address", "role", "state", "global_step", "variables", "bytes_held", "pushes", "dropped", "last_seen")
    ]
    seen: dict[int, WorkerStatus] = {}
    applied: dict[int, list[int]] = {}  # a worker's steps applied, by each ps task that answered
    tables: list[tuple[str, ...]] = [("dynamic table part", "task", "rows", "admitted", "filtered", "evicted")]
    client = PsClient(cluster, 0, job_name="tool", rpc_timeout=args.timeout, security=security_from_flags(args))
    try:
        for k, address in enumerate(cluster.job_tasks("ps")):
            try:
                info = client.get_info(k)
            except AuthenticationError:
                raise  # the task is up, and refuses us: not "down"
            except PsframeError:
                rows.append((ClusterSpec.task_name("ps", k), address, "ps", "down", "", "", "", "", "", ""))
                continue
            for t in info.dynamic_tables:
                counts = (t.rows, t.admitted, t.filtered, t.evicted)
                tables.append((t.name, ClusterSpec.task_name("ps", k), *(str(n) for n in counts)))
            for worker in info.workers:  # the freshest word from any ps task
                applied.setdefault(worker.task_index, []).append(worker.applied_steps)
                if worker.task_index not in seen or _fresher(worker, seen[worker.task_index]):
                    seen[worker.task_index] = worker
            rows.append(
                (
                    ClusterSpec.task_name("ps", k),
                    address,
                    "ps",
                    info.state.value,
                    str(info.global_step),
                    str(len(info.variables)),
                    _bytes(info.bytes_held),
                    str(info.pushes),
                    str(info.dropped_gradients),
                    "-",
                )
            )
    finally:
        client.close()
    for w, address in enumerate(cluster.job_tasks("worker")):
        heard = seen.get(w)
        if heard is None:
            state, last = "unknown", ""
        elif heard.seconds_ago is None:
            state, last = ("finished" if heard.finished else "not seen"), "never"
        elif heard.finished:
            state, last = "finished", f"{heard.seconds_ago:.1f}s ago"
        else:
            state = "training" if heard.seconds_ago < 10 else "silent"
            last = f"{heard.seconds_ago:.1f}s ago"
        # A worker's pushes: its steps applied on every ps task (each once, however often sent).
        pushes = str(min(applied[w])) if applied.get(w) else ""
        rows.append(
            (
                ClusterSpec.task_name("worker", w),
                address,
                "chief" if w == 0 else "worker",
                state,
                "",
                "",
                "",
                pushes,
                "",
                last,
            )
        )
    _print_table(rows)
    if len(tables) > 1:
        print()
        _print_table(tables)
    return 0 if all(row[3] != "down" for row in rows[1:]) else 1


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _fresher(worker: WorkerStatus, than: WorkerStatus) -> bool:
    """Whether ``worker`` was heard from more recently than ``than``."""
    return worker.seconds_ago is not None and (than.seconds_ago is None or worker.seconds_ago < than.seconds_ago)


def _shutdown(args: argparse.Namespace) -> int:
    from psframe import checkpoint
    from psframe.status import TaskState
    from psframe.worker.ps_client import PsClient

    cluster = _cluster_only(args)
    client = PsClient(cluster, 0, job_name="tool", rpc_timeout=args.timeout, security=security_from_flags(args))
    try:
        try:
            infos = [client.get_info(k) for k in range(cluster.num_ps)]
        except (TaskUnavailableError, RpcTimeoutError) as e:
            raise type(e)(f"{e}; is it running, and is the cluster the one it was started with?") from e
        checkpoint_dir = args.checkpoint_dir or infos[0].checkpoint_dir
        if checkpoint_dir and not args.no_save and all(i.state is TaskState.READY for i in infos):
            manifest = checkpoint.save(client, checkpoint_dir, infos[0].global_step, args.keep_checkpoints)
            print(f"saved checkpoint of global step {manifest.step} in {manifest.folder}")
        for k in range(cluster.num_ps):
            client.shutdown(k)
            print(f"{ClusterSpec.task_name('ps', k)} at {cluster.task_address('ps', k)} is shutting down")
    finally:
        client.close()
    return 0


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _launch(args: argparse.Namespace) -> int:
    from psframe.launch import launch

    script_args = args.script_args
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    return launch(
        args.script,
        args.num_ps,
        args.num_workers,
        script_args,
        timeout=args.timeout,
        security=security_from_flags(args),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="psframe", description="Parameter-server training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"psframe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)

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
    server.set_defaults(run=_server)

    ping = commands.add_parser("ping", help="check that a task is up and print who it is")
    ping.add_argument("target", help="grpc://host:port or host:port")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    add_security_flags(ping)
    ping.set_defaults(run=_ping)

    status = commands.add_parser("status", help="print a table of the cluster's tasks")
    add_cluster_flags(status)
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each task")
    add_security_flags(status)
    status.set_defaults(run=_status)

    shutdown = commands.add_parser("shutdown", help="save a checkpoint (if configured) and stop the ps tasks")
    add_cluster_flags(shutdown)
    shutdown.add_argument(
        "--checkpoint_dir", default=None, help="save here (default: the ps tasks' own checkpoint_dir, if any)"
    )
    shutdown.add_argument("--no_save", action="store_true", help="stop without saving")
    shutdown.add_argument("--keep_checkpoints", type=int, default=5)
    shutdown.add_argument("--timeout", type=float, default=60.0, help="seconds each call may take")
    add_security_flags(shutdown)
    shutdown.set_defaults(run=_shutdown)

    launch = commands.add_parser("launch", help="run a whole cluster of SCRIPT on this machine")
    launch.add_argument("--num_ps", type=int, default=1)
    launch.add_argument("--num_workers", type=int, default=2)
    launch.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    add_security_flags(launch, no_token="a fresh random token for this cluster, given to every task")
    launch.add_argument(
        "script", help="the training script; it gets --ps_hosts, --worker_hosts, --job_name and --task_index"
    )
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    launch.set_defaults(run=_launch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``psframe`` command; returns its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # An expected failure is one line and exit code 1, Ctrl-C one line and 130 (as a script's, through
    # flags.run); ValueError: a setting out of range (Server checks them).
    return run(lambda: args.run(args), expected=(ValueError,), prog=f"psframe {args.command}")


if __name__ == "__main__":
    sys.exit(main())

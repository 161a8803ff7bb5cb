"""The ``psframe`` command: server, ping, status, shutdown, reshard, launch, evaluate and export.

    psframe server --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224' --job_name=ps --task_index=0
    psframe ping grpc://h0:2222
    psframe status --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe shutdown --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe reshard --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224' --new_ps_hosts=h0:2222,h0:2223,h2:2222
    psframe launch --num_ps 2 --num_workers 2 examples/mlp_mnist_dist.py -- --train_steps 2000
    psframe evaluate --checkpoint_dir=ckpt/ examples/ctr_dist.py:evaluation
    psframe export ckpt/ snapshot/

Every command takes ``--auth_token_file`` and the ``--tls_*`` flags
(:func:`psframe.flags.add_security_flags`; see :mod:`psframe.config.security`).
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

from psframe.cluster import ClusterSpec
from psframe.errors import (
    AuthenticationError,
    ClusterSpecError,
    ConnectTimeoutError,
    PsframeError,
    RpcTimeoutError,
    TaskUnavailableError,
)
from psframe.flags import (
    add_cluster_flags,
    add_liveness_flags,
    add_security_flags,
    cluster_from_flags,
    liveness_from_flags,
    run,
    security_from_flags,
)
from psframe.memory import malloc
from psframe.version import __version__

if TYPE_CHECKING:
    from psframe.export import SnapshotUpdate
    from psframe.status import WorkerStatus

log = logging.getLogger("psframe")


def _server(args: argparse.Namespace) -> int:
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


def _ping(args: argparse.Namespace) -> int:
    from psframe.worker.client.ps_client import ping

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
    from psframe.worker.client.ps_client import PsClient

    cluster = _cluster_only(args)
    rows = [
        ("task", "address", "role", "state", "global_step", "variables", "bytes_held", "pushes", "dropped", "last_seen")
    ]
    seen: dict[int, WorkerStatus] = {}
    applied: dict[int, list[int]] = {}  # a worker's steps applied, by each ps task that answered
    tables: list[tuple[str, ...]] = [("dynamic table part", "task", "rows", "admitted", "filtered", "evicted")]
    # Async: step-ending pushes by how many steps ahead of the slowest live worker they found theirs.
    ahead: list[tuple[str, ...]] = [("task", "steps ahead: pushes", "most")]
    # Elastic clusters: the workers that joined and left, as ps 0 (or the first ps task up) saw them.
    changes: list[tuple[str, ...]] = [("worker", "membership change", "at step", "when")]
    # Data sets read in ranges (psframe.DataRanges), as ps 0 keeps their queues.
    data: list[tuple[str, ...]] = [("data set", "consumed", "of", "ranges out")]
    layout = ""  # ps 0's word on re-layouts (psframe reshard), if any
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
            if k == 0 and (info.layout_version or info.reshard_to):
                layout = _layout_line(info.relayouts, info.move_stage, info.reshard_to, cluster)
            data.extend((d.name, str(d.consumed), str(d.total), str(d.ranges_out)) for d in info.data_sets)
            if len(changes) == 1:
                changes.extend(
                    (ClusterSpec.task_name("worker", c.worker), c.kind, str(c.global_step), f"{c.seconds_ago:.1f}s ago")
                    for c in info.membership
                )
            if info.steps_ahead_counts:
                ahead.append((ClusterSpec.task_name("ps", k), *_steps_ahead(info.steps_ahead_counts)))
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
    addresses = dict(enumerate(cluster.job_tasks("worker")))
    for w in sorted(set(addresses) | set(seen)):  # and workers that joined beyond the cluster given
        address = addresses.get(w, "(joined)")
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
    for extra in (tables, ahead, changes, data):
        if len(extra) > 1:
            print()
            _print_table(extra)
    if layout:
        print()
        print(layout)
    return 0 if all(row[3] != "down" for row in rows[1:]) else 1


def _layout_line(relayouts: int, stage: tuple[int, int] | None, reshard_to: str, cluster: ClusterSpec) -> str:
    """What ps 0 says of re-layouts: how many it went through, the stage of one under way, and the
    ps tasks it moved (or moves) to."""
    moved_to = ClusterSpec.from_string(reshard_to).job_tasks("ps") if reshard_to else []
    line = f"re-layouts: {relayouts}"
    if stage is not None:
        line += f" (one under way: stage {stage[0]} of {stage[1]} taken)"
    if moved_to and moved_to != cluster.job_tasks("ps"):
        line += f"; the ps tasks are (or move to) {','.join(moved_to)}: give --ps_hosts that list"
    elif moved_to:
        line += f"; ps tasks {','.join(moved_to)}"
    return line


def _steps_ahead(counts: Sequence[int]) -> tuple[str, str]:
    """A ps task's steps-ahead histogram as ``"0: 120, 1: 30, 15+: 2"`` and the most steps ahead seen."""
    last = len(counts) - 1
    shown = [f"{n}{'+' if n == last else ''}: {c}" for n, c in enumerate(counts) if c]
    most = max(n for n, c in enumerate(counts) if c)
    return ", ".join(shown), f"{most}{'+' if most == last else ''}"


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
    from psframe.worker.client.ps_client import PsClient

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


def _reshard(args: argparse.Namespace) -> int:
    """Ask ps 0 for a live re-layout onto ``--new_ps_hosts``; wait until the new layout holds the model."""
    import time

    from psframe.worker.client.ps_client import PsClient

    cluster = _cluster_only(args)
    new = ClusterSpec({"ps": _host_list(args.new_ps_hosts), "worker": cluster.job_tasks("worker")})
    security = security_from_flags(args)
    start = time.monotonic()
    with PsClient(cluster, 0, job_name="tool", rpc_timeout=min(args.timeout, 60.0), security=security) as client:
        client.ask_reshard(new)
        print(f"asked {ClusterSpec.task_name('ps', 0)} to move the model onto ps tasks {new.job_tasks('ps')}")
        if args.no_wait:
            return 0
        deadline = start + args.timeout
        while (status := client.layout_status()).cluster != new or not status.moved or status.moving:
            if time.monotonic() >= deadline:
                stage = f" (at stage {status.stage.stage} of {status.stage.stages})" if status.stage else ""
                raise ConnectTimeoutError(
                    f"the chief did not take the re-layout within {args.timeout:.0f}s{stage} (is it training? it "
                    f"takes one stage between two steps); it stays asked for: "
                    f"{status.cluster and status.cluster.job_tasks('ps')}"
                )
            time.sleep(0.1)
    with PsClient(new, 0, job_name="tool", rpc_timeout=min(args.timeout, 60.0), security=security) as client:
        client.wait_for_ps(max(1.0, deadline - time.monotonic()), ready=True)
    print(
        f"the ps tasks {new.job_tasks('ps')} hold the model: re-laid out {time.monotonic() - start:.2f}s after asking"
    )
    return 0


def _host_list(hosts: str) -> list[str]:
    listed = [h.strip() for h in hosts.split(",") if h.strip()]
    if not listed:
        raise ClusterSpecError("--new_ps_hosts must list at least one ps task (host:port, comma-separated)")
    return listed


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


def _evaluate(args: argparse.Namespace) -> int:
    import json

    from psframe.errors import CheckpointError
    from psframe.worker.evaluator import Evaluator

    factory_args = args.factory_args[1:] if args.factory_args[:1] == ["--"] else args.factory_args
    model, evaluate_fn = _made_by_factory(args.factory, factory_args)
    evaluator = Evaluator(
        model,
        evaluate_fn,
        args.checkpoint_dir,
        log_dir=args.log_dir,
        poll_seconds=args.poll_seconds,
        timeout=args.timeout,
        max_step=args.max_step,
        latest_only=args.latest_only,
    )
    for step, metrics in evaluator.results():
        print(json.dumps({"global_step": step, **metrics}), flush=True)
    if not evaluator.history:
        skipped = f" ({len(evaluator.skipped)} skipped as pruned or damaged)" if evaluator.skipped else ""
        raise CheckpointError(
            f"evaluated no checkpoint: none came in {args.checkpoint_dir} within --timeout={args.timeout:g}s{skipped}"
        )
    return 0


def _made_by_factory(spec: str, argv: list[str]):
    """The ``(model, evaluate_fn)`` that the factory ``FILE.py:NAME`` or ``MODULE:NAME`` returns.

    The factory is called with no arguments, or with the list ``argv`` when there is one.
    """
    import importlib
    import importlib.util
    import os

    import torch

    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"the factory must be path/to/file.py:function or package.module:function, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"the factory's file {where!r} is not a file (looked in {os.getcwd()!r})")
        sys.path.insert(0, os.path.dirname(path))  # its own imports resolve as under `python FILE`
        loader_spec = importlib.util.spec_from_file_location(f"psframe_factory_{os.getpid()}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"the factory's file {where!r} cannot be loaded as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[loader_spec.name] = module  # dataclasses and pickling look their module up here
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
                raise  # the module exists; something it imports does not: its bug, with a traceback
            raise ValueError(f"the factory's module {where!r} cannot be found on sys.path") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{where} has no function {name!r}")
    made = factory(argv) if argv else factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1])):
        raise ValueError(f"{spec} must return (model, evaluate_fn): a torch.nn.Module and a function of it")
    return made


def _export(args: argparse.Namespace) -> int:
    from psframe import export
    from psframe.errors import SnapshotError

    if args.apply:
        others = [
            f"--{n}"
            for n in ("step", "min_row_norm", "max_row_age_seconds", "update_from")
            if getattr(args, n) is not None
        ] + ["--delta"] * args.delta
        if others:
            raise ValueError(f"--apply takes no {', '.join(others)}: those are for exporting a checkpoint")
        if args.out is None or len(args.paths) < 2:
            raise ValueError(
                f"--apply takes SNAPSHOT UPDATE... (in order) and --out NEW; got {len(args.paths)} path(s) and "
                f"{'no --out' if args.out is None else '--out'}"
            )
        snapshot = export.read_snapshot(args.paths[0])
        for path in args.paths[1:]:
            update = export.read_update(path)  # its errors name the file
            try:
                snapshot = export.apply_update(snapshot, update)
            except SnapshotError as e:
                raise SnapshotError(f"{path}: {e}") from e
        export.write_snapshot(snapshot, args.out)
        print(f"wrote the snapshot of step {snapshot.step} to {args.out} ({len(args.paths) - 1} updates applied)")
        return 0
    if len(args.paths) != 2 or args.out is not None:
        raise ValueError(
            f"give CHECKPOINT_DIR OUT (got {len(args.paths)} paths{', and --out' if args.out else ''}); "
            "--out is for --apply"
        )
    checkpoint_dir, out = args.paths
    thresholds = {"min_row_norm": args.min_row_norm, "max_row_age_seconds": args.max_row_age_seconds}
    if args.delta and args.update_from is not None:
        raise ValueError("give --delta or --update_from, not both: each writes an update")
    if args.delta:
        return _wrote_update(export.export_delta(checkpoint_dir, args.step, **thresholds), out)
    snapshot = export.export_checkpoint(checkpoint_dir, args.step, **thresholds)
    rows = sum(len(table) for table in snapshot.tables.values())
    if args.update_from is None:
        export.write_snapshot(snapshot, out)
        print(
            f"wrote the snapshot of step {snapshot.step} to {out} ({len(snapshot.dense)} dense variables, "
            f"{rows} rows in {len(snapshot.tables)} dynamic tables)"
        )
        return 0
    return _wrote_update(export.diff_snapshots(export.read_snapshot(args.update_from), snapshot), out)


def _wrote_update(update: SnapshotUpdate, out: str) -> int:
    from psframe import export

    export.write_update(update, out)
    upserts = sum(len(change.upsert) for change in update.tables.values())
    deletes = sum(change.delete.numel() for change in update.tables.values())
    print(
        f"wrote the update from step {update.base_step} to step {update.step} to {out} ({len(update.dense)} dense "
        f"variables, {upserts} rows made or changed, {deletes} deleted)"
    )
    return 0


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

    reshard = commands.add_parser(
        "reshard", help="move the model onto other ps tasks while training goes on (ps tasks added or drained)"
    )
    add_cluster_flags(reshard)
    reshard.add_argument(
        "--new_ps_hosts",
        required=True,
        help="the ps tasks to move onto, comma-separated: the running ones with new ones at the end (start "
        "those first, with this list), or the running ones less the last (they stop once drained)",
    )
    reshard.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up (exit 1) if the new layout does not hold the model by then",
    )
    reshard.add_argument("--no_wait", action="store_true", help="ask, and exit at once")
    add_security_flags(reshard)
    reshard.set_defaults(run=_reshard)

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

    evaluate = commands.add_parser(
        "evaluate", help="evaluate each checkpoint of a training run as it is committed (TF's evaluator)"
    )
    evaluate.add_argument("--checkpoint_dir", required=True, help="the folder or fsspec URL the chief saves to")
    evaluate.add_argument(
        "--log_dir", default=None, help="write each metric to TensorBoard here (needs the tensorboard package)"
    )
    evaluate.add_argument(
        "--timeout", type=float, default=600.0, help="stop after this many seconds without a new checkpoint"
    )
    evaluate.add_argument(
        "--poll_seconds", type=float, default=1.0, help="list the checkpoint folder this often while waiting"
    )
    evaluate.add_argument(
        "--max_step", type=int, default=None, help="stop after a checkpoint at or past this global step"
    )
    evaluate.add_argument(
        "--latest_only",
        action="store_true",
        help="evaluate the newest checkpoint each time, skipping those committed meanwhile (TF's evaluator)",
    )
    evaluate.add_argument(
        "factory",
        help="FILE.py:NAME or MODULE:NAME, a function returning (model, evaluate_fn), where "
        "evaluate_fn(model) returns a dict of metric names to numbers",
    )
    evaluate.add_argument(
        "factory_args", nargs=argparse.REMAINDER, help="-- then arguments for the factory, passed as one list"
    )
    evaluate.set_defaults(run=_evaluate)
    export = commands.add_parser(
        "export",
        help="write a serving snapshot of a checkpoint, or an update between snapshots, as safetensors",
        usage="%(prog)s [--step N] [--min_row_norm X] [--max_row_age_seconds S] [--update_from OLD | --delta] "
        "CHECKPOINT_DIR OUT\n       %(prog)s --apply SNAPSHOT UPDATE... --out NEW",
        description="The snapshot of a checkpoint holds its parameters and its dynamic tables' rows, never "
        "optimizer state (see psframe.export). With --update_from, OUT is instead the update that takes the "
        "older snapshot OLD to this one; with --apply, the updates are applied to SNAPSHOT in order and the "
        "result written to NEW.",
    )
    export.add_argument(
        "paths", nargs="+", metavar="PATH", help="CHECKPOINT_DIR OUT, or with --apply: SNAPSHOT UPDATE..."
    )
    export.add_argument(
        "--step", type=int, default=None, help="the checkpoint of this step (default: the latest valid one)"
    )
    export.add_argument(
        "--min_row_norm", type=float, default=None, help="leave out table rows whose L2 norm is below this"
    )
    export.add_argument(
        "--max_row_age_seconds",
        type=float,
        default=None,
        help="leave out table rows not looked up or updated for more than this many seconds",
    )
    export.add_argument(
        "--update_from",
        default=None,
        metavar="OLD",
        help="write the update from the snapshot OLD (an earlier export) to this checkpoint's, not a snapshot",
    )
    export.add_argument(
        "--delta",
        action="store_true",
        help="write the update the delta checkpoint of --step (default: the last delta) makes: the rows it "
        "changed, the ids it evicted",
    )
    export.add_argument("--apply", action="store_true", help="apply updates to a snapshot instead")
    export.add_argument("--out", default=None, metavar="NEW", help="with --apply: where the new snapshot goes")
    export.set_defaults(run=_export)
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

"""``psframe status``: print tables of a running cluster's tasks, as its ps tasks see them.

One row per ps task (from its own report) and per worker (the freshest word
any ps task has of it); then, where there is something to show, the dynamic
tables' parts, async workers' steps ahead, elastic membership changes, data
sets read in ranges, and ps 0's word on re-layouts. Exit code 1 when a ps
task is down.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from psframe.cli.cluster_args import cluster_named
from psframe.cluster import ClusterSpec
from psframe.errors import AuthenticationError, PsframeError
from psframe.flags import add_cluster_flags, add_security_flags, security_from_flags

if TYPE_CHECKING:
    from psframe.status import WorkerStatus


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` and its flags to ``commands``."""
    status = commands.add_parser("status", help="print a table of the cluster's tasks")
    add_cluster_flags(status)
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each task")
    add_security_flags(status)
    status.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Ask each ps task for its report and print the tables; 0 when every ps task answered, else 1."""
    from psframe.worker.client.reports import ReportClient  # gRPC and protobuf: no torch

    cluster = cluster_named(args)
    rows = [
        (
            "task",
            "address",
            "role",
            "state",
            "global_step",
            "variables",
            "bytes_held",
            "applied_steps",
            "dropped",
            "last_seen",
        )
    ]
    seen: dict[int, WorkerStatus] = {}
    applied: dict[int, list[int]] = {}  # a worker's steps applied, by each ps task that answered
    tables: list[tuple[str, ...]] = [
        ("dynamic table part", "task", "rows", "on disk", "admitted", "filtered", "evicted")
    ]
    # Async: step-ending pushes by how many steps ahead of the slowest live worker they found theirs.
    ahead: list[tuple[str, ...]] = [("task", "steps ahead: pushes", "most")]
    # Elastic clusters: the workers that joined and left, as ps 0 (or the first ps task up) saw them.
    changes: list[tuple[str, ...]] = [("worker", "membership change", "at step", "when")]
    # Data sets read in ranges (psframe.DataRanges), as ps 0 keeps their queues.
    data: list[tuple[str, ...]] = [("data set", "consumed", "of", "ranges out")]
    # Streams read by partition: how far each ps task's updates of each partition reached, and who reads it.
    streams: list[tuple[str, ...]] = [("stream", "ps task", "offsets reached", "readers")]
    layout = ""  # ps 0's word on re-layouts (psframe reshard), if any
    client = ReportClient(cluster, rpc_timeout=args.timeout, security=security_from_flags(args))
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
            streams.extend(
                (s.name, ClusterSpec.task_name("ps", k), _numbers(s.applied), _numbers(s.readers) or "-")
                for s in info.streams
            )
            if len(changes) == 1:
                changes.extend(
                    (ClusterSpec.task_name("worker", c.worker), c.kind, str(c.global_step), f"{c.seconds_ago:.1f}s ago")
                    for c in info.membership
                )
            if info.steps_ahead_counts:
                ahead.append((ClusterSpec.task_name("ps", k), *_steps_ahead(info.steps_ahead_counts)))
            for t in info.dynamic_tables:
                counts = (t.rows, t.rows_on_disk, t.admitted, t.filtered, t.evicted)
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
                    str(info.applied_steps),  # its workers' steps applied (async: its global step)
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
        # A worker's steps applied on every ps task (each once, however often sent).
        steps = str(min(applied[w])) if applied.get(w) else ""
        rows.append(
            (
                ClusterSpec.task_name("worker", w),
                address,
                "chief" if w == 0 else "worker",
                state,
                "",
                "",
                "",
                steps,
                "",
                last,
            )
        )
    _print_table(rows)
    for extra in (tables, ahead, changes, data, streams):
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


def _numbers(values: tuple[int, ...]) -> str:
    """A partition's numbers in order: ``12 40 -1``."""
    return " ".join(str(v) for v in values)


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)

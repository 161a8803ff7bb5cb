"""psframe push+pull round trips through real ps processes.

The same payloads as the raw ceiling (:mod:`benchmarks.baselines.raw_grpc`),
sent the way a worker sends them: the trainer's plan of requests (its
``StepPlan``) through ``PsClient.push_pull`` (both reached through
:mod:`benchmarks.suite.psframe_internals`), which encodes them, sends them to every ps task in parallel (the ps applies
SGD with lr 0, so values stay put but the update runs) and decodes the
replies, which carry the same bytes back. PushPull is whatever kind
of RPC ``psframe.proto`` declares (unary, or one long-lived bidirectional
stream per ps task); each row says which, and its ratio to the raw ceiling of
the same kind is the like-for-like one. Each layout of the payload:

- **one**: one tensor per ps task (with 2 ps, the payload split in halves);
- **many**: small float32 tensors of ``max(4 KiB, payload / 256)`` bytes
  (at most 256 of them), half on each ps task with 2 ps. At 4 KiB this is
  the same as "one", so it is not run.

Each configuration gets its own fresh ps processes (``psframe server``), so
a ps holds only the variables it is timed on (a ps optimizer visits every
variable it holds on each step); the cluster has one worker, this process.

    python -m benchmarks.suite.transport [--quick]

Below the table, the bytes copied per byte sent, for a message of the largest
payload (:mod:`benchmarks.suite.copies`).
"""

from __future__ import annotations

import functools
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import psframe
from benchmarks.children import Children
from benchmarks.common import (
    BenchmarkError,
    Deadline,
    KiB,
    Settings,
    gb_per_second,
    measure_rate,
    single_thread,
    table_main,
)
from benchmarks.formatting import format_bytes, format_number, format_percent, format_ratio, markdown_table
from benchmarks.suite import copies
from benchmarks.suite.ps_cluster import PsCluster, finish_clusters, in_parallel
from benchmarks.suite.psframe_internals import (
    Step,
    Tensors,
    create_variables,
    push_pull,
    push_pull_rpc_kind,
    shard_requests,
)
from psframe import optim
from psframe.launch import pick_free_ports

MAX_TENSORS = 256
SMALL_TENSOR_BYTES = 4 * KiB
# Ps processes of several payload sizes run at once (idle but for the one timed).
MAX_PROCESSES_AT_ONCE = 12
MAX_BYTES_AT_ONCE = 8 * 1024 * 1024


# ------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One transport measurement: ``payload_bytes`` each way over ``num_ps`` ps tasks."""

    num_ps: int
    layout: str  # "one" or "many"
    payload_bytes: int

    def tensor_bytes(self) -> list[list[int]]:
        """The byte size of each tensor, per ps task."""
        if self.layout == "one":
            return [[self.payload_bytes // self.num_ps] for _ in range(self.num_ps)]
        piece = max(SMALL_TENSOR_BYTES, self.payload_bytes // MAX_TENSORS)
        count = self.payload_bytes // piece
        per_ps = count // self.num_ps
        return [[piece] * per_ps for _ in range(self.num_ps)]

    @property
    def runnable(self) -> bool:
        """ "many" with fewer than two tensors per ps task is "one": not run."""
        return self.layout == "one" or min(len(t) for t in self.tensor_bytes()) >= 2

    def shards(self) -> list[Tensors]:
        """Float32 tensors of the case, per ps task (named ``t<ps>_<i>``)."""
        return [
            [(f"t{ps}_{i}", torch.full((nbytes // 4,), 0.5)) for i, nbytes in enumerate(sizes)]
            for ps, sizes in enumerate(self.tensor_bytes())
        ]

    @property
    def num_tensors(self) -> int:
        return sum(len(t) for t in self.tensor_bytes())

    @property
    def name(self) -> str:
        return f"{self.num_ps}ps-{self.layout}-{self.payload_bytes}"


def cases_for(sizes: Sequence[int], ps_counts: Sequence[int] = (1, 2)) -> list[Case]:
    return [
        case
        for nbytes in sizes
        for num_ps in ps_counts
        for layout in ("one", "many")
        if (case := Case(num_ps, layout, nbytes)).runnable
    ]


def prepare_case(cluster: PsCluster, case: Case) -> Step:
    """Create the case's variables on its (connected) cluster, with SGD(lr=0).

    Returns:
        The gradient requests of one step (ps task, tensors).
    """
    values = case.shards()
    create_variables(cluster.client, values, optim.SGD(lr=0.0))
    return shard_requests([[(n, torch.full_like(t, 1e-3)) for n, t in tensors] for tensors in values])


def measure_case(cluster: PsCluster, case: Case, requests: Step, settings: Settings, deadline: Deadline) -> dict:
    """Time push+pull of ``requests`` on the case's prepared cluster."""
    client = cluster.client
    expected = [[t.shape for _, t in batch] for _, batch in requests]

    def round_trip() -> None:
        pulled = push_pull(client, requests)
        if [[t.shape for t in batch] for batch in pulled] != expected:
            raise BenchmarkError(f"{case.name}: the pulled tensors do not match the pushed ones")

    rate = measure_rate(round_trip, settings, deadline, f"psframe {case.name}")
    if not all(torch.isfinite(t).all() for batch in push_pull(client, requests) for t in batch):
        raise BenchmarkError(f"{case.name}: the ps returned non-finite values")
    return {
        "system": "psframe",
        "rpc": push_pull_rpc_kind(),
        "num_ps": case.num_ps,
        "layout": case.layout,
        "num_tensors": case.num_tensors,
        "payload_bytes": case.payload_bytes,
        "round_trips_per_sec": rate.per_second,
        "gb_per_sec_each_way": gb_per_second(case.payload_bytes, rate.per_second),
        "spread": rate.spread,
        "calls_per_repeat": rate.calls_per_repeat,
        "repeats": len(rate.samples),
    }


def size_groups(sizes: Sequence[int], ps_counts: Sequence[int] = (1, 2)) -> list[list[int]]:
    """Payload sizes whose ps processes run at the same time: consecutive sizes
    while at most :data:`MAX_PROCESSES_AT_ONCE` processes and
    :data:`MAX_BYTES_AT_ONCE` bytes of payload per configuration."""
    groups: list[list[int]] = []
    procs = 0
    for nbytes in sizes:
        need = sum(c.num_ps for c in cases_for([nbytes], ps_counts))
        if not groups or procs + need > MAX_PROCESSES_AT_ONCE or sum(groups[-1]) + nbytes > MAX_BYTES_AT_ONCE:
            groups.append([])
            procs = 0
        groups[-1].append(nbytes)
        procs += need
    return groups


def run_transport_benchmarks(
    settings: Settings, timeout: float = 1200.0, ps_counts: Sequence[int] = (1, 2)
) -> list[dict]:
    """Measure every case at every size of ``settings``.

    For each group of sizes (:func:`size_groups`), every case's ps processes
    are started, connected and given their variables while nothing is timed;
    then each case is timed alone; then all of them are finished.

    Returns:
        One row per case: ``system`` ("psframe"), ``rpc`` (the kind of RPC
        PushPull is), ``num_ps``, ``layout``, ``num_tensors``,
        ``payload_bytes``, ``round_trips_per_sec``, ``gb_per_sec_each_way``,
        ``spread``, ``calls_per_repeat``, ``repeats``. :func:`add_ratios` adds
        the comparison with the raw ceiling.
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "psframe transport benchmark")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-transport-") as logs:
        for sizes in size_groups(settings.sizes, ps_counts):
            cases = cases_for(sizes, ps_counts)
            with Children(logs) as children:
                ports = iter(pick_free_ports(sum(c.num_ps + 1 for c in cases)))  # all distinct
                clusters = [
                    PsCluster(
                        children,
                        c.num_ps,
                        c.name,
                        deadline.remaining() + 60,
                        [next(ports) for _ in range(c.num_ps + 1)],
                    )
                    for c in cases
                ]
                for cluster in clusters:  # all up (done importing torch) before anything is timed
                    cluster.connect(deadline)
                requests = in_parallel(
                    [functools.partial(prepare_case, cl, c) for cl, c in zip(clusters, cases)], deadline
                )
                for case, cluster, reqs in zip(cases, clusters, requests):
                    rows.append(measure_case(cluster, case, reqs, settings, deadline))
                finish_clusters(clusters)
    return rows


def add_ratios(rows: list[dict], raw_rows: Sequence[dict]) -> list[dict]:
    """Add ``vs_raw_unary`` and ``vs_raw_stream``: round trips/s over the raw
    ceiling's at the same payload (None where the raw rows lack that size),
    and ``vs_raw_same``: the one of the two in the mode of psframe's PushPull."""
    raw = {(r["mode"], r["payload_bytes"]): r["round_trips_per_sec"] for r in raw_rows}
    for row in rows:
        for mode in ("unary", "stream"):
            ceiling = raw.get((mode, row["payload_bytes"]))
            row[f"vs_raw_{mode}"] = row["round_trips_per_sec"] / ceiling if ceiling else None
        row["vs_raw_same"] = row[f"vs_raw_{row['rpc']}"]
    return rows


def transport_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_transport_benchmarks` rows
    (with the ratios of :func:`add_ratios` where present)."""

    def ratio(row: dict, mode: str) -> str:
        text = format_ratio(row.get(f"vs_raw_{mode}"))
        return f"**{text}**" if row.get("rpc") == mode and text != "-" else text

    return markdown_table(
        [
            "system",
            "ps tasks",
            "tensors",
            "payload",
            "PushPull rpc",
            "round trips/s",
            "GB/s each way",
            "vs raw unary",
            "vs raw stream",
            "spread",
        ],
        [
            [
                r["system"],
                r["num_ps"],
                f"{r['num_tensors']} ({r['layout']})",
                format_bytes(r["payload_bytes"]),
                r.get("rpc", "?"),
                format_number(r["round_trips_per_sec"]),
                format_number(r["gb_per_sec_each_way"]),
                ratio(r, "unary"),
                ratio(r, "stream"),
                format_percent(r["spread"]),
            ]
            for r in rows
        ],
    )


def with_copies(table: str, quick: bool) -> str:
    """``table`` and, below it, the bytes copied per byte sent on the way (:mod:`benchmarks.suite.copies`),
    for a message of the largest payload timed."""
    length = max(Settings.for_mode(quick).sizes)
    return f"{table}\n\n{copies.copies_table(copies.measure(length), length)}"


def main(argv: list[str] | None = None) -> int:
    # As psframe's own entry points do: the settings of a process that moves tensors every step.
    psframe.tune_process()
    return table_main(
        argv,
        __doc__,
        "small sizes, few repeats",
        lambda quick: with_copies(transport_table(run_transport_benchmarks(Settings.for_mode(quick))), quick),
    )


if __name__ == "__main__":
    sys.exit(main())

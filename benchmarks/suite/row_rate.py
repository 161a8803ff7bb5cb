"""A ps task's embedding rows per core-second against raw torch's: reading rows, and Adagrad on them.

    python -m benchmarks.suite.row_rate [--quick] [--profile]

The CTR example's tables and ids: a table of 2^17 rows of 8 float32
(``examples/ctr_dist.py``'s ``--hash_buckets`` and ``--embedding_dim``),
Adagrad with lr 0.05, and batches of 512 samples of its click log
(``examples/ctr_data.py``: 26 categorical features of power-law
frequencies, 13,312 lookups a batch, about 5,200 distinct rows). A call
takes one batch's distinct ids, sorted, as a worker sends them; 16 batches
are cycled. Dynamic tables keep the ids whole, as ``--dynamic_tables`` does,
and hold every id of the 16 batches before the timing starts.

In this process, one thread (one core), no network:

- **read**: raw torch's ``weight.index_select(0, ids)``
  (:mod:`benchmarks.baselines.torch_rows`), against a ps task's own read of
  a fixed table (``VariableStore.read_rows``) and of a dynamic table's part
  (``DynamicRows.read``);
- **read + Adagrad**: one Adagrad step on the rows' gradients, then the
  rows read back: raw ``torch.optim.Adagrad`` on their sparse gradient, raw
  gathers and scatters of the rows (the ceiling: the fastest raw torch
  knows, see :mod:`benchmarks.baselines.torch_rows`), a ps task's fixed
  table (``VariableStore.apply_rows`` then ``read_rows``) and a dynamic
  table's part (``DynamicRows.apply`` then ``read``).

Over gRPC (**ps CPU per row**): one ``psframe server`` ps task (one serving
process) and this process as its one worker (``psframe.Trainer``) training
the table, summed per sample, and a linear head: each step pulls the batch's
rows and pushes their gradients. *rows/s per core* is then the rows updated
and read per CPU second of the ps process (user + system, psutil, over the
timed steps; the worker's own work is not counted).

*vs ceiling* divides rows/s by raw torch's fastest at the same operation
(``index_select`` for reads, the gathers and scatters for updates); *vs
torch.optim*, for updates, by ``torch.optim.Adagrad``'s. The in-process paths
take turns (each repeat times each of them once) and their ratios are the
median of each repeat's, so that other work on the machine, which comes and
goes, weighs on both sides of a ratio alike. ``--profile`` adds
cProfile's view of each of psframe's in-process paths (the functions that
take the most time, per call).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

import psframe
from benchmarks.baselines.torch_rows import RowAdagrad, TorchAdagrad, read
from benchmarks.children import Children
from benchmarks.common import Deadline, Settings, example_module, single_thread
from benchmarks.formatting import format_number, format_ratio, markdown_table
from benchmarks.suite.ps_cluster import PsCluster
from benchmarks.suite.psframe_internals import DynamicRows, DynamicTableSpec, VariableStore

TABLE_ROWS = 1 << 17  # examples/ctr_dist.py's --hash_buckets
DIM = 8  # its --embedding_dim
BATCH = 512  # DeepRec's published batch for its Criteo-shaped models
BATCHES = 16  # distinct batches, cycled
LEARNING_RATE = 0.05  # the example's
INITIALIZER = psframe.RowInitializer(std=0.01, seed=1)  # the example's deep table's
TABLE = "table"
READ, UPDATE = "read", "read + Adagrad"
RAW_READ, RAW_TORCH_OPTIM, RAW_CEILING = (
    "raw torch: index_select",
    "raw torch: torch.optim.Adagrad",
    "raw torch: gathers and scatters",
)
GRPC_STEPS = {True: (10, 40), False: (20, 300)}  # quick -> (warm-up steps after a pass over every batch, timed steps)

Batch = tuple[torch.Tensor, torch.Tensor]  # distinct ids, their gradients


def lookups(dynamic: bool, count: int = BATCHES) -> list[torch.Tensor]:
    """``count`` batches of the click log's ids, (512, 26) each: hashed into the table's rows, or whole."""
    log = example_module("ctr_data").click_log(count * BATCH, buckets=None if dynamic else TABLE_ROWS, seed=0)
    return [log.ids[i * BATCH : (i + 1) * BATCH] for i in range(count)]


def row_batches(dynamic: bool) -> list[Batch]:
    """Each batch's distinct ids (sorted, as a worker sends them) and random gradients for their rows."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for ids in lookups(dynamic):
        distinct = torch.unique(ids)
        out.append((distinct, torch.randn(distinct.numel(), DIM, generator=generator) * 0.01))
    return out


def fixed_store(weight: torch.Tensor) -> VariableStore:
    """A ps task's store holding ``weight`` as its one fixed table, with Adagrad."""
    store = VariableStore("/job:ps/task:0")
    adagrad = psframe.optim.Adagrad(lr=LEARNING_RATE)
    store.create({TABLE: weight}, adagrad, tables=[TABLE], table_optimizer=adagrad)
    return store


def dynamic_part(data: list[Batch]) -> DynamicRows:
    """A dynamic table's part with Adagrad, already holding every id of ``data``."""
    part = DynamicRows(
        f"{TABLE}/part_0", (DIM,), torch.float32, DynamicTableSpec(INITIALIZER), psframe.optim.Adagrad(lr=LEARNING_RATE)
    )
    for ids, _ in data:
        part.read(ids)
    return part


def in_process_paths() -> list[tuple[str, str, bool, Callable[[torch.Tensor, torch.Tensor], object]]]:
    """``(operation, path, dynamic ids, call(ids, grads))`` of every in-process row, in the table's order."""
    weight = torch.randn(TABLE_ROWS, DIM, generator=torch.Generator().manual_seed(2)) * 0.01
    store, updated_store = fixed_store(weight), fixed_store(weight)
    part, updated_part = dynamic_part(row_batches(True)), dynamic_part(row_batches(True))
    torch_optim, ceiling = TorchAdagrad(weight, LEARNING_RATE), RowAdagrad(weight, LEARNING_RATE)

    def apply_and_read(ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        updated_store.apply_rows([(TABLE, ids, grads)])
        return updated_store.read_rows(TABLE, ids)

    def apply_and_read_dynamic(ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        updated_part.apply(ids, grads)
        return updated_part.read(ids)

    return [
        (READ, RAW_READ, False, lambda ids, _: read(weight, ids)),
        (READ, "psframe: VariableStore.read_rows", False, lambda ids, _: store.read_rows(TABLE, ids)),
        (READ, "psframe dynamic: DynamicRows.read", True, lambda ids, _: part.read(ids)),
        (UPDATE, RAW_TORCH_OPTIM, False, torch_optim.update_and_read),
        (UPDATE, RAW_CEILING, False, ceiling.update_and_read),
        (UPDATE, "psframe: VariableStore.apply_rows + read_rows", False, apply_and_read),
        (UPDATE, "psframe dynamic: DynamicRows.apply + read", True, apply_and_read_dynamic),
    ]


def measure_in_process(settings: Settings, deadline: Deadline) -> list[dict]:
    """Rows/s of each of :func:`in_process_paths`, one thread.

    The paths take turns: each repeat times every path once, so load from
    other work that comes and goes weighs on all of them alike, and a ratio
    is taken between the rates of one repeat (see :func:`add_ratios`).
    """
    data = {False: row_batches(False), True: row_batches(True)}
    timed = []
    for operation, path, dynamic, call in in_process_paths():
        cycle = itertools.cycle(data[dynamic])
        durations: list[float] = []
        warm_start = time.perf_counter()
        while len(durations) < settings.warmup_calls or time.perf_counter() - warm_start < settings.warmup_seconds:
            deadline.check(f"warming up {path}")
            started = time.perf_counter()
            call(*next(cycle))
            durations.append(time.perf_counter() - started)
        per_call = statistics.median(durations[len(durations) // 2 :]) or 1e-6
        calls = min(settings.max_calls, max(settings.min_calls, math.ceil(settings.target_seconds / per_call)))
        rows = statistics.mean(ids.numel() for ids, _ in data[dynamic])
        timed.append((operation, path, call, cycle, calls, rows))
    rates: list[list[float]] = [[] for _ in timed]
    for _ in range(settings.repeats):
        for (_, path, call, cycle, calls, _), path_rates in zip(timed, rates):
            deadline.check(f"timing {path}")
            started = time.perf_counter()
            for _ in range(calls):
                call(*next(cycle))
            path_rates.append(calls / (time.perf_counter() - started))
    out = []
    for (operation, path, _, _, _, rows), path_rates in zip(timed, rates):
        calls_per_s = statistics.median(path_rates)
        spread = (max(path_rates) - min(path_rates)) / calls_per_s
        row = _row(operation, path, "in process", rows, calls_per_s, spread)
        row["repeat_rows_per_s"] = [rows * rate for rate in path_rates]
        out.append(row)
    return out


def _row(operation: str, path: str, where: str, rows_per_call: float, calls_per_s: float, spread: float) -> dict:
    return {
        "kind": "row_rate",
        "operation": operation,
        "path": path,
        "where": where,
        "rows_per_call": rows_per_call,
        "us_per_call": 1e6 / calls_per_s,
        "rows_per_s": rows_per_call * calls_per_s,
        "spread": spread,
    }


class TableModel(torch.nn.Module):
    """The CTR example's deep table alone: rows looked up, summed per sample, a linear head."""

    def __init__(self, dynamic: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if dynamic:
            self.table: torch.nn.Module = psframe.DynamicEmbedding(DIM, initializer=INITIALIZER)
        else:
            self.table = torch.nn.Embedding(TABLE_ROWS, DIM, sparse=True)
            torch.nn.init.normal_(self.table.weight, std=0.01)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).sum(1)).squeeze(1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and the processes it started."""
    process = psutil.Process(pid)
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        times = each.cpu_times()
        total += times.user + times.system
    return total


def measure_grpc(children: Children, dynamic: bool, quick: bool, deadline: Deadline) -> dict:
    """The ps process's rows per CPU second, serving this process's ``psframe.Trainer``."""
    name = "dynamic" if dynamic else "fixed"
    cluster = PsCluster(
        children, 1, f"row-rate-{name}", timeout=deadline.remaining(), extra_flags=["--serving_processes=1"]
    )
    model = TableModel(dynamic)
    data = lookups(dynamic)
    generator = torch.Generator().manual_seed(4)
    targets = [torch.rand(BATCH, generator=generator) for _ in data]
    rows = statistics.mean(torch.unique(ids).numel() for ids in data)
    cycle = itertools.cycle(zip(data, targets))
    warmup, timed = GRPC_STEPS[quick]
    trainer = psframe.Trainer(
        model,
        cluster.cluster,
        optimizer=psframe.optim.Adagrad(lr=LEARNING_RATE),
        transport=psframe.Transport(connect_timeout=deadline.remaining()),
    )
    pending = next(cycle)

    def step() -> None:  # as the CTR example steps: the next batch's rows come back with this step's push
        nonlocal pending
        ids, target = pending
        loss = F.binary_cross_entropy_with_logits(model(ids), target)
        pending = next(cycle)
        trainer.prefetch(model.table, pending[0])
        trainer.step(loss)

    with trainer:
        for _ in range(len(data) + warmup):  # every id held (dynamic) and every path warm
            step()
        pid = cluster.procs[0].pid
        cpu, started = cpu_seconds(pid), time.perf_counter()
        for _ in range(timed):
            deadline.check(f"stepping the {name} table over gRPC")
            step()
        seconds, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    for child in cluster.names:
        children.wait_exit(child, 15.0)
    path = f"psframe{' dynamic' if dynamic else ''}: 1 ps task (1 serving process), 1 worker"
    row = _row(UPDATE, path, "gRPC, ps CPU", rows, timed / cpu, 0.0)
    row.update(steps_per_s=timed / seconds, ps_cores=cpu / seconds)
    return row


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row with ``vs_ceiling`` (rows/s over raw torch's fastest at its operation) and, for
    updates, ``vs_torch_optim`` (over torch.optim.Adagrad's).

    Rows timed in the same repeats (``repeat_rows_per_s``) are compared repeat by repeat (the
    median of the ratios); others (over gRPC) by their medians.
    """
    by_path = {r["path"]: r for r in rows}

    def ratio(row: dict, base_path: str) -> float | None:
        base = by_path.get(base_path)
        if base is None or not base["rows_per_s"]:
            return None
        mine, theirs = row.get("repeat_rows_per_s"), base.get("repeat_rows_per_s")
        if mine and theirs and len(mine) == len(theirs):
            return statistics.median(a / b for a, b in zip(mine, theirs))
        return row["rows_per_s"] / base["rows_per_s"]

    for r in rows:
        r["vs_ceiling"] = ratio(r, RAW_READ if r["operation"] == READ else RAW_CEILING)
        r["vs_torch_optim"] = ratio(r, RAW_TORCH_OPTIM) if r["operation"] == UPDATE else None
    return rows


def run_row_rate_benchmarks(quick: bool = False, timeout: float = 600.0) -> list[dict]:
    """Every in-process path, then the ps over gRPC with a fixed and a dynamic table; with ratios.

    Returns:
        One row per path: ``kind`` ("row_rate"), ``operation``, ``path``, ``where``,
        ``rows_per_call``, ``us_per_call``, ``rows_per_s`` (per core), ``spread``, ``vs_ceiling``
        and ``vs_torch_optim``; the gRPC rows also ``steps_per_s`` (the worker's) and ``ps_cores``
        (the ps process's CPU seconds per second).
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "row rate benchmark")
    rows = measure_in_process(Settings.for_mode(quick), deadline)
    with tempfile.TemporaryDirectory(prefix="psframe-bench-rows-") as logs, Children(Path(logs)) as children:
        rows += [measure_grpc(children, dynamic, quick, deadline) for dynamic in (False, True)]
    return add_ratios(rows)


def row_rate_table(rows: list[dict]) -> str:
    """Markdown table of :func:`run_row_rate_benchmarks` rows."""
    headers = [
        "operation",
        "path",
        "where",
        "rows/call",
        "µs/call",
        "rows/s per core",
        "vs ceiling",
        "vs torch.optim",
        "spread",
    ]
    return markdown_table(
        headers,
        [
            [
                r["operation"],
                r["path"],
                r["where"],
                f"{r['rows_per_call']:,.0f}",
                format_number(r["us_per_call"]),
                f"{r['rows_per_s']:,.0f}",
                format_ratio(r["vs_ceiling"]),
                format_ratio(r["vs_torch_optim"]),
                f"{r['spread']:.0%}" if r["where"] == "in process" else "-",
            ]
            for r in rows
        ],
    )


def profile_paths(calls: int = 200, top: int = 12) -> str:
    """cProfile of each of psframe's in-process paths over ``calls`` calls: the functions with
    the most time of their own, in µs per call (cProfile's own cost included)."""
    data = {False: row_batches(False), True: row_batches(True)}
    parts = []
    for operation, path, dynamic, call in in_process_paths():
        if not path.startswith("psframe"):
            continue
        cycle = itertools.cycle(data[dynamic])
        for _ in range(len(data[dynamic])):  # warm
            call(*next(cycle))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call(*next(cycle))
        profiler.disable()
        stats = pstats.Stats(profiler, stream=io.StringIO())
        total = sum(entry[2] for entry in stats.stats.values())  # type: ignore[attr-defined]
        lines = [f"{operation}, {path}: {1e6 * total / calls:,.0f} µs per call in all; the most of their own:"]
        entries = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
        for (file, line, function), (_, ncalls, own, cumulative, _) in entries:
            where = function if file == "~" else f"{file.split('/psframe/')[-1]}:{line}({function})"
            lines.append(
                f"  {1e6 * own / calls:8.1f} µs own, {1e6 * cumulative / calls:8.1f} µs with callees, "
                f"{ncalls / calls:4.1f} calls: {where}"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short repeats, 40 steps over gRPC")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's view of psframe's paths")
    args = parser.parse_args(argv)
    psframe.tune_process()  # as psframe's own entry points do
    print(row_rate_table(run_row_rate_benchmarks(args.quick)))
    if args.profile:
        print("\n" + profile_paths())
    return 0


if __name__ == "__main__":
    sys.exit(main())

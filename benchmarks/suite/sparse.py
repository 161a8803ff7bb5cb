"""Embedding tables: a step's cost follows the rows a batch uses, not the table's size.

    python -m benchmarks.suite.sparse [--quick]

One worker (this process, ``psframe.Trainer``) and 2 ps tasks (``psframe
server`` processes) train a CTR-shaped model: 26 categorical features looked
up in one ``nn.Embedding(rows, 64, sparse=True)``, summed per sample, then a
linear head; Adagrad on the ps tasks; a batch of 512 samples, so 13,312
lookups. Every table size gets the same batches: ids of a power-law
frequency (Zipf over 10^4 ids, as click logs have them: most lookups hit a
few hundred hot ids), scattered over the table by one multiplicative hash
(a bijection for every size here), so each batch touches as many distinct
rows, about 3,500, whatever the table.

Rows, one per table size and way of moving it:

- **rows** (psframe's embedding tables): the step pulls the batch's distinct
  rows before the forward pass and pushes their gradients after backward.
- **rows+prefetch** (at the RPC baseline's sizes, 1 ps task): the same, with
  ``Trainer.prefetch``: each step also pulls the next batch's rows, right
  behind its push on the same stream, so the lookup finds them there.
- **dense** (the naive way, ``sparse=False``): the whole table is pushed and
  pulled every step, in 4 MiB messages; run up to 10^5 rows (10^7 would
  move 2.56 GB each way per step).
- **rpc** (:mod:`benchmarks.baselines.rpc_sparse`): a torch.distributed.rpc
  parameter server (one ps process) holding the same model, the trainer
  pulling the batch's rows and pushing a ``torch.sparse`` gradient, two
  ``rpc_sync`` calls a step; compared with psframe's rows on 1 ps task
  (*vs rpc*), the same table size.

*rows/s* counts the distinct rows moved each way per second (the whole
table for dense); *step time vs smallest table* divides a row's step time by
that of the smallest table moved the same way on as many ps tasks, in the
same run: the target is at most 1.2x from 10^4 to 10^7 rows.

:func:`partition_balance` (no cluster: psframe's own placement and id split)
measures how evenly each way of cutting a table spreads a batch's lookups
over the ps tasks, for ids numbered by frequency (a vocabulary sorted by
count, id 0 the most frequent) and for hashed ids.

:func:`table_memory` holds a 10^7 x 64 table (10^6 rows with ``--quick``)
with Adagrad on 2 ps tasks against what it costs them: each ps task's peak
resident memory (``VmHWM``) after a few steps, against 1.3 x the rows and
Adagrad state it holds plus the peak of an idle ps task (a 1,024-row table,
the same steps), measured in the same run. :mod:`benchmarks.suite.ctr` adds the CTR
example's rows (samples/s and AUC, async and sync, against one process).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import psframe
from benchmarks.children import Children
from benchmarks.common import MB, BenchmarkError, Deadline, Settings, measure_rate, single_thread, table_main
from benchmarks.embedding_workload import BATCH, BATCHES, DIM, FEATURES, HASH, LEARNING_RATE, CtrModel, batches
from benchmarks.formatting import format_number, format_ratio, markdown_table
from benchmarks.suite.ctr import ctr_table, run_ctr_benchmarks
from benchmarks.suite.memory import LIMIT_FACTOR, MemorySampler, vm_hwm
from benchmarks.suite.ps_cluster import PsCluster
from benchmarks.suite.psframe_internals import control_calls, table_split_loads, tool_client
from psframe.launch import pick_free_ports

TABLE_ROWS = (10**4, 10**5, 10**6, 10**7)
QUICK_TABLE_ROWS = (10**4, 10**5)
DENSE_MAX_ROWS = 10**5
RPC_ROWS = (10**5, 10**7)  # the table sizes the RPC baseline runs at (psframe's rows then also on 1 ps task)
QUICK_RPC_ROWS = (10**5,)
STARTUP_S = 120.0  # the chief sends a 10^7-row table (2.56 GB) at Init
MEMORY_ROWS = 10**7  # the table whose ps memory is held against the limit
QUICK_MEMORY_ROWS = 10**6
IDLE_ROWS = 1_024  # the idle ps tasks' table: 512 rows each, 128 KiB and as much Adagrad state
MEMORY_STEPS = BATCHES  # every batch once: Adagrad's state exists and has been updated


def partition_balance(rows: int = 10**6, ps_counts: tuple[int, ...] = (2, 4, 8), batches_drawn: int = 20) -> list[dict]:
    """Lookups per ps task of power-law batches, max over mean, for ``mod`` and ``range`` tables.

    Returns:
        One row per id numbering (``frequency-sorted``, ``hashed``), partition and ps count:
        ``imbalance`` (the busiest ps task's lookups over the mean; 1.0 is even).
    """
    generator = torch.Generator().manual_seed(11)
    u = torch.rand(batches_drawn * BATCH, FEATURES, generator=generator, dtype=torch.float64)
    ranks = (torch.floor(torch.exp(u * torch.log(torch.tensor(float(rows))))).long() - 1).flatten()
    numberings = {"frequency-sorted": ranks, "hashed": (ranks * HASH) % rows}
    out = []
    for numbering, ids in numberings.items():
        ids = ids.sort().values
        for partition in ("mod", "range"):
            for num_ps in ps_counts:
                loads = torch.tensor(table_split_loads(rows, DIM, num_ps, partition, ids))
                out.append(
                    {
                        "kind": "balance",
                        "numbering": numbering,
                        "partition": partition,
                        "num_ps": num_ps,
                        "imbalance": float(loads.max() / loads.mean()),
                    }
                )
    return out


def balance_table(results: list[dict]) -> str:
    """Markdown table of :func:`partition_balance` rows."""
    headers = ["ids", "partition", "ps tasks", "busiest ps task's lookups / mean"]
    return markdown_table(
        headers, [[r["numbering"], r["partition"], r["num_ps"], f"{r['imbalance']:.2f}"] for r in results]
    )


def measure_rpc(children: Children, rows: int, quick: bool, deadline: Deadline) -> dict:
    """The RPC baseline at ``rows``: its trainer's steps/s."""
    (port,) = pick_free_ports(1)
    steps = ["--steps=40", "--warmup=5"] if quick else ["--steps=300", "--warmup=30"]
    names = [f"rpc-{rows}-ps", f"rpc-{rows}-trainer"]
    for rank, name in enumerate(names):
        children.start(
            name,
            [
                sys.executable,
                "-m",
                "benchmarks.baselines.rpc_sparse",
                f"--port={port}",
                f"--rank={rank}",
                f"--rows={rows}",
                *steps,
            ],
        )
    for name in reversed(names):
        code = children.wait_exit(name, deadline.remaining())
        if code != 0:
            raise BenchmarkError(f"{name} ended with {code}; its log:\n{children.log_tail(name)}")
    lines = [line for line in children.log_path(names[1]).read_text().splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])
    data = batches(rows)
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in data) / len(data)
    return {
        "rows": rows,
        "way": "rpc",
        "num_ps": 1,
        "steps_per_s": result["steps_per_sec"],
        "spread": (max(result["window_rates"]) - min(result["window_rates"])) / result["steps_per_sec"],
        "distinct_rows": distinct,
        "rows_per_s": distinct * result["steps_per_sec"],
        "table_bytes": rows * DIM * 4,
        "connect_s": None,
    }


def measure(
    children: Children,
    rows: int,
    sparse: bool,
    settings: Settings,
    deadline: Deadline,
    num_ps: int = 2,
    prefetch: bool = False,
) -> dict:
    """psframe's steps/s at ``rows``: moving the rows a batch uses (``sparse``) or the whole table;
    with ``prefetch``, each step also pulls the next batch's rows behind its push (``Trainer.prefetch``)."""
    way = ("rows+prefetch" if prefetch else "rows") if sparse else "dense"
    cluster = PsCluster(
        children, num_ps, f"sparse-{rows}-{way.replace('+', '-')}-{num_ps}ps", timeout=deadline.remaining()
    )
    model = CtrModel(rows, sparse)
    data = batches(rows)
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in data) / len(data)
    cycle = itertools.cycle(itertools.pairwise(itertools.chain(data, data[:1])))  # (batch, next batch)
    started = time.monotonic()
    trainer = psframe.Trainer(
        model,
        cluster.cluster,
        optimizer=psframe.optim.Adagrad(lr=LEARNING_RATE),
        transport=psframe.Transport(connect_timeout=min(STARTUP_S, deadline.remaining())),
    )
    with trainer:
        connect_s = time.monotonic() - started

        def step() -> None:
            (ids, target), (next_ids, _) = next(cycle)
            loss = F.mse_loss(torch.sigmoid(model(ids)), target)
            if prefetch:
                trainer.prefetch(model.table, next_ids)
            trainer.step(loss)

        rate = measure_rate(step, settings, deadline, f"{rows} rows ({way})")
    for name in cluster.names:
        children.wait_exit(name, 15.0)
    moved = distinct if sparse else rows
    return {
        "rows": rows,
        "way": way,
        "num_ps": num_ps,
        "steps_per_s": rate.per_second,
        "spread": rate.spread,
        "distinct_rows": distinct,
        "rows_per_s": moved * rate.per_second,
        "table_bytes": rows * DIM * 4,
        "connect_s": connect_s,
    }


def ps_memory(children: Children, rows: int, steps: int, deadline: Deadline) -> list[dict]:
    """Train ``steps`` steps of :class:`CtrModel` with a ``rows``-row table (Adagrad) on 2 ps
    tasks, and read each ps task's memory before the trainer finishes.

    Returns:
        One row per ps task: ``ps_task``, ``pid``, ``table_bytes`` (the table rows it holds),
        ``bytes_held`` (everything it holds: its rows, the dense head's part, the optimizers'
        state; ``TaskInfo.bytes_held``), ``baseline_rss`` (serving, before the model),
        ``peak_rss_after_init`` (VmHWM once the model exists, before the first step),
        ``peak_rss`` and ``peak_source``.
    """
    cluster = PsCluster(children, 2, f"sparse-memory-{rows}", timeout=deadline.remaining() + 60)
    # A tool's client: it asks the ps tasks what they hold and who serves, and is no worker.
    tool = tool_client(cluster.cluster, rpc_timeout=min(60.0, deadline.remaining(1.0)))
    samplers: list[MemorySampler] = []
    try:
        try:
            infos = control_calls.wait_for_ps(tool, deadline.remaining())
        except psframe.PsframeError as e:
            raise BenchmarkError(
                f"ps tasks did not come up: {e}\n" + "\n".join(children.log_tail(n) for n in cluster.names)
            ) from e
        pids = [info.pid for info in infos]
        samplers = [MemorySampler(pid) for pid in pids]  # the peak where VmHWM is missing
        baselines = [sampler.sample() for sampler in samplers]
        model = CtrModel(rows, sparse=True)
        cycle = itertools.cycle(batches(rows))
        trainer = psframe.Trainer(
            model,
            cluster.cluster,
            optimizer=psframe.optim.Adagrad(lr=LEARNING_RATE),
            transport=psframe.Transport(connect_timeout=min(STARTUP_S, deadline.remaining())),
        )
        with trainer:
            init_peaks = [vm_hwm(pid) for pid in pids]
            for _ in range(steps):
                deadline.check(f"stepping the {rows:,}-row table")
                ids, target = next(cycle)
                trainer.step(F.mse_loss(torch.sigmoid(model(ids)), target))
            infos = [control_calls.get_info(tool, k) for k in range(cluster.num_ps)]
            peaks = [vm_hwm(pid) for pid in pids]
        del model, trainer
    finally:
        sampled = [sampler.stop() for sampler in samplers]
        tool.close()
    for name in cluster.names:
        children.wait_exit(name, 15.0)
    out = []
    for k, info in enumerate(infos):
        table_bytes = sum(4 * math.prod(v.shape) for v in info.variables if v.table)
        out.append(
            {
                "kind": "memory",
                "rows": rows,
                "ps_task": k,
                "pid": pids[k],
                "steps": steps,
                "table_bytes": table_bytes,
                "bytes_held": info.bytes_held,
                "baseline_rss": baselines[k],
                "peak_rss_after_init": init_peaks[k],
                "peak_rss": sampled[k] if peaks[k] is None else peaks[k],
                "peak_source": "sampled RSS" if peaks[k] is None else "VmHWM",
            }
        )
    return out


def table_memory(
    children: Children, rows: int, deadline: Deadline, steps: int = MEMORY_STEPS, idle_rows: int = IDLE_ROWS
) -> list[dict]:
    """Each ps task's peak memory with a ``rows`` x 64 table against 1.3 x what it holds plus
    an idle ps task's peak (the same task of a ``idle_rows``-row table, the same steps).

    Returns:
        :func:`ps_memory`'s rows with ``idle_rss``, ``limit`` and ``within_limit``.
    """
    idle = ps_memory(children, idle_rows, steps, deadline)
    out = ps_memory(children, rows, steps, deadline)
    for row, idle_row in zip(out, idle):
        row["idle_rss"] = idle_row["peak_rss"]
        row["limit"] = LIMIT_FACTOR * row["bytes_held"] + row["idle_rss"]
        row["within_limit"] = row["peak_rss"] <= row["limit"]
    return out


def memory_table(results: list[dict]) -> str:
    """Markdown table of :func:`table_memory` rows (MB = 10^6 bytes)."""

    def mb(value: int | None) -> str:
        return format_number(None if value is None else value / MB, 4)

    headers = [
        "table rows",
        "ps task",
        "rows held (MB)",
        "rows + state held (MB)",
        "baseline (MB)",
        "idle ps (MB)",
        "peak after init (MB)",
        "peak (MB)",
        "limit (MB)",
        "peak <= 1.3 x held + idle ps",
    ]
    return markdown_table(
        headers,
        [
            [
                f"{r['rows']:,}",
                r["ps_task"],
                mb(r["table_bytes"]),
                mb(r["bytes_held"]),
                mb(r["baseline_rss"]),
                mb(r["idle_rss"]),
                mb(r["peak_rss_after_init"]),
                mb(r["peak_rss"]),
                mb(r["limit"]),
                "yes" if r["within_limit"] else "NO",
            ]
            for r in results
        ],
    )


def run_sparse_benchmarks(quick: bool = False, timeout: float = 1200.0) -> list[dict]:
    """Every table size with rows, and the small ones dense; each row's ratio to the 10^4-row table's;
    then the ps tasks' memory of a large table (:func:`table_memory`), the CTR example's rows
    (:func:`benchmarks.suite.ctr.run_ctr_benchmarks`) and :func:`partition_balance`."""
    single_thread()
    torch.set_num_threads(1)
    settings = Settings.for_mode(quick)
    deadline = Deadline(timeout, "embedding table benchmark")
    results = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-sparse-") as logs, Children(logs) as children:
        for rows in QUICK_TABLE_ROWS if quick else TABLE_ROWS:
            results.append(measure(children, rows, True, settings, deadline))
            if rows <= DENSE_MAX_ROWS:
                results.append(measure(children, rows, False, settings, deadline))
        for rows in QUICK_RPC_ROWS if quick else RPC_ROWS:
            results.append(measure(children, rows, True, settings, deadline, num_ps=1))
            results.append(measure(children, rows, True, settings, deadline, num_ps=1, prefetch=True))
            results.append(measure_rpc(children, rows, quick, deadline))
    base = {
        (r["way"], r["num_ps"]): r["steps_per_s"]
        for r in results
        if r["rows"] == min(q["rows"] for q in results if (q["way"], q["num_ps"]) == (r["way"], r["num_ps"]))
    }
    rpc = {r["rows"]: r["steps_per_s"] for r in results if r["way"] == "rpc"}
    for r in results:
        r["vs_smallest"] = base[(r["way"], r["num_ps"])] / r["steps_per_s"]  # step time over the smallest table's
        r["vs_rpc"] = r["steps_per_s"] / rpc[r["rows"]] if r["num_ps"] == 1 and r["rows"] in rpc else None
    with tempfile.TemporaryDirectory(prefix="psframe-bench-sparse-") as logs, Children(logs) as children:
        results += table_memory(children, QUICK_MEMORY_ROWS if quick else MEMORY_ROWS, deadline)
    results += run_ctr_benchmarks(quick, timeout=deadline.remaining())
    return results + partition_balance()


def steps_table(results: list[dict]) -> str:
    """Markdown table of :func:`measure` and :func:`measure_rpc` rows: steps/s per table size and way."""
    headers = [
        "table rows",
        "table",
        "moved",
        "ps tasks",
        "steps/s",
        "distinct rows/step",
        "rows/s each way",
        "step time vs smallest table",
        "vs rpc",
        "spread",
        "start-up s",
    ]
    rows = [
        [
            f"{r['rows']:,}",
            f"{r['table_bytes'] / 1e6:,.1f} MB",
            r["way"],
            r["num_ps"],
            f"{r['steps_per_s']:.1f}",
            f"{r['distinct_rows']:,.0f}",
            f"{r['rows_per_s']:,.0f}",
            format_ratio(r["vs_smallest"]),
            format_ratio(r.get("vs_rpc")),
            f"{r['spread']:.0%}",
            "-" if r["connect_s"] is None else f"{r['connect_s']:.1f}",
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


# The captions of the tables below the steps table (tests find the tables by them).
MEMORY_CAPTION = "ps memory of an embedding table with Adagrad on 2 ps tasks"
CTR_CAPTION = "The CTR example (examples/ctr_dist.py), async and sync, against one process"


def sparse_table(rows: Sequence[dict]) -> str:
    """The section's markdown tables of :func:`run_sparse_benchmarks` rows: steps, then the ps
    tasks' memory, the CTR example and partition balance (each where it has rows)."""
    steps = [r for r in rows if r.get("kind") not in ("memory", "ctr", "balance")]
    memory, ctr, balance = ([r for r in rows if r.get("kind") == kind] for kind in ("memory", "ctr", "balance"))
    parts = [steps_table(steps)] if steps else []
    if memory:
        parts.append(
            f"{MEMORY_CAPTION} (each ps task's peak resident memory, VmHWM, after "
            f"{memory[0]['steps']} steps, against 1.3 x the table rows and optimizer state it "
            f"holds plus the peak of the same ps task of a {IDLE_ROWS:,}-row table after the same "
            "steps, measured in the same run; MB = 10^6 bytes):\n\n" + memory_table(memory)
        )
    if ctr:
        parts.append(
            f"{CTR_CAPTION} (from `benchmarks.suite.ctr`: the same samples in every mode; "
            "samples/s as the example's chief prints it, over its training loop; *run s* the "
            "whole run with start-up and evaluation):\n\n" + ctr_table(ctr)
        )
    if balance:
        parts.append(
            "How evenly a table's parts share a batch's lookups (no cluster: psframe's placement "
            "and id split over 20 power-law batches of a 10^6-row table):\n\n" + balance_table(balance)
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    # As psframe's own entry points do: the settings of a process that moves tensors every step.
    psframe.tune_process()
    return table_main(
        argv,
        __doc__,
        "10^4 and 10^5 rows only, short repeats; memory of 10^6 rows; the CTR example's quick case",
        lambda quick: sparse_table(run_sparse_benchmarks(quick)),
    )


if __name__ == "__main__":
    sys.exit(main())

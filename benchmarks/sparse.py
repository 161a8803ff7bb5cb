"""Embedding tables: a step's cost follows the rows a batch uses, not the table's size.

    python -m benchmarks.sparse [--quick]

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
- **dense** (the naive way, ``sparse=False``): the whole table is pushed and
  pulled every step, in 4 MiB messages; run up to 10^5 rows (10^7 would
  move 2.56 GB each way per step).
- **rpc** (:mod:`benchmarks.baseline_rpc_sparse`): a torch.distributed.rpc
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
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import psframe
from benchmarks.common import (BenchmarkError, Children, Deadline, Settings, format_ratio, markdown_table,
                               measure_rate, single_thread)
from benchmarks.transport import PsCluster

DIM = 64
FEATURES = 26
BATCH = 512
BATCHES = 8  # distinct batches, cycled
TABLE_ROWS = (10**4, 10**5, 10**6, 10**7)
QUICK_TABLE_ROWS = (10**4, 10**5)
DENSE_MAX_ROWS = 10**5
RPC_ROWS = (10**5, 10**7)  # the table sizes the RPC baseline runs at (psframe's rows then also on 1 ps task)
QUICK_RPC_ROWS = (10**5,)
LEARNING_RATE = 0.05
STARTUP_S = 120.0  # the chief sends a 10^7-row table (2.56 GB) at Init


class CtrModel(torch.nn.Module):
    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(rows, DIM, sparse=sparse)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).sum(1)).squeeze(1)


VOCABULARY = 10**4  # the ids a batch draws from, whatever the table's size
HASH = 2654435761  # a prime: k -> k * HASH mod rows is a bijection for every table size here


def power_law_ids(rows: int, generator: torch.Generator) -> torch.Tensor:
    """A batch of ids: the ``k``-th most frequent drawn about as often as ``1 / (k + 1)``
    (Zipf over :data:`VOCABULARY` ids), scattered over the table as hashed features are."""
    u = torch.rand(BATCH, FEATURES, generator=generator, dtype=torch.float64)
    ranks = torch.floor(torch.exp(u * torch.log(torch.tensor(float(VOCABULARY))))).long() - 1
    return (ranks * HASH) % rows


def batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(power_law_ids(rows, generator), torch.rand(BATCH, generator=generator)) for _ in range(BATCHES)]


def partition_balance(rows: int = 10**6, ps_counts: tuple[int, ...] = (2, 4, 8), batches_drawn: int = 20
                      ) -> list[dict]:
    """Lookups per ps task of power-law batches, max over mean, for ``mod`` and ``range`` tables.

    Returns:
        One row per id numbering (``frequency-sorted``, ``hashed``), partition and ps count:
        ``imbalance`` (the busiest ps task's lookups over the mean; 1.0 is even).
    """
    from psframe.cluster.placement import VariableInfo
    from psframe.cluster.table_placement import place_tables
    from psframe.worker.slicer import Slot
    from psframe.worker.tables import Table

    generator = torch.Generator().manual_seed(11)
    u = torch.rand(batches_drawn * BATCH, FEATURES, generator=generator, dtype=torch.float64)
    ranks = (torch.floor(torch.exp(u * torch.log(torch.tensor(float(rows))))).long() - 1).flatten()
    numberings = {"frequency-sorted": ranks, "hashed": (ranks * HASH) % rows}
    out = []
    for numbering, ids in numberings.items():
        ids = ids.sort().values
        for partition in ("mod", "range"):
            for num_ps in ps_counts:
                shards = place_tables([VariableInfo("table", (rows, DIM), 4)], num_ps, partition=partition)
                table = Table("table", None, [Slot(shard, None) for shard in shards])
                loads = torch.tensor([float(p.numel()) for _, p, _ in table.split(ids)])
                out.append({"kind": "balance", "numbering": numbering, "partition": partition, "num_ps": num_ps,
                            "imbalance": float(loads.max() / loads.mean())})
    return out


def balance_table(results: list[dict]) -> str:
    headers = ["ids", "partition", "ps tasks", "busiest ps task's lookups / mean"]
    return markdown_table(headers, [[r["numbering"], r["partition"], r["num_ps"], f"{r['imbalance']:.2f}"]
                                    for r in results])


def measure_rpc(children: Children, rows: int, quick: bool, deadline: Deadline) -> dict:
    """The RPC baseline at ``rows``: its trainer's steps/s."""
    from psframe.launch import pick_free_ports

    (port,) = pick_free_ports(1)
    steps = ["--steps=40", "--warmup=5"] if quick else ["--steps=300", "--warmup=30"]
    names = [f"rpc-{rows}-ps", f"rpc-{rows}-trainer"]
    for rank, name in enumerate(names):
        children.start(name, [sys.executable, "-m", "benchmarks.baseline_rpc_sparse", f"--port={port}",
                              f"--rank={rank}", f"--rows={rows}", *steps])
    for name in reversed(names):
        code = children.wait_exit(name, deadline.remaining())
        if code != 0:
            raise BenchmarkError(f"{name} ended with {code}; its log:\n{children.log_tail(name)}")
    lines = [line for line in children.log_path(names[1]).read_text().splitlines() if line.startswith("{")]
    result = json.loads(lines[-1])
    data = batches(rows)
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in data) / len(data)
    return {"rows": rows, "way": "rpc", "num_ps": 1, "steps_per_s": result["steps_per_sec"],
            "spread": (max(result["window_rates"]) - min(result["window_rates"])) / result["steps_per_sec"],
            "distinct_rows": distinct, "rows_per_s": distinct * result["steps_per_sec"],
            "table_bytes": rows * DIM * 4, "connect_s": None}


def measure(children: Children, rows: int, sparse: bool, settings: Settings, deadline: Deadline,
            num_ps: int = 2) -> dict:
    cluster = PsCluster(children, num_ps, f"sparse-{rows}-{'rows' if sparse else 'dense'}-{num_ps}ps",
                        timeout=deadline.remaining())
    model = CtrModel(rows, sparse)
    data = batches(rows)
    distinct = sum(int(torch.unique(ids).numel()) for ids, _ in data) / len(data)
    cycle = itertools.cycle(data)
    started = time.monotonic()
    trainer = psframe.Trainer(model, cluster.cluster, optimizer=psframe.optim.Adagrad(lr=LEARNING_RATE),
                              connect_timeout=min(STARTUP_S, deadline.remaining()))
    with trainer:
        connect_s = time.monotonic() - started

        def step() -> None:
            ids, target = next(cycle)
            trainer.step(F.mse_loss(torch.sigmoid(model(ids)), target))

        rate = measure_rate(step, settings, deadline, f"{rows} rows ({'rows' if sparse else 'dense'})")
    for name in cluster.names:
        children.wait_exit(name, 15.0)
    moved = distinct if sparse else rows
    return {"rows": rows, "way": "rows" if sparse else "dense", "num_ps": num_ps, "steps_per_s": rate.per_second,
            "spread": rate.spread, "distinct_rows": distinct, "rows_per_s": moved * rate.per_second,
            "table_bytes": rows * DIM * 4, "connect_s": connect_s}


def run_sparse_benchmarks(quick: bool = False, timeout: float = 1200.0) -> list[dict]:
    """Every table size with rows, and the small ones dense; each row's ratio to the 10^4-row table's."""
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
            results.append(measure_rpc(children, rows, quick, deadline))
    base = {(r["way"], r["num_ps"]): r["steps_per_s"] for r in results if r["rows"] == min(
        q["rows"] for q in results if (q["way"], q["num_ps"]) == (r["way"], r["num_ps"]))}
    rpc = {r["rows"]: r["steps_per_s"] for r in results if r["way"] == "rpc"}
    for r in results:
        r["vs_smallest"] = base[(r["way"], r["num_ps"])] / r["steps_per_s"]  # step time over the smallest table's
        r["vs_rpc"] = r["steps_per_s"] / rpc[r["rows"]] if r["num_ps"] == 1 and r["rows"] in rpc else None
    return results + partition_balance()


def sparse_table(results: list[dict]) -> str:
    headers = ["table rows", "table", "moved", "ps tasks", "steps/s", "distinct rows/step", "rows/s each way",
               "step time vs smallest table", "vs rpc", "spread", "start-up s"]
    rows = [[f"{r['rows']:,}", f"{r['table_bytes'] / 1e6:,.1f} MB", r["way"], r["num_ps"], f"{r['steps_per_s']:.1f}",
             f"{r['distinct_rows']:,.0f}", f"{r['rows_per_s']:,.0f}", format_ratio(r["vs_smallest"]),
             format_ratio(r.get("vs_rpc")), f"{r['spread']:.0%}",
             "-" if r["connect_s"] is None else f"{r['connect_s']:.1f}"] for r in results]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^5 rows only, short repeats")
    args = parser.parse_args(argv)
    from benchmarks import report

    print(report.sparse_table(run_sparse_benchmarks(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

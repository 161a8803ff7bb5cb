"""The CTR example in DeepRec's published shape: samples/s and held-out AUC, one process against 1 ps + N workers.

    python -m benchmarks.suite.ctr_throughput [--quick]

``examples/ctr_dist.py`` (wide & deep over two embedding tables, Adagrad, a
Criteo-shaped click log of 13 dense and 26 categorical features,
``examples/ctr_data.py``) at the batch DeepRec publishes for its Criteo
models, 512 samples, with each kind of table:

- **fixed**: the ids hashed into tables of 2^17 rows (``--hash_buckets``);
- **dynamic**: ``--dynamic_tables``, the ids kept whole, a row made on
  first touch (``psframe.DynamicEmbedding``);

and each layout, on the same samples (``--train_steps`` global steps of
512: with 2 workers a global step is one worker's batch):

- **single process**: ``--single_process``, the reference (torch.optim; the
  dynamic tables' rows in ``psframe.DynamicTables``);
- **1 ps + 1 worker**, **1 ps + 2 workers**: ``psframe launch``, async
  (``--quick``: the same tasks started by the benchmark, each forked;
  :func:`benchmarks.suite.ctr.run_tasks`).

*samples/s* is the example's own figure (its chief's, or the single
process's): samples trained over the seconds of its training loop, after
start-up and before the held-out evaluation; *AUC* is then measured on
held-out samples, beside the AUC of the true click probability (the
ceiling no model can pass); *run s* is the whole run as seen from here.

Cores: every process computes on one thread (``OMP_NUM_THREADS=1``, as
:mod:`benchmarks.common` gives every child) and the ps task serves from one
process (``--serving_processes=1``), so a layout asks for one core per
process: 2 for 1 ps + 1 worker, 3 for 1 ps + 2 workers.
:func:`cores_note` says what this machine has beside them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.children import Children
from benchmarks.common import Deadline, single_thread, table_main
from benchmarks.formatting import format_number, format_ratio, markdown_table
from benchmarks.suite.ctr import EXAMPLE, against_single, result_line, run_tasks, run_whole, signed

BATCH_SIZE = 512  # DeepRec's, for its Criteo-shaped models
TABLES = ("fixed", "dynamic")
LAYOUTS = ((0, 1), (1, 1), (1, 2))  # (ps tasks, workers); 0 ps tasks: the single process


@dataclass(frozen=True)
class ThroughputCase:
    """The example's flags: ``train_steps`` global steps of ``BATCH_SIZE`` samples in every layout."""

    train_steps: int
    train_samples: int
    test_samples: int
    hash_buckets: int = 1 << 17  # the example's default

    def flags(self, tables: str) -> list[str]:
        return [
            f"--train_steps={self.train_steps}",
            f"--batch_size={BATCH_SIZE}",
            f"--train_samples={self.train_samples}",
            f"--test_samples={self.test_samples}",
            f"--hash_buckets={self.hash_buckets}",
            "--serving_processes=1",
            *(["--dynamic_tables"] if tables == "dynamic" else []),
        ]


# The log holds more samples than a run trains on (600 x 512 = 307,200), so no worker sees one twice.
FULL_CASE = ThroughputCase(train_steps=600, train_samples=400_000, test_samples=50_000)
QUICK_CASE = ThroughputCase(train_steps=40, train_samples=25_000, test_samples=4_000)


def layout_name(num_ps: int, num_workers: int) -> str:
    if not num_ps:
        return "single process"
    return f"{num_ps} ps + {num_workers} worker{'s' if num_workers > 1 else ''}"


def command(num_ps: int, num_workers: int, tables: str, case: ThroughputCase, timeout: float) -> list[str]:
    """The example's command line: the single process, or a launch of the whole cluster."""
    if not num_ps:
        return [sys.executable, str(EXAMPLE), "--single_process", *case.flags(tables)]
    return [
        sys.executable,
        "-m",
        "psframe.cli",
        "launch",
        f"--num_ps={num_ps}",
        f"--num_workers={num_workers}",
        f"--timeout={timeout:.0f}",
        str(EXAMPLE),
        "--",
        *case.flags(tables),
    ]


def run_one(
    children: Children,
    tables: str,
    num_ps: int,
    num_workers: int,
    case: ThroughputCase,
    deadline: Deadline,
    launch: bool = True,
) -> dict:
    """Run the example once; its row (without the comparisons with the single process). A cluster
    through ``psframe launch``, or, not ``launch``, its tasks started here (:func:`~benchmarks.suite.ctr.run_tasks`)."""
    name = f"ctr-{tables}-{num_ps}ps-{num_workers}w"
    started = time.monotonic()
    if launch or not num_ps:
        output = run_whole(children, name, command(num_ps, num_workers, tables, case, deadline.remaining()), deadline)
    else:
        output = run_tasks(children, name, num_ps, num_workers, case.flags(tables), deadline)
    seconds = time.monotonic() - started
    result = result_line(output, "async" if num_ps else "single_process", launched=launch)
    return {
        "kind": "ctr_throughput",
        "tables": tables,
        "layout": layout_name(num_ps, num_workers),
        "num_ps": num_ps,
        "num_workers": num_workers,
        "processes": num_ps + num_workers,
        "samples": result["global_step"] * BATCH_SIZE,
        "samples_per_sec": result["samples_per_sec"],
        "auc": result["auc"],
        "log_loss": result["log_loss"],
        "ceiling_auc": result["ceiling_auc"],
        "run_seconds": seconds,
    }


def compare(rows: list[dict]) -> list[dict]:
    """Each row :func:`~benchmarks.suite.ctr.against_single` the single process's with the same tables."""
    single = {r["tables"]: r for r in rows if not r["num_ps"]}
    return [against_single(r, single.get(r["tables"])) for r in rows]


def run_ctr_throughput(quick: bool = False, timeout: float = 900.0, case: ThroughputCase | None = None) -> list[dict]:
    """Every kind of table in every layout, one run after the other (default case:
    :data:`QUICK_CASE` or :data:`FULL_CASE`).

    Returns:
        One row per run: ``kind`` ("ctr_throughput"), ``tables``, ``layout``, ``num_ps``,
        ``num_workers``, ``processes``, ``samples``, ``samples_per_sec``, ``auc``, ``log_loss``,
        ``ceiling_auc``, ``run_seconds``, ``vs_single`` and ``auc_diff``.
    """
    single_thread()
    case = case or (QUICK_CASE if quick else FULL_CASE)
    deadline = Deadline(timeout, "CTR throughput benchmark")
    with tempfile.TemporaryDirectory(prefix="psframe-bench-ctr-") as logs, Children(Path(logs)) as children:
        rows = [
            run_one(children, tables, num_ps, num_workers, case, deadline, launch=not quick)
            for tables in TABLES
            for num_ps, num_workers in LAYOUTS
        ]
    return compare(rows)


def cores_note() -> str:
    """This machine's cores and the compute threads each process of the runs is given."""
    cores = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (
        f"Cores: os.cpu_count() = {cores}, {usable} usable by this process; OMP_NUM_THREADS={threads} here and "
        "OMP_NUM_THREADS=1 in every child: each process (the single process, the ps task with "
        "--serving_processes=1, each worker) computes on 1 core; 1 ps + 1 worker is 2 processes, "
        f"1 ps + 2 workers 3, on {usable} cores."
    )


def ctr_throughput_table(rows: list[dict]) -> str:
    """Markdown table of :func:`run_ctr_throughput` rows."""
    headers = [
        "tables",
        "layout",
        "processes (1 core each)",
        "samples",
        "samples/s",
        "vs single process",
        "AUC",
        "AUC - single process",
        "ceiling AUC",
        "run s",
    ]
    return markdown_table(
        headers,
        [
            [
                r["tables"],
                r["layout"],
                r["processes"],
                f"{r['samples']:,}",
                format_number(r["samples_per_sec"]),
                format_ratio(r["vs_single"]),
                f"{r['auc']:.4f}",
                signed(r["auc_diff"]),
                f"{r['ceiling_auc']:.4f}",
                format_number(r["run_seconds"]),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return table_main(
        argv,
        __doc__,
        "40 global steps of 512 samples in every layout",
        lambda quick: cores_note() + "\n\n" + ctr_throughput_table(run_ctr_throughput(quick)),
    )


if __name__ == "__main__":
    sys.exit(main())

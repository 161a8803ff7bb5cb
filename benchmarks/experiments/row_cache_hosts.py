"""The worker row cache where the network is the bottleneck: the CTR example on test hosts with capped links.

    python -m benchmarks.experiments.row_cache_hosts [--links 10 50] [--tables fixed dynamic]
        [--repeats 2] [--max_lag 16] [--cache_rows 1048576] [--[no-]prefetch] [--seconds 12]
        [--quick] [--logs DIR]

On loopback (2 cores) the row cache (``psframe.RowCaching``) cut the rows a
step pulls by more than half and lowered samples/s: that run is CPU-bound
(``docs/performance.md``). This one asks what the cache gives when the link
is what limits. ``examples/ctr_dist.py`` runs as 1 ps host + 2 worker hosts
(network namespaces on one bridge, each with its own ``/dev/shm``: every
byte crosses the bridge; :mod:`tests.support.hosts`), every host's link capped at
``--links`` Mbit/s each way (``tc tbf``), asynchronous, batch 512 (the batch
of :mod:`benchmarks.suite.ctr_throughput`), with each kind of table
(``fixed``: ids hashed into 2^17 rows; ``dynamic``: ``--dynamic_tables``)
in each mode, on the same samples and seeds:

- **none**: no row cache; every lookup pulls its rows from the ps task
  (``--no-prefetch_rows``: this mode is the cache's baseline);
- **max_lag S**: the row cache (``--row_cache_max_lag=S
  --row_cache_rows=N``; the example prefetches nothing then);
- **none, prefetch**: no cache, each step's push bringing the next batch's
  rows back (``--prefetch_rows``, the example's default); left out with
  ``--no-prefetch``.

A run trains about ``--seconds`` at the rate the link should allow (the
same global steps in every mode); runs are interleaved (none, cached,
prefetch, none, cached, ... ``--repeats`` rounds per link and tables), so
that a slow spell of the machine falls on every mode alike; each row of the
table is the median of its runs. ``--quick``: about 2 s of training a run,
tables of 2^14 rows, each task forked from a process on its host that imported
torch and psframe once (a smoke test).

Per row: *samples/s*, the example's own figure (its chief's: samples trained
over its whole training loop, cold cache included; every run's value
listed); *steady samples/s*, the same over the window between the chief's
first and last progress lines (from ~10% of its steps to the end); *rows
looked up / pulled per step*, the chief's (rows its lookups asked the ps
task about, and rows that came back: the example's ``rows_*_per_step``);
*ps in / out kB per step*, the bytes into and out of the ps host's ``eth0``
over the window (its interface counters, read from ``/proc/<ps pid>/net/dev``:
IP and TCP headers included) per global step -- in: both workers' requests
(pushed gradients, the ids asked for, a cache's versions), out: the replies
(rows, a cache's versions, the dense part); *ps link busy*, the busier
direction of the ps host's link over the window against the cap; *AUC*,
held-out; *vs none*, the ratio of the median samples/s to the *none* row's
on the same link and tables; *other load*, cores kept busy by work other
than the run's processes meanwhile.

One run, its processes and its measurements are
:mod:`benchmarks.experiments.row_cache_run`'s (:func:`~benchmarks.experiments.row_cache_run.run_once`);
this module runs them in rounds, takes the medians (:func:`summarize`) and
prints the table. It needs root (network namespaces); without, it says so and
exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.children import ForkServer
from benchmarks.common import ROOT
from benchmarks.experiments.row_cache_run import EXAMPLE, HOSTS, Mode, RunError, Settings, run_once
from benchmarks.formatting import format_number, format_ratio, markdown_table

LINKS_MBIT = (10, 50)
TABLES = ("fixed", "dynamic")
MAX_LAG = 16
CACHE_ROWS = 1 << 20  # per table: more than a fixed table's 2^17 rows and the ids a run touches


def modes(max_lag: int, prefetch: bool) -> list[Mode]:
    """The modes of each round, in order: none, cached, and prefetched where asked for."""
    return [Mode(), Mode(max_lag), *([Mode(prefetch=True)] if prefetch else [])]


# The log holds more samples than a worker trains on at 50 Mbit/s (~280 global steps of 512).
FULL = Settings(
    seconds=12.0, train_samples=150_000, test_samples=10_000, hash_buckets=1 << 17, run_timeout=240.0, min_steps=30
)
QUICK = Settings(
    seconds=2.0,
    train_samples=20_000,
    test_samples=2_000,
    hash_buckets=1 << 14,
    run_timeout=90.0,
    min_steps=12,
    fork=True,
)


def run_experiment(
    links: Sequence[float],
    tables: Sequence[str],
    repeats: int,
    max_lag: int,
    cache_rows: int,
    settings: Settings,
    timeout: float,
    keep_logs: Path | None = None,
    prefetch: bool = True,
) -> list[dict]:
    """Every (link, tables) in every mode of :func:`modes`, ``repeats`` interleaved rounds; one dict per run.

    A run that fails is a dict with its ``error`` and the others still run; once ``timeout``
    seconds would pass, the next run is such a dict and no more are started.

    Raises:
        tests.support.hosts.HostsError: the hosts cannot be made.
    """
    from tests.support.hosts import HostSet

    if repeats < 1:
        raise ValueError(f"repeats ({repeats}) must be >= 1")
    end = time.monotonic() + timeout
    runs: list[dict] = []
    with HostSet(list(HOSTS)) as hosts, contextlib.ExitStack() as stack:
        servers = {
            host: stack.enter_context(ForkServer(popen=functools.partial(hosts.popen, host)))
            for host in (HOSTS if settings.fork else ())
        }
        for link in links:
            for host in HOSTS:
                hosts.cap(host, link)
            for kind in tables:
                for _ in range(repeats):
                    for mode in modes(max_lag, prefetch):
                        left = end - time.monotonic()
                        what = {"link_mbit": link, "tables": kind, "mode": mode.name}
                        if left < 10:
                            runs.append({**what, "error": f"not run: the deadline ({timeout:g} s) passed"})
                            return runs
                        run_settings = replace(settings, run_timeout=min(settings.run_timeout, left))
                        try:
                            run = run_once(hosts, link, kind, mode, cache_rows, run_settings, keep_logs, servers)
                        except RunError as e:
                            run = {**what, "error": str(e)}
                        runs.append(run)
                        print(f"[row_cache_hosts] {_describe(run)}", file=sys.stderr, flush=True)
    return runs


def _describe(run: dict) -> str:
    if "error" in run:
        return f"{run['link_mbit']:g} Mbit/s {run['tables']} row cache {run['mode']}: FAILED: {run['error']}"
    return (
        f"{run['link_mbit']:g} Mbit/s {run['tables']} row cache {run['mode']}: {run['samples_per_sec']:.0f} "
        f"samples/s, {run['rows_pulled_per_step']:.0f} of {run['rows_looked_up_per_step']:.0f} rows pulled/step, "
        f"AUC {run['auc']:.4f}, {run['run_seconds']:.0f} s"
    )


def summarize(runs: Sequence[dict]) -> list[dict]:
    """One row per (link, tables, mode): the medians of its runs that worked, every run's samples/s
    (None: failed), and the ratio of its median samples/s to the *none* row's with the same link
    and tables."""
    keys = list(dict.fromkeys((r["link_mbit"], r["tables"], r["mode"]) for r in runs))
    rows = []
    for key in keys:
        mine = [r for r in runs if (r["link_mbit"], r["tables"], r["mode"]) == key]

        def med(name: str, mine: list[dict] = mine) -> float | None:
            values = [r[name] for r in mine if "error" not in r and r.get(name) is not None]
            return statistics.median(values) if values else None

        rows.append(
            {
                "link_mbit": key[0],
                "tables": key[1],
                "mode": key[2],
                "runs": len(mine),
                "run_rates": [r.get("samples_per_sec") for r in mine],
                "errors": [r["error"] for r in mine if "error" in r],
                **{
                    name: med(name)
                    for name in (
                        "samples_per_sec",
                        "steady_samples_per_sec",
                        "rows_looked_up_per_step",
                        "rows_pulled_per_step",
                        "ps_in_bytes_per_step",
                        "ps_out_bytes_per_step",
                        "ps_link_busy",
                        "auc",
                        "other_load",
                    )
                },
                "train_steps": next((r["train_steps"] for r in mine if "train_steps" in r), None),
            }
        )
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if (r["link_mbit"], r["tables"], r["mode"]) == (row["link_mbit"], row["tables"], Mode().name)
            ),
            None,
        )
        rate, base_rate = row["samples_per_sec"], None if base is None else base["samples_per_sec"]
        row["vs_none"] = None if row is base or not rate or not base_rate else rate / base_rate
    return rows


def table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`summarize` rows."""
    headers = [
        "link",
        "tables",
        "row cache",
        "steps",
        "samples/s",
        "runs' samples/s",
        "steady samples/s",
        "rows looked up / step",
        "rows pulled / step",
        "ps in kB / step",
        "ps out kB / step",
        "ps link busy",
        "AUC",
        "vs none",
        "other load",
    ]

    def kb(value: float | None) -> str:
        return "-" if value is None else f"{value / 1000:,.0f}"

    def count(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    return markdown_table(
        headers,
        [
            [
                f"{r['link_mbit']:g} Mbit/s",
                r["tables"],
                r["mode"],
                count(r["train_steps"]),
                format_number(r["samples_per_sec"]),
                " / ".join("failed" if v is None else f"{v:,.0f}" for v in r["run_rates"]),
                format_number(r["steady_samples_per_sec"]),
                count(r["rows_looked_up_per_step"]),
                count(r["rows_pulled_per_step"]),
                kb(r["ps_in_bytes_per_step"]),
                kb(r["ps_out_bytes_per_step"]),
                "-" if r["ps_link_busy"] is None else f"{r['ps_link_busy']:.2f}",
                "-" if r["auc"] is None else f"{r['auc']:.4f}",
                format_ratio(r["vs_none"]),
                "-" if r["other_load"] is None else f"{r['other_load']:.2f}",
            ]
            for r in rows
        ],
    )


def machine_facts() -> str:
    """The date, this machine's cores and load, as a line above the table."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"{when}; os.cpu_count() = {os.cpu_count()}; load average (1, 5, 15 min) {load}"


def source_facts() -> str:
    """The commit checked out and the files of psframe and the example changed since (read-only git)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "psframe", str(EXAMPLE.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "source: not a git checkout"
    files = [line[3:] for line in changed if line.strip()]
    return f"source: commit {commit}; uncommitted changes in psframe/ and the example: {', '.join(files) or 'none'}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", type=float, default=list(LINKS_MBIT), help="link caps in Mbit/s")
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of runs in every mode, interleaved")
    parser.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a third mode, no cache and rows prefetched (where the example has --prefetch_rows)",
    )
    parser.add_argument("--max_lag", type=int, default=MAX_LAG, help="the cached runs' --row_cache_max_lag")
    parser.add_argument("--cache_rows", type=int, default=CACHE_ROWS, help="the cached runs' --row_cache_rows")
    parser.add_argument("--seconds", type=float, default=None, help="about this many seconds of training per run")
    parser.add_argument("--quick", action="store_true", help="a few seconds of training per run, small tables")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds the whole experiment may take")
    parser.add_argument("--logs", type=Path, default=None, help="keep every task's log in this folder")
    args = parser.parse_args(argv)
    from tests.support.hosts import HostsError, hosts_unavailable

    reason = hosts_unavailable()
    if reason:
        print(f"benchmarks.experiments.row_cache_hosts cannot make test hosts here: {reason}", file=sys.stderr)
        return 1
    settings = QUICK if args.quick else FULL
    if args.seconds is not None:
        settings = replace(settings, seconds=args.seconds)
    print("`" + shlex.join(["python", "-m", "benchmarks.experiments.row_cache_hosts", *(argv or sys.argv[1:])]) + "`")
    print(machine_facts() + " (at the start)")
    print(source_facts() + " (at the start)")
    try:
        runs = run_experiment(
            args.links,
            args.tables,
            args.repeats,
            args.max_lag,
            args.cache_rows,
            settings,
            args.timeout,
            args.logs,
            args.prefetch,
        )
    except HostsError as e:
        print(f"benchmarks.experiments.row_cache_hosts: the test hosts failed: {e}", file=sys.stderr)
        return 1
    print(machine_facts() + " (at the end)")
    print(source_facts() + " (at the end)")
    print()
    print(table(summarize(runs)))
    failed = [r for r in runs if "error" in r]
    if failed:
        print(f"\n{len(failed)} of {len(runs)} runs failed (their errors are above, on stderr)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

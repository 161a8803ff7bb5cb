"""The row-cache experiment on test hosts runs end to end: ``benchmarks.experiments.row_cache_hosts --quick``.

One capped link, both kinds of table, the cache off and on once each (no
prefetching mode). The
oracles are properties, not timings: every row is there with positive
samples/s and an AUC in (0.5, 1], and the cached rows pull strictly fewer
rows per step than the uncached ones on the same link and tables.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hosts import require_hosts

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 85  # four runs of a few seconds' training, each with its start-up
LINK_MBIT = 50
TABLES = ("fixed", "dynamic")
MAX_LAG = 16

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(TIMEOUT_S + 30)]


def _table(stdout: str) -> list[dict[str, str]]:
    """The markdown table's rows as dicts by header."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert len(lines) >= 2, stdout
    headers = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    return [dict(zip(headers, (c.strip() for c in line.strip().strip("|").split("|")))) for line in lines[2:]]


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_quick_run_has_every_row_and_the_cache_pulls_fewer_rows():
    require_hosts()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    argv = [
        sys.executable,
        "-m",
        "benchmarks.experiments.row_cache_hosts",
        "--quick",
        "--links",
        str(LINK_MBIT),
        "--tables",
        *TABLES,
        "--repeats",
        "1",
        "--max_lag",
        str(MAX_LAG),
        "--no-prefetch",  # the cache and its baseline only: four runs
        "--timeout",
        str(TIMEOUT_S - 5),
    ]
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # subprocess.run kills the child (by PID) first
        pytest.fail(f"the experiment took over {TIMEOUT_S}s; stderr:\n{e.stderr}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-5000:]}"
    assert "os.cpu_count()" in proc.stdout and "load average" in proc.stdout, proc.stdout
    rows = _table(proc.stdout)
    caches = ("none", f"max_lag {MAX_LAG}")
    assert [(r["link"], r["tables"], r["row cache"]) for r in rows] == [
        (f"{LINK_MBIT} Mbit/s", tables, cache) for tables in TABLES for cache in caches
    ], proc.stdout
    for row in rows:
        assert _number(row["samples/s"]) > 0, row
        assert 0.5 < _number(row["AUC"]) <= 1.0, row
        assert _number(row["rows pulled / step"]) <= _number(row["rows looked up / step"]), row
    for tables in TABLES:
        off, on = (next(r for r in rows if (r["tables"], r["row cache"]) == (tables, cache)) for cache in caches)
        assert _number(on["rows pulled / step"]) < _number(off["rows pulled / step"]), (off, on)
        assert _number(off["rows pulled / step"]) == _number(off["rows looked up / step"]), off  # no cache
        assert on["vs none"].endswith("x") and off["vs none"] == "-", (off, on)

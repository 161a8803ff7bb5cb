"""One run of the row-cache experiment: the CTR example on the capped test hosts, watched and measured.

:func:`run_once` starts ``examples/ctr_dist.py`` as 1 ps + 2 workers on the
hosts of a :class:`tests.support.hosts.HostSet` (:data:`HOSTS`), in one :class:`Mode`
and at the size of its :class:`Settings`; while it trains it samples the ps
host's interface counters (``/proc/<pid>/net/dev``), and when it is done it
reads the chief's JSON result and progress lines. Its row: the example's own
figures, and what :func:`window_figures` makes of the chief's steady window
(samples/s, wire bytes per step, how busy the ps link was).
:mod:`benchmarks.experiments.row_cache_hosts` runs it in rounds and reports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from benchmarks.children import ForkedProcess, ForkServer
from benchmarks.common import ROOT, child_env
from benchmarks.suite.processes import load_mark, other_load_since

EXAMPLE = ROOT / "examples" / "ctr_dist.py"
BATCH_SIZE = 512  # benchmarks.suite.ctr_throughput's: DeepRec's for its Criteo-shaped models
HOSTS = {"ps0": ("ps", 0), "w0": ("worker", 0), "w1": ("worker", 1)}  # host: (job, task index)
PORT = 2222  # every host is a namespace of its own: the ports never clash
# Bytes through the ps host's busier direction (into it: the pushes) per global step, to size runs
# by (measured: 420-520 kB, tables of 2^17 rows, every mode); the global steps/s the CPUs allow.
GUESS_BYTES_PER_STEP = 450_000
CPU_STEPS_PER_SEC = 60.0
_POLL_S = 0.1
_KILL_WAIT_S = 10.0
# The chief's progress line (ctr_dist.py), after logging's asctime "2026-05-09 14:35:19,123".
_PROGRESS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*worker 0: local step (\d+) global step (\d+),", re.M)


@dataclass(frozen=True)
class Mode:
    """How a run's workers get their rows: through a row cache of ``max_lag`` (None: none), prefetched or not."""

    max_lag: int | None = None
    prefetch: bool = False

    @property
    def name(self) -> str:
        if self.max_lag is not None:
            return f"max_lag {self.max_lag}"
        return "none, prefetch" if self.prefetch else "none"

    def flags(self, cache_rows: int) -> list[str]:
        """The example's flags for this mode."""
        cache = [] if self.max_lag is None else [f"--row_cache_max_lag={self.max_lag}"]
        cache += [f"--row_cache_rows={cache_rows}"] if cache else []
        return [*cache, "--prefetch_rows" if self.prefetch else "--no-prefetch_rows"]


class RunError(RuntimeError):
    """A task of a run failed, printed no result, or ran past its deadline."""


@dataclass(frozen=True)
class Settings:
    """How big each run is."""

    seconds: float  # about this many seconds of training per run, at the guessed rate
    train_samples: int
    test_samples: int
    hash_buckets: int
    run_timeout: float  # seconds one run may take, start-up and evaluation included
    min_steps: int
    # Fork each task from a fork server on its host (benchmarks.children.ForkServer), which imported
    # torch and psframe once: the smoke test's tasks live seconds, most of them spent importing.
    fork: bool = False

    def train_steps(self, link_mbit: float) -> int:
        """Global steps of a run on a link of ``link_mbit``: about :attr:`seconds` of training."""
        rate = min(CPU_STEPS_PER_SEC, link_mbit * 1e6 / 8 / GUESS_BYTES_PER_STEP)
        return max(self.min_steps, round(self.seconds * rate))


def example_flags(tables: str, mode: Mode, cache_rows: int, steps: int, settings: Settings) -> list[str]:
    """The example's flags every task of one run gets (but the cluster's)."""
    chief_steps = max(1, steps // len([h for h in HOSTS.values() if h[0] == "worker"]))
    return [
        f"--train_steps={steps}",
        f"--batch_size={BATCH_SIZE}",
        f"--train_samples={settings.train_samples}",
        f"--test_samples={settings.test_samples}",
        f"--hash_buckets={settings.hash_buckets}",
        "--serving_processes=1",
        "--seed=0",
        # ~10 progress lines from the chief: the first after ~10% of its steps (the window's start).
        f"--log_every={max(1, chief_steps // 10)}",
        *(["--dynamic_tables"] if tables == "dynamic" else []),
        *mode.flags(cache_rows),
    ]


def _net_dev(pid: int, interface: str = "eth0") -> tuple[int, int] | None:
    """(rx, tx) bytes of ``interface`` in process ``pid``'s network namespace; None once it is gone."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            for line in f:
                name, _, fields = line.partition(":")
                if name.strip() == interface:
                    values = fields.split()
                    return int(values[0]), int(values[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _interpolate(trace: Sequence[tuple[float, int, int]], t: float) -> tuple[float, float] | None:
    """(rx, tx) at time ``t`` between the samples around it; None outside the trace."""
    if not trace or t < trace[0][0] or t > trace[-1][0]:
        return None
    for (t0, rx0, tx0), (t1, rx1, tx1) in zip(trace, trace[1:]):
        if t0 <= t <= t1:
            f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
            return rx0 + f * (rx1 - rx0), tx0 + f * (tx1 - tx0)
    return float(trace[-1][1]), float(trace[-1][2])


def _line_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def window_figures(chief_log: str, trace: Sequence[tuple[float, int, int]], link_mbit: float) -> dict:
    """Steady samples/s, wire bytes per global step and the ps link's busier direction's use,
    between the chief's first and last progress lines; empty where fewer than two lines or
    counter samples bracket them."""
    lines = [(_line_time(m.group(1)), int(m.group(3))) for m in _PROGRESS.finditer(chief_log)]
    if len(lines) < 2 or lines[-1][1] <= lines[0][1] or lines[-1][0] <= lines[0][0]:
        return {}
    (t0, g0), (t1, g1) = lines[0], lines[-1]
    out = {"steady_samples_per_sec": (g1 - g0) * BATCH_SIZE / (t1 - t0)}
    start, end = _interpolate(trace, t0), _interpolate(trace, t1)
    if start is not None and end is not None:
        rx, tx = end[0] - start[0], end[1] - start[1]
        out["ps_in_bytes_per_step"] = rx / (g1 - g0)
        out["ps_out_bytes_per_step"] = tx / (g1 - g0)
        out["ps_link_busy"] = max(rx, tx) / (t1 - t0) / (link_mbit * 1e6 / 8)
    return out


def run_once(
    hosts,
    link_mbit: float,
    tables: str,
    mode: Mode,
    cache_rows: int,
    settings: Settings,
    keep_logs: Path | None = None,
    servers: dict[str, ForkServer] | None = None,
) -> dict:
    """One run of the example on ``hosts`` (a :class:`tests.support.hosts.HostSet` of :data:`HOSTS`): its row
    (the tasks' logs copied into ``keep_logs`` if given; each task forked by its host's server of
    ``servers`` where there is one)."""
    steps = settings.train_steps(link_mbit)
    flags = example_flags(tables, mode, cache_rows, steps, settings)
    cluster = [
        f"--ps_hosts={hosts.address('ps0')}:{PORT}",
        f"--worker_hosts={hosts.address('w0')}:{PORT},{hosts.address('w1')}:{PORT}",
    ]
    mark, started = load_mark(), time.monotonic()
    deadline = started + settings.run_timeout
    procs: dict[str, subprocess.Popen | ForkedProcess] = {}
    trace: list[tuple[float, int, int]] = []
    with tempfile.TemporaryDirectory(prefix="psframe-row-cache-hosts-") as tmp:
        logs = {host: Path(tmp, f"{host}.log") for host in HOSTS}
        try:
            for host, (job, index) in HOSTS.items():
                argv = [sys.executable, str(EXAMPLE), *cluster, f"--job_name={job}", f"--task_index={index}", *flags]
                with open(logs[host], "w") as out:
                    streams = {"stdout": out, "stderr": subprocess.STDOUT, "stdin": subprocess.DEVNULL}
                    server = (servers or {}).get(host)
                    forked = server.start(argv, **streams, env=child_env()) if server else None
                    procs[host] = forked or hosts.popen(host, argv, **streams, env=child_env())
            while True:
                if procs["ps0"].poll() is None:
                    counters = _net_dev(procs["ps0"].pid)
                    if counters is not None:
                        trace.append((time.time(), *counters))
                codes = {host: proc.poll() for host, proc in procs.items()}
                failed = {host: code for host, code in codes.items() if code not in (None, 0)}
                if failed:
                    raise RunError(f"{failed} exited non-zero:\n{_tails(logs)}")
                if all(code == 0 for code in codes.values()):
                    break
                if time.monotonic() >= deadline:
                    running = [host for host, code in codes.items() if code is None]
                    raise RunError(f"{running} still ran after {settings.run_timeout:g} s:\n{_tails(logs)}")
                time.sleep(_POLL_S)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()  # by PID; HostSet.close is the backstop
            for proc in procs.values():
                try:
                    proc.wait(timeout=_KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    print(f"[row_cache_hosts] pid {proc.pid} outlived SIGKILL", file=sys.stderr)
        chief_log = logs["w0"].read_text(errors="replace")
        if keep_logs is not None:
            name = f"{link_mbit:g}mbit-{tables}-{re.sub(r'[^a-z0-9]', '', mode.name)}-{time.time():.0f}"
            for host, path in logs.items():
                shutil.copy(path, keep_logs / f"{name}-{host}.log")
    result = _last_json(chief_log)
    if result is None:
        raise RunError(f"the chief printed no JSON result:\n{chief_log[-3000:]}")
    return {
        "link_mbit": link_mbit,
        "tables": tables,
        "mode": mode.name,
        "train_steps": steps,
        "global_step": result["global_step"],
        "samples_per_sec": result["samples_per_sec"],
        "rows_looked_up_per_step": result["rows_looked_up_per_step"],
        "rows_pulled_per_step": result["rows_pulled_per_step"],
        "auc": result["auc"],
        "run_seconds": time.monotonic() - started,
        "other_load": other_load_since(mark),
        **window_figures(chief_log, trace, link_mbit),
    }


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _tails(logs: dict[str, Path], lines: int = 15) -> str:
    return "\n".join(
        f"--- {host}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        for host, path in logs.items()
    )

"""Shared helpers of the benchmarks: settings, deadlines, timing, a child's environment, units.

Only the standard library is imported here, so the raw gRPC echo server
(:mod:`benchmarks.baselines.raw_grpc`) runs in a process without torch or
psframe, and the TensorFlow baseline (:mod:`benchmarks.baselines.tf_ps`) in an
environment that has neither. Numbers and tables are made in
:mod:`benchmarks.formatting`.

Conventions used by every benchmark:

- sizes of payloads are binary (``4 KiB``, ``64 MiB``); throughput is decimal
  (``GB/s`` = 10**9 bytes per second), each way: a round trip of an N-byte
  request and an N-byte response at R round trips/s moves N*R bytes each way;
- a rate is the median of several repeats, each timed after a warm-up;
- every wait has a deadline (:class:`Deadline`), and every child process is
  killed by its PID when the benchmark that started it ends
  (:class:`benchmarks.children.Children`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent

KiB = 1024
MiB = 1024 * KiB
GB = 10**9  # throughput unit (decimal), as network speeds are quoted
MB = 10**6

FULL_SIZES = (4 * KiB, 320 * KiB, 4 * MiB, 64 * MiB)
QUICK_SIZES = (4 * KiB, 320 * KiB)


class BenchmarkError(RuntimeError):
    """A benchmark could not run (a child died, a deadline passed, a bad reply)."""


# --------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """How long and how often to measure.

    Args:
        quick: the smoke-test mode (tiny sizes, few repeats).
        sizes: payload sizes in bytes.
        repeats: timed repeats per measurement; the median is reported.
        target_seconds: aim for repeats of about this long (more calls per
            repeat for small payloads).
        min_calls: calls per repeat at least, however slow each one is.
        warmup_calls: untimed calls before the repeats, at least...
        warmup_seconds: ...and for at least this long.
    """

    quick: bool
    sizes: tuple[int, ...]
    repeats: int
    target_seconds: float
    min_calls: int
    warmup_calls: int
    warmup_seconds: float
    max_calls: int = 20_000

    @classmethod
    def for_mode(cls, quick: bool) -> Settings:
        if quick:
            return cls(
                quick=True,
                sizes=QUICK_SIZES,
                repeats=3,
                target_seconds=0.05,
                min_calls=2,
                warmup_calls=2,
                warmup_seconds=0.02,
            )
        return cls(
            quick=False,
            sizes=FULL_SIZES,
            repeats=5,
            target_seconds=0.5,
            min_calls=3,
            warmup_calls=3,
            warmup_seconds=0.3,
        )

    def describe(self) -> str:
        return (
            f"median of {self.repeats} repeats of at least {self.min_calls} calls and about "
            f"{self.target_seconds:g} s each, after at least {self.warmup_calls} warm-up calls "
            f"and {self.warmup_seconds:g} s of warm-up"
        )


class Deadline:
    """A point in time that a benchmark must not run past.

    Args:
        seconds: how long from now.
        what: what is being waited for, for the error message.
    """

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.start = time.monotonic()
        self.end = self.start + seconds

    def remaining(self, floor: float = 0.1) -> float:
        """Seconds left (at least ``floor``, so it can be passed as a timeout)."""
        return max(floor, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def check(self, doing: str = "") -> None:
        """Raise :class:`BenchmarkError` once the deadline has passed."""
        if self.expired():
            raise BenchmarkError(
                f"{self.what}: deadline of {self.seconds:g}s passed" + (f" while {doing}" if doing else "")
            )


# ----------------------------------------------------------------------- timing


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of nothing")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Rate:
    """Calls per second: the median of the timed repeats, and each of them."""

    per_second: float
    samples: list[float] = field(default_factory=list)
    calls_per_repeat: int = 0

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats: how stable the measurement was."""
        if not self.samples or not self.per_second:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.per_second


def measure_rate(call: Callable[[], object], settings: Settings, deadline: Deadline, doing: str = "") -> Rate:
    """Time ``call`` (one round trip): warm up, then ``settings.repeats`` repeats.

    The number of calls per repeat is chosen from the warm-up so that a repeat
    lasts about ``settings.target_seconds`` (at least ``settings.min_calls``).

    Returns:
        The median rate over the repeats (warm-up excluded).

    Raises:
        BenchmarkError: ``deadline`` passed (checked between calls of the warm-up
            and between repeats).
    """
    durations = []
    warm_start = time.perf_counter()
    while len(durations) < settings.warmup_calls or time.perf_counter() - warm_start < settings.warmup_seconds:
        deadline.check(f"warming up {doing}")
        t = time.perf_counter()
        call()
        durations.append(time.perf_counter() - t)
    # The first calls pay for connections and caches: estimate from the later ones.
    per_call = median(durations[len(durations) // 2 :]) or 1e-6
    calls = int(min(settings.max_calls, max(settings.min_calls, math.ceil(settings.target_seconds / per_call))))
    samples = []
    for _ in range(settings.repeats):
        deadline.check(f"timing {doing}")
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append(calls / (time.perf_counter() - start))
    return Rate(median(samples), samples, calls)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None where either is missing or not a number, or base is 0."""
    if value is None or not base or math.isnan(value) or math.isnan(base):
        return None
    return value / base


def gb_per_second(nbytes: int, per_second: float) -> float:
    """Decimal GB/s moved each way by ``per_second`` round trips of ``nbytes`` each way."""
    return nbytes * per_second / GB


def single_thread() -> None:
    """One compute thread in this process (and, through the environment, its children)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


# ------------------------------------------------- shared by the training children

NUM_WINDOWS = 5  # pieces of a training run's timed window; the median piece's rate is reported


def timed_windows(
    times: Sequence[float], counts: Sequence[int], start_count: int, num_windows: int = NUM_WINDOWS
) -> dict:
    """Rates over the records from the first one whose count reached ``start_count``.

    Args:
        times: ``time.perf_counter()`` after each step, in order.
        counts: the step counter (global or local) at those times.
        start_count: the count at which warm-up is over.
        num_windows: how many pieces the timed records are cut into.

    Returns:
        ``steps_per_sec`` (the median piece's rate), ``window_rates``,
        ``overall_steps_per_sec``, ``steps`` and ``seconds`` of the whole window,
        and ``window``: its first and last ``time.perf_counter()``.

    Raises:
        ValueError: fewer than two records after warm-up.
    """
    first = next((i for i, c in enumerate(counts) if c >= start_count), len(counts))
    t, c = list(times[first:]), list(counts[first:])
    if len(t) < 2:
        raise ValueError(
            f"only {len(t)} step(s) recorded after warm-up (count {start_count}); {len(counts)} in all: run more steps"
        )
    pieces = min(num_windows, len(t) - 1)
    bounds = [round(j * (len(t) - 1) / pieces) for j in range(pieces + 1)]
    rates = [(c[b] - c[a]) / (t[b] - t[a]) for a, b in zip(bounds, bounds[1:]) if t[b] > t[a]]
    seconds = t[-1] - t[0]
    return {
        "steps_per_sec": statistics.median(rates) if rates else math.nan,
        "window_rates": [round(r, 2) for r in rates],
        "overall_steps_per_sec": (c[-1] - c[0]) / seconds if seconds > 0 else math.nan,
        "steps": c[-1] - c[0],
        "seconds": seconds,
        "window": [t[0], t[-1]],
    }


def file_barrier(directory: str, name: str, count: int, timeout: float) -> None:
    """Wait until ``count`` processes called this with the same ``directory``.

    Raises:
        TimeoutError: after ``timeout`` seconds, naming who arrived.
    """
    path = Path(directory)
    (path / f"ready-{name}").touch()
    deadline = time.monotonic() + timeout
    while True:
        arrived = sorted(p.name[len("ready-") :] for p in path.glob("ready-*"))
        if len(arrived) >= count:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"start barrier: {len(arrived)} of {count} processes arrived ({', '.join(arrived)}) after {timeout:g}s"
            )
        time.sleep(0.01)


def emit(result: dict) -> None:
    """Print the one JSON line the parent reads."""
    print(json.dumps(result), flush=True)


# -------------------------------------------------------------- child processes


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: one compute thread, unbuffered, psframe importable."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        **(extra or {}),
    }


# ------------------------------------------------------------------ the examples


def example_module(name: str) -> ModuleType:
    """``examples/<name>.py`` imported (the examples' folder on ``sys.path``, as when one is run:
    an example imports its neighbours, e.g. ``ctr_dist`` imports ``ctr_data``)."""
    folder = str(ROOT / "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


# ------------------------------------------------------------------ command line


def table_main(argv: Sequence[str] | None, doc: str, quick_help: str, table_of: Callable[[bool], str]) -> int:
    """The command line of a benchmark module that prints one report table:
    ``--quick`` (described by ``quick_help``) is passed to ``table_of``, whose table is printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args(argv)
    print(table_of(args.quick))
    return 0

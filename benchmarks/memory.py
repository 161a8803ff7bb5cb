"""What a ps task costs in memory, against what it holds.

One ps process (``psframe server``) per case: the worker (this process)
creates float32 variables of the given total size, in parts of the size the
trainer's placement makes (``DEFAULT_MAX_SHARD_BYTES``), with an optimizer
that keeps state (SGD with momentum: one buffer per variable; Adam: two),
then runs a few push+pull steps of every variable, sent as the trainer sends
them (requests of at most that size, on one stream). Then:

- **bytes held**: variables plus optimizer state, as the ps reports it
  (``TaskInfo.bytes_held``);
- **peak RSS**: the ps process's high-water mark of resident memory
  (``VmHWM`` of ``/proc/PID/status``; where that is missing, the largest
  RSS sampled with psutil every 10 ms);
- **baseline RSS**: the ps process's RSS once it serves, before any variable;
- **peak after init**: the high-water mark once the variables exist, before
  the first step (does the peak come from creating them, or from training?);
- **within limit**: peak RSS <= 1.3 x bytes held + 300 MB.

    python -m benchmarks.memory [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from psframe import optim
from psframe.optim import OptimizerSpec
from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES

from benchmarks.common import MB, Children, Deadline, MiB, format_bytes, single_thread
from benchmarks.transport import PsCluster, create_variables, push_pull, shard_requests

TENSOR_BYTES = DEFAULT_MAX_SHARD_BYTES  # the trainer's parts
LIMIT_FACTOR = 1.3
LIMIT_OVERHEAD = 300 * MB

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "SGD(momentum=0.9)": optim.SGD(lr=1e-3, momentum=0.9),
    "Adam": optim.Adam(lr=1e-3),
}


@dataclass(frozen=True)
class MemoryCase:
    """Variables of ``variable_bytes`` in total, updated by ``optimizer``."""

    variable_bytes: int
    optimizer: str  # a key of OPTIMIZERS

    @property
    def name(self) -> str:
        return f"mem-{self.variable_bytes // MiB}MiB-{self.optimizer.split('(')[0]}"


def cases_for(quick: bool) -> list[MemoryCase]:
    if quick:
        return [MemoryCase(16 * MiB, "SGD(momentum=0.9)")]
    return [MemoryCase(size, opt) for size in (80 * MiB, 400 * MiB) for opt in OPTIMIZERS]


class RssSampler:
    """The largest RSS of a process seen by sampling it every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self._process = psutil.Process(pid)
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.peak = max(self.peak, self._process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


def vm_hwm(pid: int) -> int | None:
    """The peak resident set size of ``pid`` in bytes (Linux ``VmHWM``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                value, unit = line.split()[1:3]
                return int(value) * {"kB": 1024, "mB": 1024**2}.get(unit, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def measure_case(children: Children, case: MemoryCase, steps: int, deadline: Deadline) -> dict:
    """Start one ps, fill it, train it ``steps`` steps, and read its memory."""
    cluster = PsCluster(children, 1, case.name, deadline.remaining() + 60)
    client = cluster.connect(deadline)
    pid = cluster.procs[0].pid
    reported_pid = client.get_info(0).pid
    if reported_pid != pid:  # `python -m psframe.cli` serves in the started process itself
        print(f"[bench] warning: ps reports pid {reported_pid}, started pid {pid}; measuring the former",
              file=sys.stderr)
        pid = reported_pid
    baseline = psutil.Process(pid).memory_info().rss
    sampler = RssSampler(pid)
    try:
        count = case.variable_bytes // TENSOR_BYTES
        values = [[(f"w{i}", torch.full((TENSOR_BYTES // 4,), 0.5)) for i in range(count)]]
        create_variables(client, values, OPTIMIZERS[case.optimizer])
        del values
        init_peak = vm_hwm(pid)
        grads = shard_requests([[(f"w{i}", torch.full((TENSOR_BYTES // 4,), 1e-3)) for i in range(count)]])
        start = time.perf_counter()
        for _ in range(steps):
            deadline.check(f"stepping {case.name}")
            pulled = push_pull(client, grads)
            del pulled
        seconds_per_step = (time.perf_counter() - start) / steps
        info = client.get_info(0)
        peak = vm_hwm(pid)
    finally:
        sampled = sampler.stop()
    source = "VmHWM"
    if peak is None:
        peak, source = sampled, "sampled"
        init_peak = None  # not known without VmHWM
    cluster.finish()
    limit = LIMIT_FACTOR * info.bytes_held + LIMIT_OVERHEAD
    return {
        "system": "psframe ps",
        "variables": format_bytes(case.variable_bytes),
        "variable_bytes": case.variable_bytes,
        "optimizer": case.optimizer,
        "steps": steps,
        "bytes_held": info.bytes_held,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak_rss_after_init": init_peak,
        "peak_source": source,
        "sampled_peak_rss": sampled,
        "limit": limit,
        "within_limit": peak <= limit,
        "seconds_per_step": seconds_per_step,
    }


def run_memory_benchmarks(quick: bool = False, timeout: float = 900.0) -> list[dict]:
    """Measure every memory case (one ps process at a time).

    Returns:
        One row per case: ``system``, ``variables``, ``variable_bytes``,
        ``optimizer``, ``steps``, ``bytes_held``, ``baseline_rss``,
        ``peak_rss``, ``peak_rss_after_init``, ``peak_source``, ``sampled_peak_rss``, ``limit``,
        ``within_limit``, ``seconds_per_step``.
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "ps memory benchmark")
    steps = 2 if quick else 5
    rows = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-memory-") as logs, Children(logs) as children:
        for case in cases_for(quick):
            rows.append(measure_case(children, case, steps, deadline))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case")
    args = parser.parse_args(argv)
    from benchmarks import report

    print(report.memory_table(run_memory_benchmarks(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

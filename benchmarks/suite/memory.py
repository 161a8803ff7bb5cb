"""What a ps task costs in memory, against what it holds.

One ps task (``psframe server``) per case: the worker (this process) creates
float32 variables of the given total size, in parts of the size the
trainer's placement makes (``DEFAULT_MAX_SHARD_BYTES``), with an optimizer
that keeps state (SGD with momentum: one buffer per variable; Adam: two),
then runs a few push+pull steps of every variable, sent as the trainer sends
them (requests of at most that size, on one stream). Then:

- **bytes held**: variables plus optimizer state, as the ps reports it
  (``TaskInfo.bytes_held``);
- **peak memory**: with one serving process, its high-water mark of resident
  memory (``VmHWM`` of ``/proc/PID/status``; where that is missing, the
  largest RSS sampled with psutil every 10 ms). With K serving processes
  (``--serving_processes``) the variables and optimizer state live in shared
  memory that every one of them maps, and each one's RSS counts all of it:
  their memory is the largest sum of their proportional set sizes (PSS:
  a shared page counts 1/n in each of the n processes that map it) sampled
  every 10 ms;
- **baseline**: the same once the task serves, before any variable;
- **idle ps**: the peak memory of a ps task that holds one 4 KiB variable
  with the same optimizer and serving processes, after the same steps,
  measured in the same run: what every ps task costs whatever it holds (a
  fresh task's baseline leaves out the code torch, gRPC and the optimizer
  page in on first use, about 80 MB);
- **peak after init**: the high-water mark once the variables exist, before
  the first step (does the peak come from creating them, or from training?);
- **within limit**: peak memory <= 1.3 x bytes held + the idle ps's.

    python -m benchmarks.suite.memory [--quick]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

import psframe
from benchmarks.children import Children
from benchmarks.common import MB, Deadline, MiB, single_thread, table_main
from benchmarks.formatting import format_bytes, format_number, markdown_table
from benchmarks.suite.ps_cluster import PsCluster
from benchmarks.suite.psframe_internals import (
    DEFAULT_MAX_SHARD_BYTES,
    control_calls,
    create_variables,
    push_pull,
    shard_requests,
)
from psframe import optim
from psframe.optim import OptimizerSpec

TENSOR_BYTES = DEFAULT_MAX_SHARD_BYTES  # the trainer's parts
LIMIT_FACTOR = 1.3
IDLE_BYTES = 4096  # what an idle ps task holds: one variable of 1,024 float32
SERVING_PROCESSES = 2  # K of the rows of a task served from several processes

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "SGD(momentum=0.9)": optim.SGD(lr=1e-3, momentum=0.9),
    "Adam": optim.Adam(lr=1e-3),
}


@dataclass(frozen=True)
class MemoryCase:
    """Variables of ``variable_bytes`` in total, updated by ``optimizer``, served by
    ``serving_processes`` processes."""

    variable_bytes: int
    optimizer: str  # a key of OPTIMIZERS
    serving_processes: int = 1

    @property
    def name(self) -> str:
        return f"mem-{self.variable_bytes // MiB}MiB-{self.optimizer.split('(')[0]}-k{self.serving_processes}"

    @property
    def idle(self) -> MemoryCase:
        """The idle ps task this case is held against: same optimizer and processes."""
        return MemoryCase(IDLE_BYTES, self.optimizer, self.serving_processes)


def cases_for(quick: bool) -> list[MemoryCase]:
    if quick:
        return [MemoryCase(16 * MiB, "SGD(momentum=0.9)")]
    cases = [MemoryCase(size, opt) for size in (80 * MiB, 400 * MiB) for opt in OPTIMIZERS]
    return cases + [MemoryCase(size, "SGD(momentum=0.9)", SERVING_PROCESSES) for size in (80 * MiB, 400 * MiB)]


class MemorySampler:
    """The largest memory of a process and its children seen by sampling every ``interval`` seconds:
    the RSS of the process alone, or with ``proportional`` the sum of every one's PSS."""

    def __init__(self, pid: int, interval: float = 0.01, proportional: bool = False) -> None:
        self._process = psutil.Process(pid)
        self._interval = interval
        self._proportional = proportional
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, name=f"memory-{pid}", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """The memory now (0 once the process is gone)."""
        try:
            if not self._proportional:
                return self._process.memory_info().rss
            total = 0
            for process in (self._process, *self._process.children(recursive=True)):
                try:
                    total += process.memory_full_info().pss
                except psutil.NoSuchProcess:
                    pass
            return total
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self.sample())

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
    """Start one ps task, fill it, train it ``steps`` steps, and read its memory."""
    flags = [f"--serving_processes={case.serving_processes}"] if case.serving_processes > 1 else []
    cluster = PsCluster(children, 1, case.name, deadline.remaining() + 60, extra_flags=flags)
    client = cluster.connect(deadline)
    pid = cluster.procs[0].pid
    reported_pid = control_calls.get_info(client, 0).pid
    if reported_pid != pid:  # `python -m psframe.cli` serves in the started process itself
        print(
            f"[bench] warning: ps reports pid {reported_pid}, started pid {pid}; measuring the former", file=sys.stderr
        )
        pid = reported_pid
    shared = case.serving_processes > 1
    sampler = MemorySampler(pid, proportional=shared)
    baseline = sampler.sample()
    try:
        part = min(TENSOR_BYTES, case.variable_bytes) // 4
        count = case.variable_bytes // (part * 4)
        values = [[(f"w{i}", torch.full((part,), 0.5)) for i in range(count)]]
        create_variables(client, values, OPTIMIZERS[case.optimizer])
        del values
        init_peak = None if shared else vm_hwm(pid)
        grads = shard_requests([[(f"w{i}", torch.full((part,), 1e-3)) for i in range(count)]])
        start = time.perf_counter()
        for _ in range(steps):
            deadline.check(f"stepping {case.name}")
            pulled = push_pull(client, grads)
            del pulled
        seconds_per_step = (time.perf_counter() - start) / steps
        info = control_calls.get_info(client, 0)
        peak = None if shared else vm_hwm(pid)
    finally:
        sampled = sampler.stop()
    source = "sampled PSS" if shared else "VmHWM"
    if peak is None:
        peak = sampled
        if not shared:
            source, init_peak = "sampled RSS", None  # not known without VmHWM
    cluster.finish()
    return {
        "system": "psframe ps" if not shared else f"psframe ps, {case.serving_processes} processes",
        "variables": format_bytes(case.variable_bytes),
        "variable_bytes": case.variable_bytes,
        "optimizer": case.optimizer,
        "serving_processes": case.serving_processes,
        "steps": steps,
        "bytes_held": info.bytes_held,
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak_rss_after_init": init_peak,
        "peak_source": source,
        "sampled_peak_rss": sampled,
        "seconds_per_step": seconds_per_step,
    }


def run_memory_benchmarks(quick: bool = False, timeout: float = 900.0) -> list[dict]:
    """Measure every memory case and its idle ps task (one ps task at a time).

    Returns:
        One row per case: ``system``, ``variables``, ``variable_bytes``,
        ``optimizer``, ``serving_processes``, ``steps``, ``bytes_held``,
        ``baseline_rss``, ``peak_rss``, ``peak_rss_after_init``,
        ``peak_source``, ``sampled_peak_rss``, ``seconds_per_step``,
        ``idle_rss`` (the idle ps task's peak), ``limit`` and ``within_limit``.
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "ps memory benchmark")
    steps = 2 if quick else 5
    rows = []
    idle: dict[MemoryCase, dict] = {}
    with tempfile.TemporaryDirectory(prefix="psframe-bench-memory-") as logs, Children(logs) as children:
        for case in cases_for(quick):
            if case.idle not in idle:
                idle[case.idle] = measure_case(children, case.idle, steps, deadline)
            row = measure_case(children, case, steps, deadline)
            row["idle_rss"] = idle[case.idle]["peak_rss"]
            row["limit"] = LIMIT_FACTOR * row["bytes_held"] + row["idle_rss"]
            row["within_limit"] = row["peak_rss"] <= row["limit"]
            rows.append(row)
    return rows


def memory_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_memory_benchmarks` rows (MB = 10**6 bytes)."""
    return markdown_table(
        [
            "system",
            "variables",
            "optimizer",
            "bytes held (MB)",
            "baseline (MB)",
            "idle ps (MB)",
            "peak after init (MB)",
            "peak (MB)",
            "limit (MB)",
            "peak <= 1.3 x held + idle ps",
            "s/step",
        ],
        [
            [
                r["system"],
                r["variables"],
                r["optimizer"],
                format_number(r["bytes_held"] / MB, 4),
                format_number(r["baseline_rss"] / MB, 4),
                format_number(r["idle_rss"] / MB, 4),
                format_number(None if r.get("peak_rss_after_init") is None else r["peak_rss_after_init"] / MB, 4),
                format_number(r["peak_rss"] / MB, 4),
                format_number(r["limit"] / MB, 4),
                "yes" if r["within_limit"] else "NO",
                format_number(r["seconds_per_step"]),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    # As psframe's own entry points do: the settings of a process that moves tensors every step.
    psframe.tune_process()
    return table_main(argv, __doc__, "one small case", lambda quick: memory_table(run_memory_benchmarks(quick)))


if __name__ == "__main__":
    sys.exit(main())

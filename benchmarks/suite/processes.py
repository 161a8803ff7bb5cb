"""The processes of one training run, run together: started, watched, their CPU sampled, their JSON lines read.

Every training system (:mod:`benchmarks.suite.training_systems`), and through it the
scaling and hosts sections, runs its tasks with :func:`run_processes`: each a
child that prints one JSON line with what it measured. Its CPU time is
sampled while it runs, so the CPU it spent inside a timed window can be told
afterwards (:func:`cpu_in_window`); :func:`load_mark` and
:func:`other_load_since` say how busy other work kept the machine meanwhile.
(:class:`benchmarks.children.Children` is the other kind of child: a server
that a benchmark talks to itself.)
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.children import ForkedProcess, forked_cpu_seconds, start_process
from benchmarks.common import ROOT

# Children never leave loopback, and never get more than one compute thread.
CHILD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "TP_SOCKET_IFNAME": "lo",
    "GLOO_SOCKET_IFNAME": "lo",
    "MASTER_ADDR": "127.0.0.1",
    "no_proxy": "127.0.0.1,localhost",
    "NO_PROXY": "127.0.0.1,localhost",
}
_POLL_S = 0.05
_KILL_GRACE_S = 3.0


class ChildError(RuntimeError):
    """A benchmark process failed, printed no result, or ran past the deadline."""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen | ForkedProcess
    stdout: Path
    stderr: Path

    def tail(self, lines: int = 15) -> str:
        text = self.stderr.read_text(errors="replace").strip().splitlines()
        out = self.stdout.read_text(errors="replace").strip().splitlines()
        return "\n".join(f"    {line}" for line in (out[-3:] + text[-lines:]))


@dataclass(frozen=True)
class Placement:
    """Where a system's processes run, when not all on this machine's loopback.

    Args:
        address: the IP address of the host a process (by its name in
            :func:`run_processes`: ``ps0``, ``worker1``, ``trainer0``...) runs on.
        popen: starts a process on its host: ``popen(name, argv, **Popen's keyword arguments)``.
        interface: the hosts' network interface (TensorPipe's and gloo's).
        port: the port every server listens on (the hosts are apart: ports never clash).
    """

    address: Callable[[str], str]
    popen: Callable[..., subprocess.Popen]
    interface: str = "eth0"
    port: int = 29500

    def environment(self) -> dict[str, str]:
        return {"TP_SOCKET_IFNAME": self.interface, "GLOO_SOCKET_IFNAME": self.interface}


def run_processes(
    tasks: Sequence[tuple[str, list[str]]], deadline: float, placement: Placement | None = None
) -> dict[str, dict]:
    """Run the child processes ``tasks`` (name, argv) together until all exit.

    Every child runs in the repository root with :data:`CHILD_ENV`; its stdout
    and stderr go to files (so a chatty child never blocks on a pipe). On the
    first failure or at ``deadline`` (a ``time.monotonic()`` value) every child
    still running gets SIGTERM, then SIGKILL, by PID. With a ``placement``,
    each child starts on its host.

    Returns:
        The last JSON object each child printed, by name, with ``cpu_trace``
        added: ``[time.perf_counter(), CPU seconds]`` samples of the child,
        taken every :data:`_POLL_S` while it ran (see :func:`cpu_in_window`).

    Raises:
        ChildError: a child exited non-zero, printed no JSON, or the deadline passed.
    """
    env = {**os.environ, **CHILD_ENV, **(placement.environment() if placement else {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    children: list[_Child] = []
    traces: dict[str, list[list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="psframe-bench-") as tmp:
        try:
            for name, argv in tasks:
                out, err = Path(tmp, f"{name}.out"), Path(tmp, f"{name}.err")
                with open(out, "wb") as fout, open(err, "wb") as ferr:
                    start = start_process if placement is None else functools.partial(placement.popen, name)
                    proc = start(argv, stdin=subprocess.DEVNULL, stdout=fout, stderr=ferr, cwd=ROOT, env=env)
                children.append(_Child(name, proc, out, err))
            while True:
                for child in children:
                    code = child.proc.poll()
                    if code not in (None, 0):
                        raise ChildError(f"{child.name} exited with code {code}:\n{child.tail()}")
                running = [c.name for c in children if c.proc.poll() is None]
                if not running:
                    break
                for child in children:
                    if child.proc.returncode is None:  # never a reaped child's PID: it may be reused
                        _sample_cpu(child, traces.setdefault(child.name, []))
                if time.monotonic() >= deadline:
                    _dump_stacks(children)
                    raise ChildError(
                        f"deadline passed with {', '.join(running)} still running "
                        f"(each one's stacks at the end of its stderr):\n"
                        + "\n".join(f"  {c.name}:\n{c.tail(25)}" for c in children)
                    )
                time.sleep(_POLL_S)
            results = {}
            for child in children:
                result = _last_json(child.stdout.read_text(errors="replace"))
                if result is None:
                    raise ChildError(f"{child.name} exited 0 but printed no JSON result:\n{child.tail()}")
                results[child.name] = {**result, "cpu_trace": traces.get(child.name, [])}
            return results
        finally:
            _stop(children)


def _sample_cpu(child: _Child, trace: list[list[float]]) -> None:
    """Append ``[now, CPU seconds so far]`` of a running child and the processes it started
    (a ps task's serving processes), nothing once it is gone."""
    try:
        process = psutil.Process(child.proc.pid)
        total = _cpu_seconds(process)
        for descendant in process.children(recursive=True):
            try:
                total += _cpu_seconds(descendant)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue  # ended between the listing and the reading
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return
    trace.append([time.perf_counter(), total])


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def cpu_in_window(trace: Sequence[Sequence[float]], window: Sequence[float]) -> float | None:
    """CPU seconds a process spent between ``window``'s two ``perf_counter`` times.

    ``trace`` holds ``[time, CPU seconds]`` samples in time order; the CPU
    time at each end of the window is interpolated linearly between the
    samples around it (an end past the last sample takes the last one: the
    process was ending). None when no sample falls inside the window or after
    it, or the window starts before the first one: nothing to measure from.
    """
    if not trace or window[0] < trace[0][0] or window[0] >= trace[-1][0]:
        return None
    times = [sample[0] for sample in trace]

    def at(t: float) -> float:
        if t >= times[-1]:
            return trace[-1][1]
        i = bisect.bisect_right(times, t)
        (t0, c0), (t1, c1) = trace[i - 1], trace[i]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0) if t1 > t0 else c1

    return max(0.0, at(window[1]) - at(window[0]))


def _dump_stacks(children: list[_Child]) -> None:
    alive = [c for c in children if c.proc.poll() is None]
    for c in alive:
        c.proc.send_signal(signal.SIGUSR1)  # faulthandler (see mlp_workload.set_single_thread) prints the stacks
    if alive:
        time.sleep(1.0)


def _stop(children: list[_Child]) -> None:
    alive = [c for c in children if c.proc.poll() is None]
    for c in alive:
        c.proc.terminate()
    end = time.monotonic() + _KILL_GRACE_S
    while any(c.proc.poll() is None for c in alive) and time.monotonic() < end:
        time.sleep(_POLL_S)
    for c in alive:
        if c.proc.poll() is None:
            c.proc.kill()
    for c in alive:
        c.proc.wait(timeout=10)


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


# ---------------------------------------------------------------- load on the machine


def _busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine spent busy since boot (Linux), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # children reaped so far
    return usage.ru_utime + usage.ru_stime + forked_cpu_seconds()


def _other_load(busy_before: float | None, mine_before: float, seconds: float) -> float | None:
    """Cores kept busy by other work than this benchmark's processes, on average, while it ran.

    Rates measured while it is well above 0 are skewed by the competition.
    """
    busy_after = _busy_cpu_seconds()
    if busy_before is None or busy_after is None or seconds <= 0:
        return None
    mine = _children_cpu_seconds() - mine_before
    return round(max(0.0, (busy_after - busy_before - mine) / seconds), 2)


def load_mark() -> tuple[float | None, float, float]:
    """Where the machine's busy CPU time and this process's reaped children's stand now,
    and when: pass it to :func:`other_load_since` once the work is done."""
    return _busy_cpu_seconds(), _children_cpu_seconds(), time.monotonic()


def other_load_since(mark: tuple[float | None, float, float]) -> float | None:
    """Cores kept busy by work other than this process's children since ``mark``
    (:func:`load_mark`), on average; None where it cannot be told."""
    busy_before, mine_before, started = mark
    return _other_load(busy_before, mine_before, time.monotonic() - started)

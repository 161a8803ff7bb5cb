"""A psframe job whose tasks run on test hosts (:mod:`tests.support.hosts`): the MNIST example by default.

:class:`HostJob` places each task on a host, gives every task the same
cluster (each host's address, one port per task: hosts are separate network
namespaces, so ports never clash), starts the tasks with their output in a
log file each, and reads those logs: a line's time, the chief's JSON result,
when a task was stepping again after a link healed. Every wait has a deadline;
the host set kills whatever still runs at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.support.hosts import HostSet

ROOT = Path(__file__).resolve().parents[2]
MNIST_EXAMPLE = ROOT / "examples" / "mlp_mnist_dist.py"
FIRST_PORT = 2222
# A log line's time, as logging's default asctime writes it: "2026-11-26 02:30:52,957".
_ASCTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
# Lines that show a worker stepping: the example's progress lines, and a step sent again.
STEPPING = re.compile(r"local step \d+, global step|the ps tasks are back")


class HostJob:
    """The tasks of one job, each on the host ``placement`` names.

    Args:
        hosts: the test hosts.
        placement: task name (``"ps0"``, ``"worker1"``) -> host name; every
            ps and worker task of the cluster, indices from 0.
        logs: the folder for the tasks' logs.
        script: the training script every task runs (TF's flags).
        flags: flags every task gets.
    """

    def __init__(
        self,
        hosts: HostSet,
        placement: Mapping[str, str],
        logs: Path,
        *,
        script: Path = MNIST_EXAMPLE,
        flags: Sequence[str] = (),
    ) -> None:
        self.hosts = hosts
        self.placement = dict(placement)
        self.logs = logs
        self.script = script
        self.flags = list(flags)
        ports = {task: FIRST_PORT + i for i, task in enumerate(sorted(placement))}
        self.addresses = {task: f"{hosts.address(host)}:{ports[task]}" for task, host in placement.items()}
        self.num_ps = sum(task.startswith("ps") for task in placement)
        self.num_workers = sum(task.startswith("worker") for task in placement)
        self.procs: dict[str, subprocess.Popen] = {}
        self.returncodes: dict[str, int] = {}

    def cluster_flags(self, workers: int | None = None, ps_tasks: int | None = None) -> list[str]:
        """The cluster's flags; ``workers``: only the first so many workers (an elastic job's start);
        ``ps_tasks``: only the first so many ps tasks (a job before ps tasks are added)."""
        ps = ",".join(self.addresses[f"ps{i}"] for i in range(ps_tasks or self.num_ps))
        workers = ",".join(self.addresses[f"worker{i}"] for i in range(workers or self.num_workers))
        return [f"--ps_hosts={ps}", f"--worker_hosts={workers}"]

    def start(
        self, task: str, *extra: str, workers: int | None = None, ps_tasks: int | None = None
    ) -> subprocess.Popen:
        """Start ``task`` on its host (again, after it ended: its log goes on), in a cluster
        of its first ``workers`` workers and ``ps_tasks`` ps tasks (default: all of them)."""
        job, index = re.fullmatch(r"(ps|worker)(\d+)", task).groups()
        argv = [
            sys.executable,
            str(self.script),
            *self.cluster_flags(workers, ps_tasks),
            f"--job_name={job}",
            f"--task_index={index}",
            *self.flags,
            *extra,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(self.log_path(task), "a") as out:
            proc = self.hosts.popen(
                self.placement[task],
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=ROOT,
            )
        self.procs[task] = proc
        self.returncodes.pop(task, None)
        return proc

    def start_all(self, *extra: str) -> None:
        """Every ps task, then every worker."""
        for task in sorted(self.placement, key=lambda t: (not t.startswith("ps"), t)):
            self.start(task, *extra)

    def log_path(self, task: str) -> Path:
        return self.logs / f"{task}.log"

    def output(self, task: str) -> str:
        path = self.log_path(task)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, task: str, pattern: str, timeout: float) -> None:
        """Wait until ``task`` printed a line matching ``pattern`` (or fail, showing its log)."""
        deadline = time.monotonic() + timeout
        compiled = re.compile(pattern)
        while time.monotonic() < deadline:
            if compiled.search(self.output(task)):
                return
            if self.procs[task].poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"{task} did not print {pattern!r} within {timeout}s:\n{self.report()}")

    def wait(self, timeout: float, expect: Mapping[str, int] | None = None) -> dict[str, int]:
        """Wait for every task to end; their exit codes. A task that exits with another
        code than ``expect`` says (0 by default), or the deadline, kills the rest and fails."""
        expect = expect or {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for task, proc in self.procs.items():
                code = proc.poll()
                if code is None or task in self.returncodes:
                    continue
                self.returncodes[task] = code
                if code != expect.get(task, 0):
                    self.kill_all()
                    pytest.fail(f"{task} exited {code}, not {expect.get(task, 0)}:\n{self.report()}")
            if len(self.returncodes) == len(self.procs):
                return dict(self.returncodes)
            time.sleep(0.1)
        self.kill_all()
        pytest.fail(f"the job still ran after {timeout}s:\n{self.report()}")

    def kill_all(self) -> None:
        for task, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            self.returncodes.setdefault(task, proc.returncode)

    def report(self) -> str:
        return "\n".join(
            f"--- {task} (rc={self.procs[task].poll()})\n{self.output(task)[-4000:]}" for task in sorted(self.procs)
        )

    def result(self, task: str = "worker0") -> dict:
        """The last JSON line ``task`` printed (the chief's result)."""
        lines = [line for line in self.output(task).splitlines() if line.startswith("{")]
        assert lines, f"{task} printed no result:\n{self.report()}"
        return json.loads(lines[-1])

    def stepping_after(self, task: str, moment: float) -> float | None:
        """Seconds from ``moment`` (``time.time()``) to the first line of ``task`` after it
        that shows it stepping; None if there is none."""
        for line in self.output(task).splitlines():
            stamp = line_time(line)
            if stamp is not None and stamp >= moment and STEPPING.search(line):
                return stamp - moment
        return None


def line_time(line: str) -> float | None:
    """The time (``time.time()``) a log line was written, from its asctime; None without one."""
    found = _ASCTIME.match(line)
    if found is None:
        return None
    when = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")
    return when.timestamp() + int(found.group(2)) / 1000

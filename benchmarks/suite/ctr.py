"""The CTR example's samples/s, async and sync, and its AUC against one process.

    python -m benchmarks.suite.ctr [--quick]

``examples/ctr_dist.py`` (a wide & deep model over two embedding tables,
Adagrad, a generated click log with a planted ground truth) run three ways on
the same samples:

- **single_process**: ``--single_process``, the reference (torch.optim in one
  process);
- **async**: ``psframe launch`` with 2 ps tasks and 2 workers;
- **sync**: the same with ``--sync_replicas`` (each update averages both
  workers' gradients), half the global steps: as many samples.

The log holds more samples than a run trains on (:data:`FULL_CASE`: 3,000
steps of 256 from 800,000), so no mode sees a sample twice on one worker.
``--quick`` (a smoke test) starts the cluster's tasks itself, as ``psframe
launch`` would, so that each can be forked from a process that has imported
torch and psframe already (:func:`run_tasks`).

*samples/s* is the example's own figure, printed by its chief (or the single
process) in its JSON line: samples trained over the seconds of its training
loop, after start-up and before the held-out evaluation (all workers'
samples: async, a global step is one worker's batch; sync, it is one batch of
each worker). *run s* is the whole run as this benchmark saw it: data
generation, start-up, training and evaluation. *AUC - single process* is the
held-out AUC's difference from the single process's, in the same run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.children import Children
from benchmarks.common import ROOT, BenchmarkError, Deadline, single_thread, table_main
from benchmarks.formatting import format_number, format_ratio, markdown_table
from psframe.launch import pick_free_ports

EXAMPLE = ROOT / "examples" / "ctr_dist.py"
NUM_PS = 2
NUM_WORKERS = 2
MODES = ("single_process", "async", "sync")


@dataclass(frozen=True)
class CtrCase:
    """The example's flags: ``train_steps`` batches of ``batch_size`` in every mode (sync: half the
    global steps, each of 2 workers' batches)."""

    train_steps: int
    batch_size: int
    train_samples: int
    test_samples: int
    hash_buckets: int

    @property
    def samples(self) -> int:
        return self.train_steps * self.batch_size

    def flags(self, mode: str) -> list[str]:
        steps = self.train_steps // NUM_WORKERS if mode == "sync" else self.train_steps
        return [
            f"--train_steps={steps}",
            f"--batch_size={self.batch_size}",
            f"--train_samples={self.train_samples}",
            f"--test_samples={self.test_samples}",
            f"--hash_buckets={self.hash_buckets}",
            *(["--sync_replicas"] if mode == "sync" else []),
        ]


# The example's defaults: the log holds more samples than a run trains on, so each sample is seen
# at most once (per worker) and the AUCs compare learning, not how far each mode overfits a log
# seen ~4 times (with 200,000 samples the single process's held-out log loss rises to 0.71 where
# async and sync stay at 0.64, and their AUCs lie 0.006 above its).
FULL_CASE = CtrCase(train_steps=3000, batch_size=256, train_samples=800_000, test_samples=50_000, hash_buckets=1 << 17)
QUICK_CASE = CtrCase(train_steps=120, batch_size=256, train_samples=40_000, test_samples=5_000, hash_buckets=1 << 14)


def command(mode: str, case: CtrCase, timeout: float) -> list[str]:
    """The example's command line for ``mode`` (a launch of the whole cluster but for single_process)."""
    if mode == "single_process":
        return [sys.executable, str(EXAMPLE), "--single_process", *case.flags(mode)]
    return [
        sys.executable,
        "-m",
        "psframe.cli",
        "launch",
        f"--num_ps={NUM_PS}",
        f"--num_workers={NUM_WORKERS}",
        f"--timeout={timeout:.0f}",
        str(EXAMPLE),
        "--",
        *case.flags(mode),
    ]


def run_tasks(
    children: Children, name: str, num_ps: int, num_workers: int, flags: list[str], deadline: Deadline
) -> str:
    """The example as ``num_ps`` ps and ``num_workers`` worker tasks, each a child started here with
    the cluster flags ``psframe launch`` would give it (free loopback ports); the chief's output once
    every task ended with 0. ``--quick`` runs start a cluster so, where each task can be forked
    (:func:`benchmarks.children.forked_children`); ``psframe launch`` starts every task afresh.

    Raises:
        BenchmarkError: a task failed, or ``deadline`` passed (every task is then killed).
    """
    ports = pick_free_ports(num_ps + num_workers)
    hosts = [f"127.0.0.1:{port}" for port in ports]
    cluster = [f"--ps_hosts={','.join(hosts[:num_ps])}", f"--worker_hosts={','.join(hosts[num_ps:])}"]
    tasks = {
        f"{name}-{job}{index}": [f"--job_name={job}", f"--task_index={index}"]
        for job, count in (("ps", num_ps), ("worker", num_workers))
        for index in range(count)
    }
    for task, job in tasks.items():
        children.start(task, [sys.executable, str(EXAMPLE), *cluster, *job, *flags])
    while True:
        codes = {task: children.procs[task].poll() for task in tasks}
        if all(code == 0 for code in codes.values()):
            return children.log_path(f"{name}-worker0").read_text(errors="replace")
        failed = {task: code for task, code in codes.items() if code not in (None, 0)}
        if failed or deadline.expired():
            for task in tasks:
                children.kill(task)
            what = f"ended with {failed}" if failed else f"still ran after {deadline.seconds:g}s"
            logs = "\n".join(f"--- {task}:\n{children.log_tail(task, 15)}" for task in tasks)
            raise BenchmarkError(f"the CTR example's tasks {what}; their logs:\n{logs}")
        time.sleep(0.05)


def result_line(output: str, mode: str, launched: bool = True) -> dict:
    """The JSON line the chief (``[worker0] {...}`` under launch; ``{...}`` in its own output, not
    ``launched``) or the single process printed last.

    Raises:
        BenchmarkError: there is none.
    """
    prefix = "{" if mode == "single_process" or not launched else "[worker0] {"
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    if not lines:
        raise BenchmarkError(
            f"the CTR example ({mode}) printed no result line; its output ends:\n"
            + "\n".join(output.splitlines()[-20:])
        )
    return json.loads(lines[-1][len(prefix) - 1 :])


def run_whole(children: Children, name: str, argv: list[str], deadline: Deadline) -> str:
    """Run ``argv`` (the example in one process, or ``psframe launch`` of it) as child ``name`` to
    its end; its output.

    Raises:
        BenchmarkError: it ended with another code than 0 (its log's tail in the message).
    """
    children.start(name, argv)
    code = children.wait_exit(name, deadline.remaining())
    if code != 0:
        children.kill(name)
        raise BenchmarkError(f"the CTR example ({name}) ended with {code}; its log:\n{children.log_tail(name)}")
    return children.log_path(name).read_text(errors="replace")


def run_mode(children: Children, mode: str, case: CtrCase, deadline: Deadline, launch: bool = True) -> dict:
    """Run the example once in ``mode``; its row (without the comparisons with the single process).
    A cluster through ``psframe launch``, or, not ``launch``, its tasks started here (:func:`run_tasks`)."""
    name = f"ctr-{mode}"
    started = time.monotonic()
    if launch or mode == "single_process":
        output = run_whole(children, name, command(mode, case, deadline.remaining()), deadline)
    else:
        output = run_tasks(children, name, NUM_PS, NUM_WORKERS, case.flags(mode), deadline)
    seconds = time.monotonic() - started
    result = result_line(output, mode, launched=launch)
    missing = [k for k in ("global_step", "auc", "log_loss", "ceiling_auc", "samples_per_sec") if k not in result]
    if missing or result.get("mode") != mode:
        raise BenchmarkError(f"the CTR example ({mode}) printed {result}: expected mode {mode!r} and {missing}")
    per_step = case.batch_size * (NUM_WORKERS if mode == "sync" else 1)
    return {
        "kind": "ctr",
        "mode": mode,
        "num_ps": 0 if mode == "single_process" else NUM_PS,
        "num_workers": 1 if mode == "single_process" else NUM_WORKERS,
        "global_step": result["global_step"],
        "samples": result["global_step"] * per_step,
        "samples_per_sec": result["samples_per_sec"],
        "auc": result["auc"],
        "log_loss": result["log_loss"],
        "ceiling_auc": result["ceiling_auc"],
        "run_seconds": seconds,
    }


def against_single(row: dict, single: dict | None) -> dict:
    """``row`` with ``vs_single`` (samples/s over the single process's) and ``auc_diff`` (AUC
    minus the single process's), from the single process's row ``single``; None without one."""
    return {
        **row,
        "vs_single": None if single is None else row["samples_per_sec"] / single["samples_per_sec"],
        "auc_diff": None if single is None else row["auc"] - single["auc"],
    }


def signed(value: float | None) -> str:
    """An AUC difference as a table shows it: ``+0.0012``, or ``-`` for none."""
    return "-" if value is None else f"{value:+.4f}"


def compare(rows: list[dict]) -> list[dict]:
    """Each row :func:`against_single` the single process's."""
    single = next((r for r in rows if r["mode"] == "single_process"), None)
    return [against_single(r, single) for r in rows]


def run_ctr_benchmarks(quick: bool = False, timeout: float = 600.0, case: CtrCase | None = None) -> list[dict]:
    """The example in every mode of :data:`MODES`, one after the other (``case``: the example's
    flags; default :data:`QUICK_CASE` or :data:`FULL_CASE`).

    Returns:
        One row per mode: ``kind`` ("ctr"), ``mode``, ``num_ps``, ``num_workers``, ``global_step``,
        ``samples``, ``samples_per_sec``, ``auc``, ``log_loss``, ``ceiling_auc``, ``run_seconds``,
        ``vs_single`` and ``auc_diff``.
    """
    single_thread()
    case = case or (QUICK_CASE if quick else FULL_CASE)
    deadline = Deadline(timeout, "CTR example benchmark")
    with tempfile.TemporaryDirectory(prefix="psframe-bench-ctr-") as logs, Children(logs) as children:
        return compare([run_mode(children, mode, case, deadline, launch=not quick) for mode in MODES])


def ctr_table(rows: list[dict]) -> str:
    """Markdown table of :func:`run_ctr_benchmarks` rows."""
    headers = [
        "mode",
        "ps tasks",
        "workers",
        "samples",
        "samples/s",
        "samples/s vs single process",
        "AUC",
        "AUC - single process",
        "log loss",
        "ceiling AUC",
        "run s",
    ]
    return markdown_table(
        headers,
        [
            [
                r["mode"],
                r["num_ps"] or "-",
                r["num_workers"],
                f"{r['samples']:,}",
                format_number(r["samples_per_sec"]),
                format_ratio(r["vs_single"]),
                f"{r['auc']:.4f}",
                signed(r["auc_diff"]),
                f"{r['log_loss']:.4f}",
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
        "120 steps of 256 samples, tables of 2^14 rows",
        lambda quick: ctr_table(run_ctr_benchmarks(quick)),
    )


if __name__ == "__main__":
    sys.exit(main())

"""The training section's systems as processes: each system's tasks started, waited for, and made into one row.

Each ``run_*`` function starts one system's processes with
:func:`benchmarks.suite.processes.run_processes` (on loopback, or on the hosts
of a :class:`~benchmarks.suite.processes.Placement`) before a
``time.monotonic()`` deadline, and returns what it measured: the global
steps/s and samples/s of its timed window, each worker's rate, the first
worker's loss, and the CPU every process spent in that window.
:mod:`benchmarks.suite.training` runs them one after the other and reports
them; the scaling and hosts sections run them at other worker counts and on
capped links.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.baselines import tf_env
from benchmarks.mlp_workload import BATCH_SIZE, LEARNING_RATE
from benchmarks.suite.processes import Placement, cpu_in_window, run_processes
from psframe.launch import pick_free_ports

NUM_WORKERS = 2  # psframe workers, RPC trainers and DDP ranks


class SystemUnavailable(RuntimeError):
    """A system cannot run on this machine (its environment is missing): its rows say
    why, and it is not counted as a failure."""


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _free_ports(count: int) -> list[int]:
    return pick_free_ports(count, "127.0.0.1")


def _common_flags(model: str, steps: int, warmup: int) -> list[str]:
    return [f"--model={model}", f"--steps={steps}", f"--warmup={warmup}"]


def _addresses(names: Sequence[str], placement: Placement | None) -> list[str]:
    """``host:port`` for each process named: free loopback ports, or each one's host."""
    if placement is None:
        return [f"127.0.0.1:{p}" for p in _free_ports(len(names))]
    return [f"{placement.address(name)}:{placement.port}" for name in names]


def run_psframe_processes(
    model: str,
    sync: bool,
    steps: int,
    warmup: int,
    deadline: float,
    extra_flags: Sequence[str] = (),
    *,
    num_workers: int = NUM_WORKERS,
    num_ps: int = 1,
    placement: Placement | None = None,
) -> dict:
    """``num_ps`` ps tasks and ``num_workers`` workers of :mod:`benchmarks.suite.train_psframe`
    (children ``ps0``..., ``worker0``...); the chief times the global steps."""
    hosts = _addresses([f"ps{i}" for i in range(num_ps)] + [f"worker{i}" for i in range(num_workers)], placement)
    timeout = max(10.0, deadline - time.monotonic())
    with tempfile.TemporaryDirectory(prefix="psframe-barrier-") as barrier:
        flags = [
            f"--ps_hosts={','.join(hosts[:num_ps])}",
            f"--worker_hosts={','.join(hosts[num_ps:])}",
            *_common_flags(model, steps, warmup),
            f"--barrier_dir={barrier}",
            f"--timeout={timeout:.0f}",
            "--log_level=INFO",
            *(["--sync"] if sync else []),
            *extra_flags,
        ]
        tasks = [
            (f"ps{i}", _python_module("benchmarks.suite.train_psframe", *flags, "--job_name=ps", f"--task_index={i}"))
            for i in range(num_ps)
        ]
        tasks += [
            (
                f"worker{i}",
                _python_module("benchmarks.suite.train_psframe", *flags, "--job_name=worker", f"--task_index={i}"),
            )
            for i in range(num_workers)
        ]
        results = run_processes(tasks, deadline, placement)
    chief = results["worker0"]
    workers = [results[f"worker{i}"] for i in range(num_workers)]
    return _row(
        chief,
        workers,
        chief["global_steps_per_sec"],
        chief["timed_global_steps"],
        results,
        samples_per_step=BATCH_SIZE * (num_workers if sync else 1),
        processes=num_ps + num_workers,
        dropped_steps=sum(w["dropped_steps"] for w in workers),
    )


def run_rpc_processes(
    model: str,
    sync: bool,
    steps: int,
    warmup: int,
    deadline: float,
    *,
    num_workers: int = NUM_WORKERS,
    placement: Placement | None = None,
) -> dict:
    """The RPC ps (child ``ps``) and ``num_workers`` trainers of :mod:`benchmarks.baselines.rpc_ps`;
    the ps times its updates."""
    (master,) = _addresses(["ps"], placement)
    host, port = master.rsplit(":", 1)
    timeout = max(10.0, deadline - time.monotonic())
    flags = [
        f"--master_addr={host}",
        f"--port={port}",
        f"--num_trainers={num_workers}",
        *_common_flags(model, steps, warmup),
        f"--timeout={timeout:.0f}",
        *(["--sync"] if sync else []),
    ]
    tasks = [
        (
            ("ps" if rank == 0 else f"trainer{rank - 1}"),
            _python_module("benchmarks.baselines.rpc_ps", *flags, f"--rank={rank}"),
        )
        for rank in range(1 + num_workers)
    ]
    results = run_processes(tasks, deadline, placement)
    ps = results["ps"]
    return _row(
        ps,
        [results[f"trainer{i}"] for i in range(num_workers)],
        ps["global_steps_per_sec"],
        ps["timed_global_steps"],
        results,
        samples_per_step=BATCH_SIZE * (num_workers if sync else 1),
        processes=1 + num_workers,
    )


def run_tf_processes(
    model: str,
    steps: int,
    warmup: int,
    deadline: float,
    *,
    num_workers: int = NUM_WORKERS,
    placement: Placement | None = None,
) -> dict:
    """The TF ps (child ``ps``) and ``num_workers`` workers of :mod:`benchmarks.baselines.tf_ps`,
    async, run by the TensorFlow environment's python; the chief times the global steps.

    Raises:
        SystemUnavailable: no TensorFlow environment here
            (:func:`benchmarks.baselines.tf_env.unavailable_reason`).
    """
    reason = tf_env.unavailable_reason()
    if reason:
        raise SystemUnavailable(reason)
    python = tf_env.tf_python()
    hosts = _addresses(["ps", *[f"worker{i}" for i in range(num_workers)]], placement)
    with tempfile.TemporaryDirectory(prefix="psframe-tf-") as tmp:
        inputs = tf_env.write_inputs(model, Path(tmp, "inputs.npz"))
        barrier = Path(tmp, "barrier")
        barrier.mkdir()
        timeout = max(10.0, deadline - time.monotonic())
        flags = [
            f"--ps_hosts={hosts[0]}",
            f"--worker_hosts={','.join(hosts[1:])}",
            f"--inputs={inputs}",
            *_common_flags(model, steps, warmup),
            f"--batch_size={BATCH_SIZE}",
            f"--learning_rate={LEARNING_RATE}",
            f"--barrier_dir={barrier}",
            f"--timeout={timeout:.0f}",
        ]
        argv = [python, "-m", "benchmarks.baselines.tf_ps", *flags]
        tasks = [("ps", [*argv, "--job_name=ps", "--task_index=0"])]
        tasks += [(f"worker{i}", [*argv, "--job_name=worker", f"--task_index={i}"]) for i in range(num_workers)]
        results = run_processes(tasks, deadline, placement)
    chief = results["worker0"]
    return _row(
        chief,
        [results[f"worker{i}"] for i in range(num_workers)],
        chief["global_steps_per_sec"],
        chief["timed_global_steps"],
        results,
        samples_per_step=BATCH_SIZE,
        processes=1 + num_workers,
    )


def run_ddp_processes(model: str, steps: int, warmup: int, deadline: float) -> dict:
    """:data:`NUM_WORKERS` ranks of :mod:`benchmarks.baselines.ddp` over gloo (children ``rank0``...);
    rank 0 times its steps."""
    (port,) = _free_ports(1)
    timeout = max(10.0, deadline - time.monotonic())
    flags = [
        f"--port={port}",
        f"--world_size={NUM_WORKERS}",
        *_common_flags(model, steps, warmup),
        f"--timeout={timeout:.0f}",
    ]
    tasks = [
        (f"rank{r}", _python_module("benchmarks.baselines.ddp", *flags, f"--rank={r}")) for r in range(NUM_WORKERS)
    ]
    results = run_processes(tasks, deadline)
    rank0 = results["rank0"]
    return _row(
        rank0,
        [results[f"rank{r}"] for r in range(NUM_WORKERS)],
        rank0["local_steps_per_sec"],
        rank0["timed_steps"],
        results,
        samples_per_step=BATCH_SIZE * NUM_WORKERS,
        processes=NUM_WORKERS,
    )


def run_single_process(model: str, steps: int, warmup: int, deadline: float) -> dict:
    """The same training loop in one process of :mod:`benchmarks.baselines.ddp` (child ``single``)."""
    tasks = [("single", _python_module("benchmarks.baselines.ddp", "--single", *_common_flags(model, steps, warmup)))]
    results = run_processes(tasks, deadline)
    result = results["single"]
    return _row(
        result,
        [result],
        result["local_steps_per_sec"],
        result["timed_steps"],
        results,
        samples_per_step=BATCH_SIZE,
        processes=1,
    )


def _row(
    timer: dict,
    workers: list[dict],
    rate: float,
    steps: int,
    results: dict[str, dict],
    *,
    samples_per_step: int,
    processes: int,
    **extra,
) -> dict:
    """One system's measurements: ``timer`` is the process that timed the updates
    (its ``rate`` over ``steps``), ``workers`` every trainer, the first one's loss
    reported; ``results`` every process's, for the CPU they spent in the timer's window."""
    cpu = {name: cpu_in_window(r.get("cpu_trace", ()), timer["window"]) for name, r in results.items()}
    cpu_total = None if None in cpu.values() or not steps else sum(cpu.values())
    return {
        "global_steps_per_sec": rate,
        "samples_per_sec": rate * samples_per_step,
        "steps": steps,
        "seconds": timer["seconds"],
        "per_worker_steps_per_sec": [w["local_steps_per_sec"] for w in workers],
        "window_rates": timer["window_rates"],
        "overall_steps_per_sec": timer["overall_steps_per_sec"],
        "final_loss": workers[0]["final_loss"],
        "processes": processes,
        "cpu_seconds": cpu,
        "cpu_ms_per_step": math.nan if cpu_total is None else 1e3 * cpu_total / steps,
        **extra,
    }

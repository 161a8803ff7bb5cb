"""Scaling: throughput against the number of workers, and the servers' CPU per request.

For each model and each worker count N (1, 2, 4, 8... up to the cores the
machine has beside its ps tasks; see :func:`worker_counts`), every system of
:data:`SYSTEMS` runs once, async, on loopback, one compute thread per process:

==============  ========  =====================================================
system          ps tasks  what runs
==============  ========  =====================================================
psframe         1 and 2   N workers of :mod:`benchmarks.suite.train_psframe`; a worker
                          pushes its gradients and pulls the parameters on one
                          PushPull stream per ps task.
psframe_kK      1         the same, with the ps task served from K processes
                          (:mod:`psframe.ps.serving.serving_processes`; K = a quarter of the
                          cores, 2 to 4): its server CPU counts them all.
torch_rpc_ps    1         N trainers of :mod:`benchmarks.baselines.rpc_ps`: one
                          ``rpc_sync`` per step carries the whole model each way.
tf_ps           1         N workers of TensorFlow's between-graph replication
                          (:mod:`benchmarks.baselines.tf_ps`): one ``session.run``
                          per step reads every variable from the ps and has it
                          apply every gradient. In its own environment
                          (:mod:`benchmarks.baselines.tf_env`); "unavailable" rows where
                          that is missing.
raw_echo        1         N clients of the raw gRPC echo server
                          (:mod:`benchmarks.baselines.raw_grpc`), each one stream with one
                          request in flight, at the payload of psframe's
                          average request on that model with 1 ps task.
==============  ========  =====================================================

Every row reports the global steps/s (raw_echo: round trips/s of all
clients together), and the CPU time its server processes (psframe's ps
tasks, the RPC ps, the TF ps, the echo server) spent in the timed window per request
they answered:

- psframe: one request is one PushPull message to one ps task. A step sends
  each ps task its variables in messages of at most 4 MiB (psframe's
  ``max_shard_bytes``): the MNIST MLP is one message with 1 ps task and two
  (313,600 and 4,440 bytes) with 2; the large MLP is 21 messages with 1 ps
  task and 22 with 2 (11 each). :func:`step_plan_sizes` asks psframe's own
  placement and step plan, so requests = timed global steps x messages per step.
- torch_rpc_ps: one request per global step (the whole model each way).
- tf_ps: one request per global step, that is per worker step, the whole
  model each way. On the wire TF makes it several calls to the ps: one
  ``RunGraph`` (the update subgraph) and a ``RecvTensor`` transfer per tensor
  that crosses (each variable to the worker, each gradient to the ps); the ps
  process's CPU for all of them counts against the one request.
- raw_echo: one request per round trip, counted in the window all clients
  were timing together.

The CPU per request is compared with the echo server's CPU per round trip at
the same model and N (:func:`benchmarks.suite.scaling_tables.add_ratios`). A
system is one entry of :data:`SYSTEMS`: a name, its ps counts, and a function
that runs it (on the processes of :mod:`benchmarks.suite.training_systems`, or
the echo's of :mod:`benchmarks.suite.scaling_echo`).

    python -m benchmarks.suite.scaling [--quick] [--models mnist_mlp] [--workers 1 2] [--systems tf_ps raw_echo]
                                 [--plot scaling.png]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.formatting import plot_scaling
from benchmarks.mlp_workload import MODELS, model_bytes, parameter_shapes
from benchmarks.suite import training_systems
from benchmarks.suite.processes import load_mark, other_load_since
from benchmarks.suite.psframe_internals import step_message_bytes
from benchmarks.suite.scaling_echo import run_echo_processes
from benchmarks.suite.scaling_tables import add_ratios, scaling_table

MODEL_NAMES = ("mnist_mlp", "large_mlp")
# (timed steps, warm-up steps) per worker
FULL_STEPS = {"mnist_mlp": (300, 50), "large_mlp": (10, 3)}
QUICK_STEPS = {"mnist_mlp": (20, 5), "large_mlp": (3, 1)}
QUICK_WORKERS = (1, 2)
# Echo clients time at least this long (and at least the model's timed steps
# in round trips): a trip takes far less than a step, and the server's CPU is
# sampled every 50 ms.
ECHO_SECONDS = 2.0
QUICK_ECHO_SECONDS = 0.5
# Cores left to the ps tasks when choosing the largest worker count.
CORES_FOR_PS = 2
# The psframe_kN rows serve one ps task from this many processes: a quarter of the cores, 2 to 4.
SERVING_PROCESSES = max(
    2, min(4, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) // 4)
)


@dataclass(frozen=True)
class Case:
    """One run of one system: its model, workers, ps tasks and steps per worker."""

    model: str
    workers: int
    ps_tasks: int
    steps: int
    warmup: int
    quick: bool = False


@dataclass(frozen=True)
class System:
    """An entry of :data:`SYSTEMS`.

    Args:
        name: the system's name in the rows.
        ps_counts: the ps task counts it runs with (a server count for the echo).
        run: runs one :class:`Case` before a ``time.monotonic()`` deadline and
            returns what it measured: ``global_steps_per_sec``,
            ``per_worker_steps_per_sec``, ``steps``, ``seconds``,
            ``window_rates``, ``requests_per_step``, ``request_bytes`` (the
            mean request), ``requests`` (answered in the timed window),
            ``server_cpu_seconds`` (the servers' CPU in that window; None if
            not measured) and ``processes``.
    """

    name: str
    ps_counts: tuple[int, ...]
    run: Callable[[Case, float], dict]


# ---------------------------------------------------------------- what a step sends


def step_plan_sizes(model: str, num_ps: int) -> list[int]:
    """The bytes pushed by each request of one async psframe step, as its worker plans them.

    Asks psframe's placement and step plan with the trainer's defaults
    (4 MiB messages), for the parameters :func:`benchmarks.mlp_workload.build_model`
    makes.
    """
    return step_message_bytes(parameter_shapes(model), num_ps)


def echo_payload(model: str) -> int:
    """The echo's payload for ``model``: psframe's mean request with 1 ps task."""
    plan = step_plan_sizes(model, 1)
    return round(sum(plan) / len(plan))


# ---------------------------------------------------------------- the systems


def _server_cpu(row: dict, names: Sequence[str]) -> float | None:
    """The CPU the processes ``names`` spent in the row's timed window (None if any is unknown)."""
    values = [row.get("cpu_seconds", {}).get(name) for name in names]
    return None if None in values else sum(values)


def _from_training_row(row: dict, servers: Sequence[str], requests_per_step: int, request_bytes: float) -> dict:
    return {
        "global_steps_per_sec": row["global_steps_per_sec"],
        "per_worker_steps_per_sec": row["per_worker_steps_per_sec"],
        "steps": row["steps"],
        "seconds": row["seconds"],
        "window_rates": row["window_rates"],
        "requests_per_step": requests_per_step,
        "request_bytes": request_bytes,
        "requests": row["steps"] * requests_per_step,
        "server_cpu_seconds": _server_cpu(row, servers),
        "processes": row["processes"],
    }


def run_psframe(case: Case, deadline: float, extra_flags: Sequence[str] = ()) -> dict:
    """psframe async: ``case.ps_tasks`` ps tasks, ``case.workers`` workers; ``extra_flags``
    go to every :mod:`benchmarks.suite.train_psframe` task (a variant is ``functools.partial`` of this)."""
    row = training_systems.run_psframe_processes(
        case.model,
        False,
        case.steps,
        case.warmup,
        deadline,
        extra_flags,
        num_workers=case.workers,
        num_ps=case.ps_tasks,
    )
    plan = step_plan_sizes(case.model, case.ps_tasks)
    return _from_training_row(row, [f"ps{i}" for i in range(case.ps_tasks)], len(plan), sum(plan) / len(plan))


def run_rpc(case: Case, deadline: float) -> dict:
    """The torch.distributed.rpc parameter server, async, with ``case.workers`` trainers."""
    row = training_systems.run_rpc_processes(
        case.model, False, case.steps, case.warmup, deadline, num_workers=case.workers
    )
    return _from_training_row(row, ["ps"], 1, model_bytes(case.model))


def run_tf(case: Case, deadline: float) -> dict:
    """TensorFlow's parameter server, async, with ``case.workers`` workers (one request per step).

    Raises:
        training_systems.SystemUnavailable: no TensorFlow environment here.
    """
    row = training_systems.run_tf_processes(case.model, case.steps, case.warmup, deadline, num_workers=case.workers)
    return _from_training_row(row, ["ps"], 1, model_bytes(case.model))


def run_echo(case: Case, deadline: float) -> dict:
    """The raw gRPC echo server and ``case.workers`` clients, one stream each, at :func:`echo_payload`."""
    seconds = QUICK_ECHO_SECONDS if case.quick else ECHO_SECONDS
    return run_echo_processes(case.workers, echo_payload(case.model), case.steps, case.warmup, seconds, deadline)


# Run in this order at every model and worker count, one after the other, so
# that the rows compared meet the same load. Another system is one more entry.
SYSTEMS: tuple[System, ...] = (
    System("psframe", (1, 2), run_psframe),
    # One ps task served from SERVING_PROCESSES processes (psframe.ps.serving.serving_processes).
    System(
        f"psframe_k{SERVING_PROCESSES}",
        (1,),
        functools.partial(run_psframe, extra_flags=[f"--serving_processes={SERVING_PROCESSES}"]),
    ),
    System("torch_rpc_ps", (1,), run_rpc),
    System("tf_ps", (1,), run_tf),
    System("raw_echo", (1,), run_echo),
)


# ---------------------------------------------------------------- the runs


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def worker_counts(cores: int) -> list[int]:
    """1, 2, 4, 8... up to ``cores`` less :data:`CORES_FOR_PS` (at least 2), and that number itself.

    2 cores: 1, 2; 8 cores: 1, 2, 4, 6; 16 cores: 1, 2, 4, 8, 14.
    """
    top = max(2, cores - CORES_FOR_PS)
    counts = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return counts if counts[-1] == top else [*counts, top]


def case_timeout(case: Case) -> float:
    """Seconds one run may take before it is killed: more for more processes."""
    return 60.0 if case.quick else 120.0 + 15.0 * case.workers


def run_case(system: System, case: Case, deadline: float) -> dict:
    """One row: ``system`` run on ``case`` (see :func:`run_scaling_benchmarks`)."""
    started, mark = time.monotonic(), load_mark()
    measured = system.run(case, min(deadline, started + case_timeout(case)))
    cpu, requests = measured["server_cpu_seconds"], measured["requests"]
    return {
        "model": case.model,
        "system": system.name,
        "ps_tasks": case.ps_tasks,
        "workers": case.workers,
        **measured,
        "server_cpu_ms_per_request": 1e3 * cpu / requests if cpu is not None and requests else math.nan,
        "steps_per_worker": case.steps,
        "warmup_steps": case.warmup,
        "cores": usable_cores(),
        "wall_seconds": round(time.monotonic() - started, 2),
        "other_cpu_load": other_load_since(mark),
    }


def _run_or_error(system: System, case: Case, deadline: float, timeout: float) -> dict:
    if time.monotonic() >= deadline:
        error = f"not run: the timeout of {timeout:g}s was spent"
    else:
        try:
            return run_case(system, case, deadline)
        except training_systems.SystemUnavailable as e:
            print(f"[scaling] {system.name} {case.model} unavailable: {e}", file=sys.stderr, flush=True)
            return {**_empty_row(system, case), "unavailable": str(e)}
        except Exception as e:  # noqa: BLE001 - one broken run must not cost the others' rows
            error = f"{type(e).__name__}: {e}"
    print(
        f"[scaling] {system.name} {case.ps_tasks} ps, {case.workers} workers, {case.model} failed: {error}",
        file=sys.stderr,
        flush=True,
    )
    return {**_empty_row(system, case), "error": error.splitlines()[0]}


def _empty_row(system: System, case: Case) -> dict:
    return {
        "model": case.model,
        "system": system.name,
        "ps_tasks": case.ps_tasks,
        "workers": case.workers,
        "global_steps_per_sec": math.nan,
        "per_worker_steps_per_sec": [],
        "steps": 0,
        "server_cpu_ms_per_request": math.nan,
        "cores": usable_cores(),
    }


def run_scaling_benchmarks(
    models: Sequence[str] = MODEL_NAMES,
    quick: bool = False,
    timeout: float = 1200.0,
    workers: Sequence[int] | None = None,
    systems: Sequence[System] | None = None,
) -> list[dict]:
    """Run every system at every worker count on every model.

    Args:
        models: names from :data:`benchmarks.mlp_workload.MODELS`.
        quick: few steps and N in :data:`QUICK_WORKERS` (a smoke test).
        timeout: seconds for the whole run; what is not done by then is
            reported with an ``error``.
        workers: the worker counts; by default :func:`worker_counts` of the
            usable cores (:data:`QUICK_WORKERS` when ``quick``).
        systems: by default :data:`SYSTEMS`.

    Returns:
        One row per (model, workers, system, ps tasks), those of one model and
        N run back to back: ``model``, ``system``, ``ps_tasks``, ``workers``,
        ``global_steps_per_sec`` (raw_echo: round trips/s),
        ``per_worker_steps_per_sec``, ``requests_per_step``, ``request_bytes``,
        ``requests``, ``server_cpu_seconds``, ``server_cpu_ms_per_request``,
        ``cores``, ``other_cpu_load``..., and the ratios of
        :func:`benchmarks.suite.scaling_tables.add_ratios`.
        A run that failed has ``error`` and NaN numbers, one of a system that
        cannot run here (tf_ps without its environment) ``unavailable``; the
        others still run.

    Raises:
        ValueError: an unknown model, or a worker count below 1.
    """
    models = (models,) if isinstance(models, str) else tuple(models)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; expected names from {sorted(MODELS)}")
    counts = list(workers or (QUICK_WORKERS if quick else worker_counts(usable_cores())))
    if any(n < 1 for n in counts):
        raise ValueError(f"worker counts must be >= 1, got {counts}")
    deadline = time.monotonic() + timeout
    steps = QUICK_STEPS if quick else FULL_STEPS
    rows = []
    for model in models:
        for n in counts:
            for system in systems or SYSTEMS:
                for ps_tasks in system.ps_counts:
                    case = Case(model, n, ps_tasks, *steps[model], quick=quick)
                    rows.append(_run_or_error(system, case, deadline, timeout))
    return add_ratios(rows)


# ---------------------------------------------------------------- command line


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scaling benchmark and print its table; 1 if a run failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, 1 and 2 workers, mnist_mlp (smoke test)")
    parser.add_argument(
        "--models", nargs="+", default=None, choices=sorted(MODELS), help="default: both (mnist_mlp only with --quick)"
    )
    parser.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=None,
        help="worker counts (default: 1, 2, 4... up to the usable cores less 2)",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        choices=[s.name for s in SYSTEMS],
        help="run only these systems (default: all)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--plot", type=Path, default=None, help="also write the plot (PNG) to this file")
    args = parser.parse_args(argv)
    # `timeout`/`kill` send SIGTERM: unwind, so that every child is stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    models = args.models or (MODEL_NAMES[:1] if args.quick else MODEL_NAMES)
    started = time.monotonic()
    systems = None if args.systems is None else [s for s in SYSTEMS if s.name in args.systems]
    rows = run_scaling_benchmarks(models, quick=args.quick, timeout=args.timeout, workers=args.workers, systems=systems)
    print(scaling_table(rows))
    print(f"\n({time.monotonic() - started:.0f}s in all on {usable_cores()} usable cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot_scaling(rows, args.plot)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

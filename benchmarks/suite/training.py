"""Training throughput: psframe against torch.distributed and TensorFlow baselines, on loopback.

Seven systems train the same models on the same fixed synthetic data with
plain SGD (lr 0.01), batch 100 per worker, one compute thread per process:

=================  =====  ==========================================================
system             mode   processes, and what one step is
=================  =====  ==========================================================
psframe            async  1 ps + 2 workers (:mod:`benchmarks.suite.train_psframe`); a
                          worker pushes its gradients and pulls the parameters in
                          one gRPC call; the ps applies each push at once. On one
                          host (here) the tensors themselves travel through shared
                          memory, gRPC carrying the headers (psframe's default).
psframe_grpc       async  the same with ``Transport(same_host_memory=False)``: every byte
                          through gRPC, as between hosts.
psframe            sync   the same with ``SyncReplicas()`` (R = N = 2): one update
                          averages both workers' gradients.
psframe_bf16       async  psframe async with ``wire_dtype="bfloat16"``: gradients
                          and parameters travel in bfloat16 (half the bytes; the
                          ps keeps float32). Optional, off by default in psframe.
torch_rpc_ps       async  1 ps + 2 trainers (:mod:`benchmarks.baselines.rpc_ps`), the
                          RPC parameter-server tutorial's design: one ``rpc_sync``
                          per step sends the gradients and returns the parameters;
                          the ps applies them under a lock with ``torch.optim.SGD``.
torch_rpc_ps       sync   the batch-RPC tutorial's design: the ps waits for both
                          trainers' gradients, averages, steps once and answers both.
tf_ps              async  1 ps + 2 workers of TensorFlow 1.x-style between-graph
                          replication (:mod:`benchmarks.baselines.tf_ps`,
                          ``replica_device_setter``, ``GradientDescentOptimizer``):
                          one ``session.run`` per step reads the variables from
                          the ps and has the ps apply the gradients (no lock, TF's
                          default). Runs in its own environment
                          (:mod:`benchmarks.baselines.tf_env`); where that is missing its
                          rows say "unavailable".
ddp_gloo           -      2 ranks of ``DistributedDataParallel`` over gloo
                          (:mod:`benchmarks.baselines.ddp`): all-reduce, local step.
single_process     -      the same loop in one process (the upper bound).
=================  =====  ==========================================================

Every process runs on 127.0.0.1 with ports from
:func:`psframe.launch.pick_free_ports`, prints one JSON line with what it
measured, and is killed (by PID) if anything fails or the deadline passes;
:mod:`benchmarks.suite.training_systems` starts each system's processes, this
module runs the systems in turn, repeats them and keeps the median runs.

Rates are measured after the warm-up steps: the timed window is cut into
:data:`NUM_WINDOWS` pieces and the median piece's rate is reported.
``global_steps_per_sec`` counts model updates (at the psframe and TF chiefs, at the
RPC ps, per DDP rank, per step of the single process) and
``samples_per_sec`` is the examples those updates consumed: global steps/s x
100 for async updates and the single process, x 100 x 2 for synchronous ones
and DDP.

``cpu_ms_per_step`` is the CPU time (user + system, every thread) that all
processes of a system spent inside the timed window, per global step: the
parent samples each child's CPU time while it runs and interpolates it at
the window's ends (the parent's and the children's ``perf_counter`` are the
same system-wide monotonic clock); ``cpu_seconds`` has each process's share.
It says where a system's work is done, and how much of it there is per step.

Run it::

    python -m benchmarks.suite.training [--quick] [--models mnist_mlp large_mlp] [--systems psframe tf_ps]
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.common import NUM_WINDOWS
from benchmarks.mlp_workload import BATCH_SIZE, MODELS
from benchmarks.suite.processes import load_mark, other_load_since
from benchmarks.suite.training_systems import (
    SystemUnavailable,
    run_ddp_processes,
    run_psframe_processes,
    run_rpc_processes,
    run_single_process,
    run_tf_processes,
)
from benchmarks.suite.training_tables import format_table

# (timed steps, warm-up steps) per worker
FULL_STEPS = {"mnist_mlp": (2000, 200), "large_mlp": (30, 5)}
QUICK_STEPS = {"mnist_mlp": (20, 5), "large_mlp": (3, 1)}
# In the order they run in each repeat: every psframe row right before the
# baselines it is compared with, so that they meet the same load.
SYSTEMS = (
    ("psframe", "async"),
    ("psframe_grpc", "async"),
    ("torch_rpc_ps", "async"),
    ("tf_ps", "async"),
    ("psframe", "sync"),
    ("torch_rpc_ps", "sync"),
    ("psframe_bf16", "async"),
    ("ddp_gloo", "-"),
    ("single_process", "-"),
)
# The systems in the order the report's plot shows them.
PLOT_ORDER = ("psframe", "psframe_grpc", "psframe_bf16", "torch_rpc_ps", "tf_ps", "ddp_gloo", "single_process")


def run_system(system: str, model: str, mode: str, steps: int, warmup: int, deadline: float) -> dict:
    """Run one system on one model; returns its row (see :func:`run_training_benchmarks`)."""
    started, mark = time.monotonic(), load_mark()
    if system == "psframe":
        measured = run_psframe_processes(model, mode == "sync", steps, warmup, deadline)
    elif system == "psframe_grpc":
        measured = run_psframe_processes(model, mode == "sync", steps, warmup, deadline, ["--no_shared_memory"])
    elif system == "psframe_bf16":
        measured = run_psframe_processes(model, mode == "sync", steps, warmup, deadline, ["--wire_dtype=bfloat16"])
    elif system == "torch_rpc_ps":
        measured = run_rpc_processes(model, mode == "sync", steps, warmup, deadline)
    elif system == "tf_ps":
        if mode != "async":
            raise ValueError(f"tf_ps runs async only, not {mode!r}")
        measured = run_tf_processes(model, steps, warmup, deadline)
    elif system == "ddp_gloo":
        measured = run_ddp_processes(model, steps, warmup, deadline)
    elif system == "single_process":
        measured = run_single_process(model, steps, warmup, deadline)
    else:
        raise ValueError(f"unknown system {system!r}; expected one of {sorted({s for s, _ in SYSTEMS})}")
    return {
        "system": system,
        "model": model,
        "mode": mode,
        **measured,
        "steps_per_worker": steps,
        "warmup_steps": warmup,
        "batch_size": BATCH_SIZE,
        "wall_seconds": round(time.monotonic() - started, 2),
        "other_cpu_load": other_load_since(mark),
    }


def run_training_benchmarks(
    models: Sequence[str] = ("mnist_mlp", "large_mlp"),
    quick: bool = False,
    timeout: float = 600,
    *,
    system_timeout: float | None = None,
    repeats: int | Mapping[str, int] = 1,
    systems: Sequence[str] | None = None,
) -> list[dict]:
    """Measure training throughput of every system on every model.

    Args:
        models: names from :data:`MODELS`.
        quick: a few steps per system (a smoke test of every system end to end).
        repeats: runs of every system per model (one number for every
            model, or one per model name), interleaved (all systems once,
            then all again...), so that load from outside the benchmark that
            comes and goes weighs on every system alike; each row reports the
            run with the median rate, and every run's rate in ``run_rates``.
        timeout: seconds for the whole run; systems not finished by then are
            killed and reported with an ``error``.
        system_timeout: seconds one system (one set of processes) may take
            before it is killed and reported with an ``error``; by default
            60 when ``quick``, else twice its share of ``timeout`` (at least 60).
        systems: names of the systems to run (every mode of each), in
            :data:`SYSTEMS`'s order; by default all.

    Returns:
        One row per (system, model, mode) with ``system``, ``model``, ``mode``
        (``"async"``, ``"sync"`` or ``"-"``), ``global_steps_per_sec``,
        ``samples_per_sec``, ``steps`` (timed global steps; per rank for DDP),
        ``seconds`` (of the timed window), ``per_worker_steps_per_sec``,
        ``window_rates``, ``processes``... A system that failed has
        ``error`` (the message) and NaN rates; one that cannot run here
        (tf_ps without its environment) has ``unavailable`` (why) and NaN
        rates; the others still run.

    Raises:
        ValueError: an unknown model or system name.
    """
    models = (models,) if isinstance(models, str) else tuple(models)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; expected names from {sorted(MODELS)}")
    if isinstance(repeats, Mapping) and not set(models) <= set(repeats):
        raise ValueError(f"repeats {dict(repeats)} has no count for {sorted(set(models) - set(repeats))}")
    per_model = {m: repeats[m] if isinstance(repeats, Mapping) else repeats for m in models}
    if any(n < 1 for n in per_model.values()):
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = [s for s, _ in SYSTEMS]
    if systems is not None and not set(systems) <= set(names):
        raise ValueError(
            f"unknown system(s) {sorted(set(systems) - set(names))}; expected names from {sorted(set(names))}"
        )
    selected = [key for key in SYSTEMS if systems is None or key[0] in systems]
    deadline = time.monotonic() + timeout
    if system_timeout is None:
        system_timeout = 60.0 if quick else max(60.0, 2 * timeout / max(1, len(selected) * sum(per_model.values())))
    counts = QUICK_STEPS if quick else FULL_STEPS
    rows = []
    for model in models:
        steps, warmup = counts[model]
        runs: dict[tuple[str, str], list[dict]] = {key: [] for key in selected}
        for _ in range(per_model[model]):
            for system, mode in selected:
                runs[system, mode].append(
                    _run_or_error(system, model, mode, steps, warmup, deadline, timeout, system_timeout)
                )
        rows += [_median_run(runs[key]) for key in selected]
    return rows


def _run_or_error(
    system: str, model: str, mode: str, steps: int, warmup: int, deadline: float, timeout: float, system_timeout: float
) -> dict:
    if time.monotonic() >= deadline:
        error = f"not run: the timeout of {timeout:g}s was spent"
    else:
        try:
            return run_system(system, model, mode, steps, warmup, min(deadline, time.monotonic() + system_timeout))
        except SystemUnavailable as e:
            print(f"[training] {system} {mode} {model} unavailable: {e}", file=sys.stderr, flush=True)
            return {**_empty_row(system, model, mode), "unavailable": str(e)}
        except Exception as e:  # noqa: BLE001 - one broken system must not cost the others' rows
            error = f"{type(e).__name__}: {e}"
    print(f"[training] {system} {mode} {model} failed: {error}", file=sys.stderr, flush=True)
    return {**_empty_row(system, model, mode), "error": error}


def _empty_row(system: str, model: str, mode: str) -> dict:
    return {
        "system": system,
        "model": model,
        "mode": mode,
        "global_steps_per_sec": math.nan,
        "samples_per_sec": math.nan,
        "steps": 0,
        "seconds": math.nan,
    }


def _median_run(runs: list[dict]) -> dict:
    """The run of median rate among those that worked (an error row if none did), with every run's rate."""
    good = sorted(
        (r for r in runs if "error" not in r and "unavailable" not in r), key=lambda r: r["global_steps_per_sec"]
    )
    if not good:
        return runs[-1]
    return {**good[(len(good) - 1) // 2], "run_rates": [r["global_steps_per_sec"] for r in runs]}


# ---------------------------------------------------------------- command line


def _raise_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per system (smoke test)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        choices=sorted({s for s, _ in SYSTEMS}),
        help="run only these systems (default: all)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of every system, interleaved; rows report the median run"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    # `timeout`/`kill` send SIGTERM: unwind, so that every child is stopped on the way out.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    started = time.monotonic()
    rows = run_training_benchmarks(
        args.models, quick=args.quick, timeout=args.timeout, repeats=args.repeats, systems=args.systems
    )
    print(format_table(rows))
    print(
        f"\n({time.monotonic() - started:.0f}s in all; rates are medians of {NUM_WINDOWS} windows "
        f"after warm-up; batch {BATCH_SIZE} per worker; 1 thread per process; other load: cores "
        f"busy with work outside the benchmark while the system ran)"
    )
    for r in rows:
        if "error" in r or "unavailable" in r:
            what = r["error"] if "error" in r else f"unavailable: {r['unavailable']}"
            print(f"\n{r['system']} {r['mode']} {r['model']}: {what}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

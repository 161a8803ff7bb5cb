#!/usr/bin/env python3
"""One task of a psframe training benchmark (ps or worker), as in examples/mlp_mnist_dist.py.

    python -m benchmarks.suite.train_psframe --ps_hosts=127.0.0.1:2222 \\
        --worker_hosts=127.0.0.1:2223,127.0.0.1:2224 --job_name=ps --task_index=0
    python -m benchmarks.suite.train_psframe ... --job_name=worker --task_index=0 --model=mnist_mlp [--sync]
    python -m benchmarks.suite.train_psframe ... --job_name=worker --task_index=1 --model=mnist_mlp [--sync]

Every worker trains until the global step reaches the warm-up plus the timed
steps of all workers (async: (warmup + steps) x workers; sync: warmup + steps),
so every worker is busy until the end. The chief measures global steps/s over
the steps after warm-up, as the median of a few windows. Each task prints one
JSON line. :mod:`benchmarks.suite.training_systems` starts these processes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.nn.functional as F

import psframe
from benchmarks.common import NUM_WINDOWS, emit, file_barrier, timed_windows
from benchmarks.mlp_workload import (
    BATCH_SIZE,
    LEARNING_RATE,
    MODELS,
    batches,
    build_model,
    make_data,
    set_single_thread,
)
from psframe import flags
from psframe.hooks import StopAtStepHook


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_cluster_flags(parser)
    parser.add_argument("--model", default="mnist_mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per worker first")
    parser.add_argument("--sync", action="store_true", help="SyncReplicas (R = N = the number of workers)")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--windows", type=int, default=NUM_WINDOWS, help="timed windows (the median is reported)")
    parser.add_argument(
        "--barrier_dir",
        default=None,
        help="workers wait for each other here after connecting, so timing starts together",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any wait may take")
    parser.add_argument(
        "--sync_timeout", type=float, default=60.0, help="seconds a synchronous step may wait for the other workers"
    )
    parser.add_argument(
        "--max_shard_bytes", type=int, default=None, help="largest stored part (one message); default: psframe's"
    )
    parser.add_argument(
        "--wire_dtype",
        default=None,
        choices=["bfloat16", "float16"],
        help="compress gradients and parameters on the wire (default: as stored)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where each worker computes (cpu, cuda, cuda:1); the ps stays on the CPU"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="send a step's messages during backward (overlap_backward=True)"
    )
    parser.add_argument(
        "--no_shared_memory",
        action="store_true",
        help="every byte through gRPC, as across hosts (default: shared memory on one host)",
    )
    parser.add_argument(
        "--serving_processes",
        type=int,
        default=1,
        help="ps: processes serving the task's port (psframe.ps.serving.serving_processes)",
    )
    parser.add_argument("--log_level", default="WARNING", help="logging level (INFO shows psframe's progress)")
    return parser.parse_args(argv)


def run_worker(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> dict:
    x, y = (tensor.to(args.device) for tensor in make_data())
    model = build_model(args.model)
    num_workers = cluster.num_workers
    per_round = 1 if args.sync else num_workers  # global steps per step of every worker
    warmup_step = args.warmup * per_round
    last_step = (args.warmup + args.steps) * per_round
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=psframe.optim.SGD(lr=args.learning_rate),
        sync=psframe.SyncReplicas(timeout=min(args.sync_timeout, args.timeout)) if args.sync else None,
        hooks=[StopAtStepHook(last_step=last_step)],
        transport=psframe.Transport(
            connect_timeout=args.timeout, wire_dtype=args.wire_dtype, same_host_memory=not args.no_shared_memory
        ),
        placement=psframe.Placement(max_shard_bytes=args.max_shard_bytes) if args.max_shard_bytes else None,
        overlap_backward=args.overlap,
        device=args.device,
    )
    times: list[float] = []
    global_steps: list[int] = []
    local_steps: list[int] = []
    with trainer:
        if args.barrier_dir:
            file_barrier(args.barrier_dir, f"worker{task_index}", num_workers, args.timeout)
        for indices in batches(len(x), args.batch_size, seed=1 + task_index):
            indices = indices.to(args.device)
            if trainer.should_stop():
                break
            loss = F.cross_entropy(model(x[indices]), y[indices])
            global_step = trainer.step(loss)
            times.append(time.perf_counter())
            global_steps.append(global_step)
            local_steps.append(trainer.stats.local_step)
        final_loss = loss.item()
    # This worker's own rate: its steps from the moment the global step passed warm-up.
    first = next((i for i, g in enumerate(global_steps) if g >= warmup_step), len(global_steps) - 1)
    local = timed_windows(times[first:], local_steps[first:], 0, args.windows)
    result = {
        "task": f"worker{task_index}",
        "sync": args.sync,
        "model": args.model,
        "local_steps": trainer.stats.local_step,
        "global_step": trainer.global_step,
        "dropped_steps": trainer.stats.dropped_steps,
        "local_steps_per_sec": local["steps_per_sec"],
        "final_loss": final_loss,
    }
    if trainer.is_chief:
        timed = timed_windows(times, global_steps, warmup_step, args.windows)
        result.update(
            global_steps_per_sec=timed["steps_per_sec"],
            window_rates=timed["window_rates"],
            overall_steps_per_sec=timed["overall_steps_per_sec"],
            timed_global_steps=timed["steps"],
            seconds=timed["seconds"],
            window=timed["window"],
        )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_single_thread()
    psframe.tune_process()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster, job_name, task_index = flags.cluster_from_flags(args)
    if job_name == "ps":
        server = psframe.Server(cluster, "ps", task_index, serving_processes=args.serving_processes)
        if not server.join(timeout=args.timeout):
            server.stop(grace=0.5)
            print(f"ps{task_index}: the workers did not finish within {args.timeout:g}s", file=sys.stderr)
            return 1
        emit({"task": f"ps{task_index}", "exit": "clean"})
        return 0
    emit(run_worker(args, cluster, task_index))
    return 0


if __name__ == "__main__":
    sys.exit(main())

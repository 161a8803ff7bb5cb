#!/usr/bin/env python3
"""DistributedDataParallel over gloo, and the same loop in one process: psframe's baselines.

Each rank trains a replica with ``torch.optim.SGD``; every step DDP
all-reduces (averages) the gradients during ``backward()`` over gloo on
127.0.0.1, then each rank applies the same update locally. ``--single`` runs
the identical loop in one process without a process group (the upper bound).
Each rank prints one JSON line: its steps/s after warm-up (median of a few
windows).

    python -m benchmarks.baselines.ddp --port=29500 --world_size=2 --rank=0 --model=mnist_mlp
    python -m benchmarks.baselines.ddp --port=29500 --world_size=2 --rank=1 --model=mnist_mlp
    python -m benchmarks.baselines.ddp --single --model=mnist_mlp
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo connects over loopback only

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import NUM_WINDOWS, emit, timed_windows
from benchmarks.mlp_workload import (
    BATCH_SIZE,
    LEARNING_RATE,
    MODELS,
    batches,
    build_model,
    make_data,
    set_single_thread,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="one process, no process group")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (DDP)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--model", default="mnist_mlp", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per rank")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per rank first")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--windows", type=int, default=NUM_WINDOWS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any collective may take")
    args = parser.parse_args(argv)
    if not args.single and args.port is None:
        parser.error("--port is required unless --single")
    return args


def train(args: argparse.Namespace) -> dict:
    x, y = make_data()
    model = build_model(args.model)
    if not args.single:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    times: list[float] = []
    try:
        for step, indices in enumerate(batches(len(x), args.batch_size, seed=1 + args.rank), start=1):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x[indices]), y[indices])
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter())
            if step == args.warmup + args.steps:
                break
        final_loss = loss.item()
    finally:
        if not args.single and dist.is_initialized():
            dist.destroy_process_group()
    timed = timed_windows(times, range(1, len(times) + 1), args.warmup, args.windows)
    return {
        "task": "single" if args.single else f"rank{args.rank}",
        "model": args.model,
        "world_size": 1 if args.single else args.world_size,
        "local_steps_per_sec": timed["steps_per_sec"],
        "window_rates": timed["window_rates"],
        "overall_steps_per_sec": timed["overall_steps_per_sec"],
        "timed_steps": timed["steps"],
        "seconds": timed["seconds"],
        "window": timed["window"],
        "final_loss": final_loss,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_single_thread()
    emit(train(args))
    return 0


if __name__ == "__main__":
    code = main()
    # The result is printed and the process group destroyed; skip the
    # interpreter's teardown, where a gloo thread left behind by the DDP
    # reducer has been seen to abort the process ("terminate called without an
    # active exception", exit -6) and cost a measured run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

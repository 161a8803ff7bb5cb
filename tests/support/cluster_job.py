#!/usr/bin/env python3
"""A small training job for the multi-process tests.

A linear regression on fixed synthetic data (so the result has an oracle),
optionally with a large extra parameter ``big`` whose gradient is a
constant: after G global steps of SGD every element must equal its initial
value (its row index) minus G * lr * BIG_GRAD, which checks that every part
of a partitioned variable made the round trip intact.

Every task prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time

import torch

import psframe
from psframe.flags import add_cluster_flags, add_security_flags, cluster_from_flags, security_from_flags
from psframe.hooks import StopAtStepHook

BIG_GRAD = 16.0  # with the default lr (2**-4) each step subtracts exactly 1.0
FEATURES = 8


class Model(torch.nn.Module):
    def __init__(self, big_rows: int, big_cols: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, 1)
        self.big = None
        if big_rows:
            rows = torch.arange(big_rows, dtype=torch.float32).unsqueeze(1)
            self.big = torch.nn.Parameter(rows.expand(big_rows, big_cols).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.big is not None:
            loss = loss + self.big.sum() * BIG_GRAD  # d loss / d big == BIG_GRAD everywhere
        return loss


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(512, FEATURES, generator=generator)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float32).unsqueeze(1) / FEATURES
    return x, x @ w + 0.5


def read_in_ranges(trainer: psframe.Trainer, model: Model, args: argparse.Namespace) -> None:
    """Train on ``--data_ranges`` examples (rows of the data, repeated) in ranges, each once an epoch,
    recording each batch before its step and whether the step was applied."""
    x, y = data()
    ranges = psframe.DataRanges("examples", args.data_ranges, batch_size=16, range_size=128, epochs=args.epochs)
    with open(args.seen_file, "a") as seen:
        for indices in trainer.read(ranges):
            seen.write(f"B {','.join(map(str, indices.tolist()))}\n")
            seen.flush()
            time.sleep(args.step_delay)
            dropped = trainer.stats.dropped_steps
            rows = indices % len(x)
            trainer.step(model.loss(x[rows], y[rows]))
            if trainer.stats.dropped_steps == dropped:
                seen.write("A\n")
                seen.flush()
            print(f"local step {trainer.stats.local_step} global step {trainer.global_step}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    add_cluster_flags(parser)
    add_security_flags(parser)
    parser.add_argument("--train_steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.0625)
    parser.add_argument("--big_mb", type=float, default=0.0, help="size of the extra parameter in MB")
    parser.add_argument("--big_cols", type=int, default=1024)
    parser.add_argument("--connect_timeout", type=float, default=60.0)
    parser.add_argument("--sync_replicas", action="store_true")
    parser.add_argument("--replicas_to_aggregate", type=int, default=None)
    parser.add_argument("--total_num_replicas", type=int, default=None)
    parser.add_argument("--sync_timeout", type=float, default=60.0)
    parser.add_argument("--max_local_steps", type=int, default=None, help="this worker stops after N steps")
    parser.add_argument("--worker_timeout", type=float, default=60.0, help="ps: presume silent workers dead")
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--save_checkpoint_steps", type=int, default=None)
    parser.add_argument("--optimizer", default="SGD", help="SGD or Adam (ps-side)")
    parser.add_argument("--step_delay", type=float, default=0.0, help="seconds of sleep before each step")
    parser.add_argument("--max_workers", type=int, default=None, help="ps: worker slots (an elastic cluster)")
    parser.add_argument("--serving_processes", type=int, default=None, help="ps: processes serving the task")
    parser.add_argument(
        "--data_ranges", type=int, default=0, help="read this many examples in ranges (psframe.DataRanges)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="with --data_ranges")
    parser.add_argument(
        "--seen_file",
        default=None,
        help="with --data_ranges: append 'B <indices>' before each step and 'A' once it was applied",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cluster, job_name, task_index = cluster_from_flags(args)
    if job_name == "ps":
        psframe.Server(
            cluster,
            "ps",
            task_index,
            worker_timeout=args.worker_timeout,
            checkpoint_dir=args.checkpoint_dir,
            security=security_from_flags(args),
            max_workers=args.max_workers,
            serving_processes=args.serving_processes,
        ).join()
        print(json.dumps({"task": f"ps{task_index}", "exit": "clean"}), flush=True)
        return 0

    big_rows = math.ceil(args.big_mb * 1e6 / (4 * args.big_cols))
    torch.manual_seed(0)
    model = Model(big_rows, args.big_cols)
    x, y = data()
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=getattr(psframe.optim, args.optimizer)(lr=args.lr),
        sync=psframe.SyncReplicas(args.replicas_to_aggregate, args.total_num_replicas, args.sync_timeout)
        if args.sync_replicas
        else None,
        hooks=[StopAtStepHook(last_step=args.train_steps)],
        transport=psframe.Transport(connect_timeout=args.connect_timeout),
        checkpointing=psframe.Checkpointing(args.checkpoint_dir, save_steps=args.save_checkpoint_steps)
        if args.checkpoint_dir
        else None,
        security=security_from_flags(args),
    )
    with trainer:
        with torch.no_grad():
            initial_loss = torch.nn.functional.mse_loss(model(x), y).item()
        if args.data_ranges:
            read_in_ranges(trainer, model, args)
        generator = torch.Generator().manual_seed(task_index)
        while not args.data_ranges and not trainer.should_stop() and trainer.stats.local_step != args.max_local_steps:
            batch = torch.randint(0, len(x), (64,), generator=generator)
            time.sleep(args.step_delay)
            trainer.step(model.loss(x[batch], y[batch]))
            print(f"local step {trainer.stats.local_step} global step {trainer.global_step}", flush=True)
        trainer.pull()
        result = {
            "task": f"worker{task_index}",
            "global_step": trainer.global_step,
            "local_steps": trainer.stats.local_step,
            "dropped_steps": trainer.stats.dropped_steps,
            "recoveries": trainer.stats.recoveries,
            "initial_loss": initial_loss,
            "final_loss": torch.nn.functional.mse_loss(model(x), y).item(),
        }
        if model.big is not None:
            rows = torch.arange(big_rows, dtype=torch.float32).unsqueeze(1)
            expected = rows - trainer.global_step * args.lr * BIG_GRAD
            result["big_bytes"] = model.big.numel() * 4
            result["big_max_error"] = (model.big.detach() - expected).abs().max().item()
            result["big_parts"] = len(trainer.placement.shards_of("big"))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Distributed training of an MLP on MNIST with psframe (TF's mnist_replica.py, for PyTorch).

One process per task, started in any order:

    python examples/mlp_mnist_dist.py --ps_hosts=localhost:2222 \\
        --worker_hosts=localhost:2223,localhost:2224 --job_name=ps --task_index=0
    python examples/mlp_mnist_dist.py ... --job_name=worker --task_index=0   # the chief
    python examples/mlp_mnist_dist.py ... --job_name=worker --task_index=1

or all of them at once: ``psframe launch --num_ps 1 --num_workers 2 examples/mlp_mnist_dist.py``.
Every task takes ``--auth_token_file`` and ``--tls_cert_file/--tls_key_file/--tls_ca_file``
(README: Security); ``psframe launch`` gives its tasks a fresh token of their own.

The data must be in --data_dir (``python scripts/fetch_mnist.py`` puts it
there). Training stops at global step --train_steps; the chief then evaluates
the final parameters on the test set and prints one JSON line as the last
line of its output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mnist_data import load_mnist
from tqdm import tqdm

import psframe
from psframe.flags import (
    add_cluster_flags,
    add_liveness_flags,
    add_security_flags,
    add_sync_flags,
    cluster_from_flags,
    liveness_from_flags,
    run,
    security_from_flags,
    staleness_from_flags,
    sync_from_flags,
)
from psframe.hooks import NanGuardHook, StopAtStepHook

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
log = logging.getLogger("mlp_mnist_dist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_flags(parser)
    add_sync_flags(parser)
    add_security_flags(parser)  # --auth_token_file, --tls_cert_file, --tls_key_file, --tls_ca_file
    add_liveness_flags(parser)  # --keepalive_time, --keepalive_timeout
    parser.add_argument("--train_steps", type=int, default=6000, help="the global step at which training stops")
    parser.add_argument("--batch_size", type=int, default=100, help="examples per worker step")
    parser.add_argument("--learning_rate", type=float, default=0.1, help="SGD learning rate (on the ps)")
    parser.add_argument("--hidden_units", type=int, default=100, help="units of the hidden layer")
    parser.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder holding MNIST/raw/")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N for the worker's replica")
    parser.add_argument(
        "--gpu_memory_fraction", type=float, default=None, help="cap on this worker's share of GPU memory (CUDA only)"
    )
    parser.add_argument(
        "--max_local_steps",
        type=int,
        default=None,
        help="this worker leaves after this many of its own steps (in an elastic cluster, where the ps tasks "
        "have --max_workers, the others train on); default: it trains until --train_steps",
    )
    parser.add_argument(
        "--epochs_exactly_once",
        type=int,
        default=None,
        help="read this many epochs of the training set in ranges handed out by ps 0 (psframe.DataRanges): "
        "each example once an epoch across the workers, whoever joins, leaves or dies; training ends when "
        "they are consumed (or at --train_steps). Default: each worker draws its own batches",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial model and data order")
    parser.add_argument("--log_every", type=int, default=1000, help="log progress every N local steps")
    parser.add_argument(
        "--checkpoint_dir",
        default=None,
        help="save checkpoints here (any fsspec URL); run again after a crash to resume",
    )
    parser.add_argument(
        "--save_checkpoint_steps", type=int, default=1000, help="with --checkpoint_dir, save every N global steps"
    )
    parser.add_argument(
        "--wire_dtype",
        default=None,
        choices=["bfloat16", "float16"],
        help="send gradients and receive parameters in this dtype (half the bytes); "
        "default: exactly as stored (float32)",
    )
    parser.add_argument("--progress", action="store_true", help="show a progress bar on the chief")
    parser.add_argument(
        "--worker_timeout",
        type=float,
        default=60.0,
        help="ps: once some workers finished, seconds of silence after which a worker "
        "other than the chief is presumed dead and not waited for",
    )
    parser.add_argument(
        "--chief_timeout",
        type=float,
        default=None,
        help="ps: the same for the chief, which is waited for longer (default: 10 x --worker_timeout)",
    )
    parser.add_argument(
        "--max_workers",
        type=int,
        default=None,
        help="ps: worker slots of an elastic cluster: workers started with a longer --worker_hosts join "
        "the running job up to this many, and workers may leave (default: the workers are fixed)",
    )
    parser.add_argument(
        "--serving_processes",
        type=int,
        default=None,
        help="ps: processes listening on the task's port (this one holds the variables); "
        "default: one per 4 cores this task may use, at most 8",
    )
    parser.add_argument(
        "--connect_timeout", type=float, default=120.0, help="seconds to wait for the other tasks before failing"
    )
    return parser.parse_args(argv)


def build_model(hidden_units: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(28 * 28, hidden_units),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden_units, 10),
    )


def run_ps(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    server = psframe.Server(
        cluster,
        "ps",
        task_index,
        worker_timeout=args.worker_timeout,
        chief_timeout=args.chief_timeout,
        checkpoint_dir=args.checkpoint_dir,
        serving_processes=args.serving_processes,
        max_workers=args.max_workers,
        liveness=liveness_from_flags(args),
        security=security_from_flags(args),
    )
    server.join()  # returns once every worker has finished
    return 0


def batches(num_examples: int, batch_size: int, seed: int):
    """Endless random mini-batches of indices, reshuffled every epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(num_examples, generator=generator)
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(images).argmax(dim=1) == labels).float().mean().item()


def run_worker(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    device = torch.device(args.device)
    train_x, train_y = (t.to(device) for t in load_mnist(args.data_dir, train=True))
    torch.manual_seed(args.seed)  # the chief's initial values are the ones that count
    model = build_model(args.hidden_units)
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=psframe.optim.SGD(lr=args.learning_rate),
        sync=sync_from_flags(args),
        staleness=staleness_from_flags(args),
        device=device,
        gpu_memory_fraction=args.gpu_memory_fraction,
        hooks=[StopAtStepHook(last_step=args.train_steps), NanGuardHook()],
        checkpointing=psframe.Checkpointing(args.checkpoint_dir, save_steps=args.save_checkpoint_steps)
        if args.checkpoint_dir
        else None,
        transport=psframe.Transport(connect_timeout=args.connect_timeout, wire_dtype=args.wire_dtype),
        liveness=liveness_from_flags(args),
        security=security_from_flags(args),
    )
    progress = None
    with trainer:
        first_step, start = trainer.global_step, time.perf_counter()
        if args.progress and trainer.is_chief:
            progress = tqdm(total=args.train_steps, initial=first_step, unit="step", desc="global step")
        if args.epochs_exactly_once:
            ranges = psframe.DataRanges(
                "mnist-train", len(train_x), args.batch_size, epochs=args.epochs_exactly_once, seed=args.seed
            )
            order = trainer.read(ranges)
        else:
            order = batches(len(train_x), args.batch_size, args.seed + 1 + task_index)
        for indices in order:
            if trainer.should_stop() or trainer.stats.local_step == args.max_local_steps:
                break
            indices = indices.to(device)
            loss = F.cross_entropy(model(train_x[indices]), train_y[indices])
            global_step = trainer.step(loss)
            if progress is not None:
                progress.update(global_step - progress.n)
            if trainer.stats.local_step % args.log_every == 0:
                rate = (global_step - first_step) / (time.perf_counter() - start)
                log.info(
                    "worker %d: local step %d, global step %d, loss %.4f, %.0f global steps/s",
                    task_index,
                    trainer.stats.local_step,
                    global_step,
                    loss.item(),
                    rate,
                )
        wall = time.perf_counter() - start
        if progress is not None:
            progress.close()
        if not trainer.is_chief:
            log.info(
                "worker %d done after %d local steps; steps ahead of the slowest worker: %s",
                task_index,
                trainer.stats.local_step,
                json.dumps({str(k): v for k, v in trainer.stats.steps_ahead.items()}),
            )
            return 0
        trainer.pull()  # the final parameters, with every worker's last update
        test_x, test_y = (t.to(device) for t in load_mnist(args.data_dir, train=False))
        result = {
            "global_step": trainer.global_step,
            "local_steps": trainer.stats.local_step,
            "sync_replicas": args.sync_replicas,
            "dropped_local_steps": trainer.stats.dropped_steps,
            "recoveries": trainer.stats.recoveries,
            "test_accuracy": round(accuracy(model, test_x, test_y), 4),
            "wall_seconds": round(wall, 3),
            "steps_per_sec": round((trainer.global_step - first_step) / wall, 1),
            "num_ps": cluster.num_ps,
            "num_workers": cluster.num_workers,
            # Async: how many of the chief's steps found it 0, 1, ... steps ahead of the slowest worker.
            "steps_ahead": {str(k): v for k, v in trainer.stats.steps_ahead.items()},
        }
    print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    psframe.tune_process()  # the allocator settings of a process that moves tensors every step
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster, job_name, task_index = cluster_from_flags(args)
    if job_name == "ps":
        return run_ps(args, cluster, task_index)
    return run_worker(args, cluster, task_index)


# --8<-- [start:run]
if __name__ == "__main__":
    # An expected failure (no ps task came up, a port in use, a bad flag, missing data...) or
    # Ctrl-C ends the task with one line saying what to do, and exit code 1 or 130.
    sys.exit(run(main, expected=(FileNotFoundError,)))
# --8<-- [end:run]

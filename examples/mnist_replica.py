#!/usr/bin/env python3
"""Distributed MNIST training and validation with model replicas: TF's mnist_replica.py on psframe.

A softmax model with one hidden layer. Its variables (weights and biases)
live on the ps task; the workers, two by default, each train a replica of the
model on their own batches, pushing gradients to the ps task and pulling the
updated values back. Worker 0, the chief, creates the variables on the ps
task; the other workers wait until they are there, then train.

One process per task, started in any order, with TensorFlow's defaults (one ps
task at localhost:2222, workers at localhost:2223 and localhost:2224):

    python examples/mnist_replica.py --job_name=ps --task_index=0
    python examples/mnist_replica.py --job_name=worker --task_index=0   # the chief
    python examples/mnist_replica.py --job_name=worker --task_index=1

Add --sync_replicas to every task for synchronous training. Or start the whole
cluster on free ports of this machine:

    psframe launch --num_ps 1 --num_workers 2 examples/mnist_replica.py -- --sync_replicas

MNIST is read from --data_dir and never downloaded here: ``python
scripts/fetch_mnist.py --data_dir DIR`` puts it there. Every worker ends with
TF's validation line and then, as its last line, one JSON summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mnist_data import load_mnist

import psframe
from psframe.flags import (
    add_cluster_flags,
    add_security_flags,
    add_sync_flags,
    cluster_from_flags,
    run,
    security_from_flags,
)
from psframe.hooks import StopAtStepHook

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
# TF's defaults for --ps_hosts and --worker_hosts, used when nothing else names a cluster.
DEFAULT_PS_HOSTS = "localhost:2222"
DEFAULT_WORKER_HOSTS = "localhost:2223,localhost:2224"
IMAGE_PIXELS = 28
NUM_CLASSES = 10

log = logging.getLogger("mnist_replica")


# --8<-- [start:flags]
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Without --ps_hosts/--worker_hosts, --cluster_spec or TF_CONFIG, the cluster is TF's default: "
        f"--ps_hosts={DEFAULT_PS_HOSTS} --worker_hosts={DEFAULT_WORKER_HOSTS}.",
    )
    parser.add_argument(
        "--data_dir", default=str(DEFAULT_DATA_DIR), help="folder holding MNIST/raw/ (scripts/fetch_mnist.py fills it)"
    )
    parser.add_argument(
        "--download_only",
        action="store_true",
        help="check that MNIST is in --data_dir, say where it is, and exit; nothing is downloaded "
        "(scripts/fetch_mnist.py fetches it)",
    )
    parser.add_argument(
        "--num_gpus",
        type=int,
        default=1,
        help="GPUs on each machine: worker i computes on cuda:(i %% num_gpus); 0, or a machine without "
        "CUDA, computes on the CPU",
    )
    parser.add_argument("--hidden_units", type=int, default=100, help="number of units in the hidden layer")
    parser.add_argument(
        "--train_steps", type=int, default=200, help="number of (global) training steps; training stops there"
    )
    parser.add_argument("--batch_size", type=int, default=100, help="training batch size, per worker step")
    parser.add_argument("--learning_rate", type=float, default=0.01, help="Adam's learning rate (on the ps)")
    parser.add_argument(
        "--existing_servers",
        action="store_true",
        help="the ps tasks already run elsewhere (psframe server): start no server in this process; "
        "give it to workers only",
    )
    parser.add_argument(
        "--validation_size",
        type=int,
        default=5000,
        help="the first N training images are the validation set, the rest train (TF's read_data_sets)",
    )
    parser.add_argument(
        "--checkpoint_dir",
        default=None,
        help="the chief saves checkpoints here (every 10 minutes and at the end) and a restarted run "
        "resumes from them; default: none",
    )
    add_cluster_flags(parser)  # --ps_hosts, --worker_hosts, --cluster_spec, --job_name, --task_index
    add_sync_flags(parser)  # --sync_replicas, --replicas_to_aggregate, --total_num_replicas, --sync_timeout
    add_security_flags(parser)  # --auth_token_file, --tls_cert_file, --tls_key_file, --tls_ca_file
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.num_gpus < 0:
        parser.error(f"--num_gpus must be >= 0, got {args.num_gpus}")
    no_cluster = not (args.ps_hosts or args.worker_hosts or args.cluster_spec)
    if no_cluster and not os.environ.get("TF_CONFIG", "").strip():
        args.ps_hosts, args.worker_hosts = DEFAULT_PS_HOSTS, DEFAULT_WORKER_HOSTS
    return args


# --8<-- [end:flags]


# --8<-- [start:data]
def read_data_sets(
    data_dir: str, validation_size: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """MNIST's training split as TF's ``read_data_sets`` cuts it: ``(train, validation)``,
    each ``(images [N, 784], labels [N])``, the first ``validation_size`` images validating."""
    images, labels = load_mnist(data_dir, train=True)
    if not 0 < validation_size < len(images):
        raise ValueError(
            f"--validation_size must be between 1 and {len(images) - 1} (the training split of "
            f"{data_dir} holds {len(images)} images), got {validation_size}"
        )
    train = images[validation_size:], labels[validation_size:]
    validation = images[:validation_size], labels[:validation_size]
    return train, validation


def next_batches(num_examples: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """The indices of endless mini-batches, reshuffled every epoch (TF's ``DataSet.next_batch``)."""
    if not 0 < batch_size <= num_examples:
        raise ValueError(f"--batch_size must be between 1 and the {num_examples} training images, got {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(num_examples, generator=generator)
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def download_only(data_dir: str) -> int:
    """--download_only: the data is read from local files only; check they are there."""
    try:
        images, _ = load_mnist(data_dir, train=True)
    except FileNotFoundError as e:
        print(f"mnist_replica: {e}", file=sys.stderr)
        return 1
    print(f"MNIST is in {Path(data_dir) / 'MNIST' / 'raw'}: {len(images)} training images")
    return 0


# --8<-- [end:data]


# --8<-- [start:device]
def worker_device(num_gpus: int, task_index: int) -> torch.device:
    """TF's ``worker_device``: a GPU per worker, round robin over the machine's GPUs, or the CPU."""
    if num_gpus == 0:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        log.info("--num_gpus=%d but no CUDA device is visible: worker %d computes on the CPU", num_gpus, task_index)
        return torch.device("cpu")
    gpu = task_index % num_gpus
    if gpu >= torch.cuda.device_count():
        raise ValueError(
            f"--num_gpus={num_gpus} puts worker {task_index} on cuda:{gpu}, but this process sees "
            f"{torch.cuda.device_count()} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return torch.device("cuda", gpu)


# --8<-- [end:device]


# --8<-- [start:model]
def truncated_normal(*shape: int, stddev: float) -> torch.Tensor:
    """TF's ``truncated_normal``: normal values, redrawn beyond two standard deviations."""
    return torch.nn.init.trunc_normal_(torch.empty(shape), std=stddev, a=-2 * stddev, b=2 * stddev)


class SoftmaxModel(torch.nn.Module):
    """One hidden ReLU layer and a softmax layer, with TF's variable names and initial values.

    ``forward`` returns the logits: the softmax is part of the loss.
    """

    def __init__(self, hidden_units: int) -> None:
        super().__init__()
        self.hid_w = torch.nn.Parameter(
            truncated_normal(IMAGE_PIXELS * IMAGE_PIXELS, hidden_units, stddev=1.0 / IMAGE_PIXELS)
        )
        self.hid_b = torch.nn.Parameter(torch.zeros(hidden_units))
        self.sm_w = torch.nn.Parameter(
            truncated_normal(hidden_units, NUM_CLASSES, stddev=1.0 / math.sqrt(hidden_units))
        )
        self.sm_b = torch.nn.Parameter(torch.zeros(NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hid = torch.relu(torch.addmm(self.hid_b, x, self.hid_w))  # tf.nn.xw_plus_b, tf.nn.relu
        return torch.addmm(self.sm_b, hid, self.sm_w)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TF's loss: the cross entropy summed over the batch (not averaged)."""
    return F.cross_entropy(logits, labels, reduction="sum")


# --8<-- [end:model]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    psframe.tune_process()  # the allocator settings of a process that moves tensors every step
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.download_only:
        return download_only(args.data_dir)

    # --8<-- [start:cluster]
    cluster, job_name, task_index = cluster_from_flags(args)  # the flags, or TF_CONFIG
    print(f"job name = {job_name}")
    print(f"task index = {task_index}")
    security = security_from_flags(args)

    server = None
    if not args.existing_servers:
        # Not using existing servers: serve this task from this process.
        server = psframe.Server(cluster, job_name, task_index, checkpoint_dir=args.checkpoint_dir, security=security)
        if job_name == "ps":
            server.join()  # returns once every worker has finished
            return 0
    elif job_name == "ps":
        parser.error("--existing_servers: the ps tasks already run (psframe server); start only workers with it")
    # --8<-- [end:cluster]
    try:
        return run_worker(args, cluster, task_index, security)
    finally:
        if server is not None:
            server.stop(grace=0.5)


def run_worker(
    args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int, security: psframe.Security
) -> int:
    # --8<-- [start:worker]
    (train_x, train_y), (val_x, val_y) = read_data_sets(args.data_dir, args.validation_size)
    is_chief = task_index == 0
    device = worker_device(args.num_gpus, task_index)
    train_x, train_y = train_x.to(device), train_y.to(device)
    batches = next_batches(len(train_x), args.batch_size, seed=task_index)

    model = SoftmaxModel(args.hidden_units)
    opt = psframe.optim.Adam(lr=args.learning_rate)
    if args.sync_replicas:
        opt = psframe.optim.SyncReplicasOptimizer(
            opt,
            replicas_to_aggregate=args.replicas_to_aggregate,  # None: the number of workers
            total_num_replicas=args.total_num_replicas,  # None: the number of workers (it must be)
            timeout=args.sync_timeout,
        )
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=opt,
        device=device,
        hooks=[StopAtStepHook(last_step=args.train_steps)],
        checkpointing=psframe.Checkpointing(args.checkpoint_dir) if args.checkpoint_dir else None,
        security=security,
    )
    # --8<-- [end:worker]

    # --8<-- [start:session]
    if is_chief:
        print(f"Worker {task_index}: Initializing session...")
    else:
        print(f"Worker {task_index}: Waiting for session to be initialized...")
    if args.existing_servers:
        print(f"Using existing servers at: {', '.join('grpc://' + a for a in cluster.job_tasks('ps'))}")
    with trainer:  # the chief creates (or restores) the variables; the others wait for them
        print(f"Worker {task_index}: Session initialization complete.")
        # --8<-- [end:session]

        # --8<-- [start:loop]
        time_begin = time.time()
        print(f"Training begins @ {time_begin:f}")
        while not trainer.should_stop():
            indices = next(batches).to(device)
            loss = cross_entropy(model(train_x[indices]), train_y[indices])
            step = trainer.step(loss)  # backward, push the gradients, pull the new values
            now = time.time()
            print(f"{now:f}: Worker {task_index}: training step {trainer.stats.local_step} done (global step: {step})")
        time_end = time.time()
        print(f"Training ends @ {time_end:f}")
        training_time = time_end - time_begin
        print(f"Training elapsed time: {training_time:f} s")
        # --8<-- [end:loop]

        # --8<-- [start:validation]
        trainer.pull()  # the values on the ps now, with every worker's updates
        with torch.no_grad():
            logits = model(val_x.to(device))
            val_xent = cross_entropy(logits, val_y.to(device)).item()
            val_accuracy = (logits.argmax(dim=1) == val_y.to(device)).float().mean().item()
        print(f"After {trainer.global_step} training step(s), validation cross entropy = {val_xent:g}")
        result = {
            "task": f"worker{task_index}",
            "global_step": trainer.global_step,
            "local_steps": trainer.stats.local_step,
            "sync_replicas": args.sync_replicas,
            "dropped_local_steps": trainer.stats.dropped_steps,
            "validation_cross_entropy": round(val_xent, 4),
            "validation_examples": len(val_x),
            "validation_accuracy": round(val_accuracy, 4),
            "training_seconds": round(training_time, 3),
        }
    print(json.dumps(result), flush=True)
    return 0
    # --8<-- [end:validation]


if __name__ == "__main__":
    # An expected failure (no ps task came up, a port in use, a bad flag, missing data...) or
    # Ctrl-C ends the task with one line saying what to do, and exit code 1 or 130.
    sys.exit(run(main, expected=(FileNotFoundError,)))

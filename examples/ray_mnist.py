#!/usr/bin/env python3
"""The MNIST MLP of mlp_mnist_dist.py, trained by a psframe cluster of Ray actors.

    python examples/ray_mnist.py --num_ps 1 --num_workers 2            # a local Ray, or RAY_ADDRESS's
    python examples/ray_mnist.py --address auto --num_ps 2 --num_workers 8 --cpus_per_worker 2

Every ps and worker task is a Ray actor (:func:`psframe.ray.run`); the chief
(worker 0) evaluates the final parameters on the test set, and the driver
prints its JSON summary as its last line. Every node needs psframe, this
folder on its Python path (Ray puts the driver script's folder there on a
one-node cluster; elsewhere use the same image, or ``runtime_env``) and
MNIST in --data_dir (``python scripts/fetch_mnist.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlp_mnist_dist import DEFAULT_DATA_DIR, accuracy, batches, build_model, run_ps
from mnist_data import load_mnist

import psframe
import psframe.ray
from psframe.flags import add_liveness_flags, add_security_flags, liveness_from_flags, security_from_flags
from psframe.hooks import StopAtStepHook

log = logging.getLogger("ray_mnist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join (ray.init's address, e.g. 'auto'); default: RAY_ADDRESS or a new local Ray",
    )
    parser.add_argument(
        "--num_cpus",
        type=float,
        default=None,
        help="CPUs of a new local Ray (default: this machine's, or as many as the tasks ask for)",
    )
    parser.add_argument("--num_ps", type=int, default=1, help="ps tasks")
    parser.add_argument("--num_workers", type=int, default=2, help="worker tasks (worker 0 is the chief)")
    parser.add_argument("--cpus_per_worker", type=float, default=1.0, help="Ray CPUs of one worker actor")
    parser.add_argument("--gpus_per_worker", type=float, default=0.0, help="Ray GPUs of one worker actor")
    parser.add_argument("--cpus_per_ps", type=float, default=1.0, help="Ray CPUs of one ps actor")
    parser.add_argument(
        "--host", default=None, help="the address tasks advertise (default: each node's IP; 127.0.0.1 on one machine)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds training may take at most")
    parser.add_argument("--train_steps", type=int, default=6000, help="the global step at which training stops")
    parser.add_argument("--batch_size", type=int, default=100, help="examples per worker step")
    parser.add_argument("--learning_rate", type=float, default=0.1, help="SGD learning rate (on the ps)")
    parser.add_argument("--hidden_units", type=int, default=100, help="units of the hidden layer")
    parser.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder holding MNIST/raw/ on every node")
    parser.add_argument(
        "--sync_replicas",
        action="store_true",
        help="synchronous training: each update averages every worker's gradient",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial model and data order")
    parser.add_argument(
        "--checkpoint_dir",
        default=None,
        help="checkpoints here (a URL every node reaches, e.g. s3://...); a rerun resumes",
    )
    parser.add_argument(
        "--worker_timeout",
        type=float,
        default=60.0,
        help="ps: seconds of silence after which a worker is presumed dead, once some finished",
    )
    parser.add_argument(
        "--chief_timeout",
        type=float,
        default=None,
        help="ps: the same for the chief, waited for longer (default: 10 x --worker_timeout)",
    )
    parser.add_argument("--serving_processes", type=int, default=1, help="ps: processes serving the task's port")
    parser.add_argument(
        "--max_workers", type=int, default=None, help="ps: worker slots of an elastic cluster (default: fixed)"
    )
    add_security_flags(parser)  # --auth_token_file and the TLS files: paths every node reads
    add_liveness_flags(parser)  # --keepalive_time, --keepalive_timeout
    return parser.parse_args(argv)


def main_fun(args: argparse.Namespace, ctx: psframe.ray.TaskContext) -> dict | None:
    """One task: a ps serves until training is over; a worker trains; the chief returns its summary."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ctx.job_name == "ps":
        run_ps(args, ctx.cluster, ctx.task_index)
        return None
    device = torch.device("cuda" if args.gpus_per_worker > 0 and torch.cuda.is_available() else "cpu")
    train_x, train_y = (t.to(device) for t in load_mnist(args.data_dir, train=True))
    torch.manual_seed(args.seed)  # the chief's initial values are the ones that count
    model = build_model(args.hidden_units)
    trainer = psframe.Trainer(
        model,
        ctx.cluster,
        task_index=ctx.task_index,
        optimizer=psframe.optim.SGD(lr=args.learning_rate),
        sync=psframe.SyncReplicas() if args.sync_replicas else None,
        device=device,
        hooks=[StopAtStepHook(last_step=args.train_steps)],
        checkpointing=psframe.Checkpointing(args.checkpoint_dir) if args.checkpoint_dir else None,
        liveness=liveness_from_flags(args),
        security=security_from_flags(args),
    )
    with trainer:
        for indices in batches(len(train_x), args.batch_size, args.seed + 1 + ctx.task_index):
            if trainer.should_stop():
                break
            indices = indices.to(device)
            trainer.step(F.cross_entropy(model(train_x[indices]), train_y[indices]))
        if not ctx.is_chief:
            return None
        trainer.pull()  # the final parameters, with every worker's last update
        test_x, test_y = (t.to(device) for t in load_mnist(args.data_dir, train=False))
        return {
            "global_step": trainer.global_step,
            "local_steps": trainer.stats.local_step,
            "test_accuracy": round(accuracy(model, test_x, test_y), 4),
            "num_ps": ctx.cluster.num_ps,
            "num_workers": ctx.cluster.num_workers,
            "cluster": ctx.cluster.to_string(),
        }


def train(args: argparse.Namespace) -> dict:
    """Runs the cluster on the Ray this process is connected to; returns the chief's summary."""
    resources = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker:
        resources["GPU"] = args.gpus_per_worker
    return psframe.ray.run(
        main_fun,
        args,
        num_ps=args.num_ps,
        num_workers=args.num_workers,
        resources_per_worker=resources,
        resources_per_ps={"CPU": args.cpus_per_ps},
        host=args.host,
        timeout=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import ray

    if not ray.is_initialized():
        if args.address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=args.address)
        else:  # a local Ray with room for every task
            wanted = args.num_ps * args.cpus_per_ps + args.num_workers * args.cpus_per_worker
            ray.init(num_cpus=args.num_cpus or max(os.cpu_count() or 1, math.ceil(wanted)), include_dashboard=False)
    print(json.dumps(train(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

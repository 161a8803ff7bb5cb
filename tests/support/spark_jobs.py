"""``main_fun``s that tests/engines/test_spark.py runs in Spark tasks (importable by the executors' Python)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import fsspec
import torch
import torch.nn.functional as F

import psframe
from psframe.checkpoint import files as checkpoint_files
from psframe.hooks import StopAtStepHook
from psframe.memory import malloc

IN_FEATURES = 8
TRUE_WEIGHT = torch.arange(1.0, IN_FEATURES + 1) / IN_FEATURES
TRUE_BIAS = 0.5


def write_shards(folder: Path, num_shards: int, rows: int = 256, seed: int = 0) -> list[str]:
    """Regression data ``y = x @ TRUE_WEIGHT + TRUE_BIAS`` in ``num_shards`` files; returns their URLs."""
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(num_shards):
        x = torch.randn(rows, IN_FEATURES, generator=generator)
        path = folder / f"shard-{i:02d}.pt"
        torch.save({"x": x, "y": x @ TRUE_WEIGHT + TRUE_BIAS}, path)
        paths.append(f"file://{path}")
    return paths


def _read(paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = []
    for url in paths:
        with fsspec.open(url, "rb") as f:
            parts.append(torch.load(f))
    return torch.cat([p["x"] for p in parts]), torch.cat([p["y"] for p in parts])


def _kill_self_after_a_checkpoint(args: dict, ctx) -> None:
    """Worker 1 of the first attempt: SIGKILL this process once a checkpoint is committed."""
    marker = Path(args["kill_marker"])
    if ctx.task_index != 1 or marker.exists():
        return
    latest = checkpoint_files.latest_valid(args["checkpoint_dir"])
    if latest is not None:
        marker.write_text(f"{latest.step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def regression_main(args: dict, ctx) -> dict | None:
    """A linear model on the shards of ``args["paths"]`` this worker gets (``ctx.shard``)."""
    if ctx.job_name == "ps":
        psframe.Server(
            ctx.cluster, "ps", ctx.task_index, checkpoint_dir=args.get("checkpoint_dir"), serving_processes=1
        ).join()
        return None
    x, y = _read(ctx.shard(args["paths"]))
    torch.manual_seed(0)
    # Two variables, so that each of two ps tasks holds one (a ps task holding none is never ready).
    model = torch.nn.Linear(IN_FEATURES, 1)
    trainer = psframe.Trainer(
        model,
        ctx.cluster,
        task_index=ctx.task_index,
        optimizer=psframe.optim.SGD(lr=0.05),
        hooks=[StopAtStepHook(last_step=args["train_steps"])],
        checkpointing=psframe.Checkpointing(args["checkpoint_dir"], save_steps=args.get("save_checkpoint_steps"))
        if args.get("checkpoint_dir")
        else None,
        transport=psframe.Transport(connect_timeout=60.0),
    )
    generator = torch.Generator().manual_seed(ctx.task_index)
    with trainer:
        first_step = trainer.global_step
        while not trainer.should_stop():
            if args.get("kill_marker"):
                _kill_self_after_a_checkpoint(args, ctx)
            rows = torch.randint(0, len(x), (32,), generator=generator)
            trainer.step(F.mse_loss(model(x[rows]).squeeze(1), y[rows]))
            if args.get("step_delay"):
                time.sleep(args["step_delay"])
        if not ctx.is_chief:
            return None
        trainer.pull()
        return {
            "first_global_step": first_step,
            "global_step": trainer.global_step,
            "local_steps": trainer.stats.local_step,
            "rows": len(x),
            "weight_error": max(
                (model.weight.detach()[0] - TRUE_WEIGHT).abs().max().item(), abs(model.bias.item() - TRUE_BIAS)
            ),
            "cluster": ctx.cluster.to_string(),
            # The Python worker runs the task for the whole job: tuned before main_fun.
            "malloc_tuned": malloc.malloc_tuned(),
            "malloc_tunable": malloc.user_choice(os.environ) is None and malloc._glibc() is not None,
        }


def failing_main(args: dict, ctx) -> None:
    """Worker 1 fails at once, every attempt: it raises (``args["how"] == "raise"``) or its
    process is SIGKILLed (``"kill"``); the others wait as a cluster would, for Spark to kill them."""
    if ctx.job_name == "worker" and ctx.task_index == 1:
        if args["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"worker 1 cannot read its input {args['input']!r}")
    time.sleep(args.get("wait", 120.0))


def sleeping_main(args: dict, ctx) -> None:
    """Every task sleeps far longer than the test's timeout."""
    time.sleep(args.get("wait", 600.0))


def input_main(args: dict, ctx) -> dict | None:
    """Reports what each worker got from ``input_data`` (no training): every worker writes the
    values of its records (a DataFrame's column ``v``) to ``args["out"]/worker<i>.json``."""
    if ctx.job_name == "ps":
        if ctx.input is not None:
            raise AssertionError(f"ps {ctx.task_index} was given input")
        return None
    values = sorted(getattr(record, "v", record) for record in ctx.input)
    Path(args["out"], f"worker{ctx.task_index}.json").write_text(json.dumps(values))
    return {"chief_values": values, "num_ps": ctx.num_ps, "num_workers": ctx.num_workers}

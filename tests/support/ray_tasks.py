"""Task functions that tests/engines/test_ray.py runs in Ray actors (importable there by name)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

import psframe
from psframe.hooks import StopAtStepHook
from psframe.memory import malloc


def train_tiny(args: dict, ctx) -> dict:
    """A ps serves until the workers finish; each worker trains a linear model for args['steps'] global steps."""
    seen = {
        "job_name": ctx.job_name,
        "task_index": ctx.task_index,
        "address": ctx.address,
        "cluster": ctx.cluster.to_string(),
        "is_chief": ctx.is_chief,
        "pid": os.getpid(),
        # The actor's process is the task's own: tuned before main_fun, as `psframe server` tunes its own.
        "malloc_tuned": malloc.malloc_tuned(),
        "malloc_tunable": malloc.user_choice(os.environ) is None and malloc._glibc() is not None,
    }
    if ctx.job_name == "ps":
        psframe.Server(ctx.cluster, "ps", ctx.task_index, serving_processes=1).join()
        return seen
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = psframe.Trainer(
        model,
        ctx.cluster,
        task_index=ctx.task_index,
        optimizer=psframe.optim.SGD(lr=0.1),
        hooks=[StopAtStepHook(last_step=args["steps"])],
        transport=psframe.Transport(connect_timeout=60),
    )
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with trainer:
        while not trainer.should_stop():
            trainer.step(F.cross_entropy(model(x), y))
        seen["global_step"] = trainer.global_step
    return seen


def fail(args: dict, ctx) -> None:
    """Worker ``args['task']`` fails as ``args['how']`` says; every other task waits (bounded)."""
    if ctx.task_index == args["task"] and ctx.job_name == "worker":
        if args["how"] == "raise":
            raise ValueError(f"worker {ctx.task_index} cannot go on")
        os._exit(3)
    time.sleep(args.get("others_sleep", 60))


def sleep(args: dict, ctx) -> None:
    time.sleep(args["seconds"])


def ps_lingers(args: dict, ctx) -> str | None:
    """A ps task that never ends on its own; the workers return at once."""
    if ctx.job_name == "ps":
        time.sleep(args["ps_sleep"])
        return None
    return f"worker {ctx.task_index} done"

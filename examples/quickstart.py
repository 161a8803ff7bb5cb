"""psframe's quick start: a small model learns y = x @ w on a parameter-server cluster.

Alone, it serves one ps task in this process and trains one worker beside it:

    python examples/quickstart.py

As a cluster, one process per task (the flags, or TF_CONFIG, name the cluster and the task):

    psframe launch --num_ps 2 --num_workers 2 examples/quickstart.py

The chief (worker 0) prints a JSON line with the global step and the last loss.
"""

from __future__ import annotations

import argparse
import json
import os

# --8<-- [start:quickstart]
import torch
import torch.nn.functional as F

import psframe
from psframe.hooks import StopAtStepHook


def train(cluster: psframe.ClusterSpec, task_index: int, steps: int) -> dict:
    """One worker: train until the cluster's global step reaches ``steps``."""
    torch.manual_seed(task_index)  # each worker draws its own batches
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    w = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)  # what the model should learn
    trainer = psframe.Trainer(
        model,
        cluster,
        task_index,
        optimizer=psframe.optim.Adam(lr=0.01),  # runs on the ps tasks
        hooks=[StopAtStepHook(last_step=steps)],
    )
    with trainer:  # connects; the chief creates the variables on the ps tasks
        while not trainer.should_stop():
            x = torch.randn(64, 8)
            loss = F.mse_loss(model(x), x @ w)
            trainer.step(loss)  # pushes the gradients, pulls the new values
        return {"global_step": trainer.global_step, "loss": round(loss.item(), 4)}


def main_alone(steps: int) -> dict:
    """One ps task served in this process, and one worker."""
    with psframe.local_cluster(num_ps=1, num_workers=1) as local:
        return train(local.cluster, 0, steps)


# --8<-- [end:quickstart]


# --8<-- [start:main]
def main(argv: list[str] | None = None) -> int:
    from psframe import flags

    psframe.tune_process()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_cluster_flags(parser)
    parser.add_argument("--train_steps", type=int, default=500, help="the global step at which training stops")
    args = parser.parse_args(argv)
    if args.job_name is None and args.ps_hosts is None and "TF_CONFIG" not in os.environ:
        result = main_alone(args.train_steps)
    else:
        cluster, job_name, task_index = flags.cluster_from_flags(args)
        if job_name == "ps":
            psframe.Server(cluster, "ps", task_index).join()  # returns once every worker finished
            return 0
        result = train(cluster, task_index, args.train_steps)
        if task_index != 0:
            return 0
    print(json.dumps(result), flush=True)
    return 0


# --8<-- [end:main]


if __name__ == "__main__":
    from psframe import flags

    # An expected failure (no ps task came up, a port in use, a bad flag...) or Ctrl-C ends
    # the task with one line saying what to do, and exit code 1 or 130.
    raise SystemExit(flags.run(main))

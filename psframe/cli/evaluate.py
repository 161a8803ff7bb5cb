"""``psframe evaluate``: evaluate each checkpoint of a training run as it is committed (TF's evaluator).

The model and its metrics come from a factory named on the command line
(``FILE.py:NAME`` or ``MODULE:NAME``) returning ``(model, evaluate_fn)``;
:class:`psframe.worker.evaluator.Evaluator` loads each checkpoint into the
model, and each result is printed as one JSON line.
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``evaluate`` and its flags to ``commands``."""
    evaluate = commands.add_parser(
        "evaluate", help="evaluate each checkpoint of a training run as it is committed (TF's evaluator)"
    )
    evaluate.add_argument("--checkpoint_dir", required=True, help="the folder or fsspec URL the chief saves to")
    evaluate.add_argument(
        "--log_dir", default=None, help="write each metric to TensorBoard here (needs the tensorboard package)"
    )
    evaluate.add_argument(
        "--timeout", type=float, default=600.0, help="stop after this many seconds without a new checkpoint"
    )
    evaluate.add_argument(
        "--poll_seconds", type=float, default=1.0, help="list the checkpoint folder this often while waiting"
    )
    evaluate.add_argument(
        "--max_step", type=int, default=None, help="stop after a checkpoint at or past this global step"
    )
    evaluate.add_argument(
        "--latest_only",
        action="store_true",
        help="evaluate the newest checkpoint each time, skipping those committed meanwhile (TF's evaluator)",
    )
    evaluate.add_argument(
        "factory",
        help="FILE.py:NAME or MODULE:NAME, a function returning (model, evaluate_fn), where "
        "evaluate_fn(model) returns a dict of metric names to numbers",
    )
    evaluate.add_argument(
        "factory_args", nargs=argparse.REMAINDER, help="-- then arguments for the factory, passed as one list"
    )
    evaluate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate checkpoints until the evaluator stops; no checkpoint evaluated at all raises."""
    import json

    from psframe.cli.factory import factory_argv
    from psframe.errors import CheckpointError
    from psframe.worker.evaluator import Evaluator

    model, evaluate_fn = _made_by_factory(args.factory, factory_argv(args.factory_args))
    evaluator = Evaluator(
        model,
        evaluate_fn,
        args.checkpoint_dir,
        log_dir=args.log_dir,
        poll_seconds=args.poll_seconds,
        timeout=args.timeout,
        max_step=args.max_step,
        latest_only=args.latest_only,
    )
    for step, metrics in evaluator.results():
        print(json.dumps({"global_step": step, **metrics}), flush=True)
    if not evaluator.history:
        skipped = f" ({len(evaluator.skipped)} skipped as pruned or damaged)" if evaluator.skipped else ""
        raise CheckpointError(
            f"evaluated no checkpoint: none came in {args.checkpoint_dir} within --timeout={args.timeout:g}s{skipped}"
        )
    return 0


def _made_by_factory(spec: str, argv: list[str]):
    """The ``(model, evaluate_fn)`` that the factory ``FILE.py:NAME`` or ``MODULE:NAME`` returns
    (:func:`psframe.cli.factory.made_by_factory`)."""
    import torch

    from psframe.cli.factory import made_by_factory

    made = made_by_factory(spec, argv)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1])):
        raise ValueError(f"{spec} must return (model, evaluate_fn): a torch.nn.Module and a function of it")
    return made

"""``psframe evaluate``: evaluate each checkpoint of a training run as it is committed (TF's evaluator).

The model and its metrics come from a factory named on the command line
(``FILE.py:NAME`` or ``MODULE:NAME``) returning ``(model, evaluate_fn)``;
:class:`psframe.worker.evaluator.Evaluator` loads each checkpoint into the
model, and each result is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import sys


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

    from psframe.errors import CheckpointError
    from psframe.worker.evaluator import Evaluator

    factory_args = args.factory_args[1:] if args.factory_args[:1] == ["--"] else args.factory_args
    model, evaluate_fn = _made_by_factory(args.factory, factory_args)
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
    """The ``(model, evaluate_fn)`` that the factory ``FILE.py:NAME`` or ``MODULE:NAME`` returns.

    The factory is called with no arguments, or with the list ``argv`` when there is one.
    """
    import importlib
    import importlib.util
    import os

    import torch

    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"the factory must be path/to/file.py:function or package.module:function, got {spec!r}")
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError(f"the factory's file {where!r} is not a file (looked in {os.getcwd()!r})")
        sys.path.insert(0, os.path.dirname(path))  # its own imports resolve as under `python FILE`
        loader_spec = importlib.util.spec_from_file_location(f"psframe_factory_{os.getpid()}", path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"the factory's file {where!r} cannot be loaded as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[loader_spec.name] = module  # dataclasses and pickling look their module up here
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is None or not (where == e.name or where.startswith(e.name + ".")):
                raise  # the module exists; something it imports does not: its bug, with a traceback
            raise ValueError(f"the factory's module {where!r} cannot be found on sys.path") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{where} has no function {name!r}")
    made = factory(argv) if argv else factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1])):
        raise ValueError(f"{spec} must return (model, evaluate_fn): a torch.nn.Module and a function of it")
    return made

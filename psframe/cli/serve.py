"""``psframe serve``: follow a training job's checkpoints and serve the model over HTTP/JSON (:mod:`psframe.serve`).

It prints one line, ``psframe serve: serving http://HOST:PORT (following DIR)``, once it listens,
then serves until SIGTERM (exit code 143) or Ctrl-C (130). The web framework (the ``serve``
extra) is imported only when the command runs.
"""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` and its flags to ``commands``."""
    serve = commands.add_parser(
        "serve", help="follow a training job's checkpoints (full and delta) and serve the model over HTTP/JSON"
    )
    serve.add_argument("--checkpoint_dir", required=True, help="the folder or fsspec URL the chief saves to")
    serve.add_argument(
        "--model",
        default=None,
        help="FILE.py:NAME or MODULE:NAME, a function returning the model (built as the trainer built it), or "
        "(model, to_inputs) where to_inputs turns a request's inputs into the forward's arguments; "
        "without it, /v1/predict answers 404",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (loopback by default)")
    serve.add_argument("--port", type=int, default=0, help="the port to listen on (0: one the OS picks)")
    serve.add_argument(
        "--poll_seconds", type=float, default=1.0, help="look at the checkpoint folder for new checkpoints this often"
    )
    serve.add_argument(
        "model_args", nargs=argparse.REMAINDER, help="-- then arguments for the --model factory, passed as one list"
    )
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Serve until stopped (:func:`psframe.serve.process.serve_until_stopped`)."""
    from psframe.cli.factory import factory_argv, made_by_factory

    try:
        from psframe.serve.model import ModelFactory
        from psframe.serve.process import ServeProcess, serve_until_stopped
    except ModuleNotFoundError as e:
        if e.name not in ("starlette", "uvicorn"):
            raise
        raise ValueError(f"psframe serve needs {e.name}: install the serve extra (pip install 'psframe[serve]')") from e

    model_args = factory_argv(args.model_args)
    if model_args and args.model is None:
        raise ValueError(f"arguments after -- ({' '.join(model_args)}) are for a --model factory; none was given")
    models = None
    if args.model is not None:
        models = ModelFactory.of(made_by_factory(args.model, model_args), args.model)
    process = ServeProcess(
        args.checkpoint_dir, models=models, host=args.host, port=args.port, poll_seconds=args.poll_seconds
    )
    serve_until_stopped(process)

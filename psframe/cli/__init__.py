"""The ``psframe`` command: server, ping, status, shutdown, reshard, launch, evaluate, export and serve.

    psframe server --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224' --job_name=ps --task_index=0
    psframe ping grpc://h0:2222
    psframe status --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe shutdown --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224'
    psframe reshard --cluster_spec='ps|h0:2222;h0:2223,worker|h1:2224' --new_ps_hosts=h0:2222,h0:2223,h2:2222
    psframe launch --num_ps 2 --num_workers 2 examples/mlp_mnist_dist.py -- --train_steps 2000
    psframe evaluate --checkpoint_dir=ckpt/ examples/ctr_dist.py:evaluation
    psframe export ckpt/ snapshot/
    psframe serve --checkpoint_dir=ckpt/ --model=model.py:make_model

Every command takes ``--auth_token_file`` and the ``--tls_*`` flags
(:func:`psframe.flags.add_security_flags`; see :mod:`psframe.config.security`).
An expected failure ends a command with one line, ``psframe COMMAND: error:
...``, and exit code 1; Ctrl-C with one line and 130, as a script's
:func:`psframe.flags.run` does.

Each command is a module of this package, named after it, with
``add_parser(commands)`` (its subcommand and flags) and ``run(args)`` (its
exit code); :func:`build_parser` adds them in the order above, and
:func:`main` runs the one chosen.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from psframe import flags
from psframe.cli import evaluate, export, launch, ping, reshard, serve, server, shutdown, status
from psframe.version import __version__

COMMANDS = (server, ping, status, shutdown, reshard, launch, evaluate, export, serve)
"""The command modules, in the order ``psframe --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``psframe`` command: its flags and every command's subparser."""
    parser = argparse.ArgumentParser(prog="psframe", description="Parameter-server training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"psframe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``psframe`` command; returns its exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # An expected failure is one line and exit code 1, Ctrl-C one line and 130 (as a script's, through
    # flags.run); ValueError: a setting out of range (Server checks them).
    return flags.run(lambda: args.run(args), expected=(ValueError,), prog=f"psframe {args.command}")

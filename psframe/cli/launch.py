"""``psframe launch``: run a whole cluster of one training script on this machine (:func:`psframe.launch.launch`)."""

from __future__ import annotations

import argparse

from psframe.flags import add_security_flags, security_from_flags


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``launch`` and its flags to ``commands``."""
    launch = commands.add_parser("launch", help="run a whole cluster of SCRIPT on this machine")
    launch.add_argument("--num_ps", type=int, default=1)
    launch.add_argument("--num_workers", type=int, default=2)
    launch.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    add_security_flags(launch, no_token="a fresh random token for this cluster, given to every task")
    launch.add_argument(
        "script", help="the training script; it gets --ps_hosts, --worker_hosts, --job_name and --task_index"
    )
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    launch.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Launch the cluster; its exit code is the launch's."""
    from psframe.launch import launch

    script_args = args.script_args
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    return launch(
        args.script,
        args.num_ps,
        args.num_workers,
        script_args,
        timeout=args.timeout,
        security=security_from_flags(args),
    )

"""``psframe launch``: run a whole cluster of one training script on this machine (:func:`psframe.launch.launch`)."""

from __future__ import annotations

import argparse

from psframe.flags import add_security_flags, security_from_flags


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``launch`` and its flags to ``commands``."""
    from psframe.launch import DEFAULT_GRACE, OnFailure
    from psframe.launch.policy import DEFAULT_MAX_RESTARTS

    launch = commands.add_parser("launch", help="run a whole cluster of SCRIPT on this machine")
    launch.add_argument("--num_ps", type=int, default=1)
    launch.add_argument("--num_workers", type=int, default=2)
    launch.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    launch.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        help="seconds a task gets to stop once asked (SIGTERM; or Ctrl-C, for a script that catches it to do "
        "its last work) before it is killed",
    )
    launch.add_argument(
        "--on_failure",
        choices=[o.value for o in OnFailure],
        default=None,
        help="when a task fails: stop the others; start it again (up to --max_restarts times); or, for a "
        "worker other than the chief, let the others go on without it "
        "(default: stop, or restart when --max_restarts is given)",
    )
    launch.add_argument(
        "--max_restarts",
        type=int,
        default=None,
        help=f"with --on_failure=restart: the times one task is started again at most (default: "
        f"{DEFAULT_MAX_RESTARTS}); alone, as torchrun's, it means --on_failure=restart",
    )
    add_security_flags(launch, no_token="a fresh random token for this cluster, given to every task")
    launch.add_argument(
        "script", help="the training script; it gets --ps_hosts, --worker_hosts, --job_name and --task_index"
    )
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    launch.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Launch the cluster; its exit code is the launch's."""
    from psframe.launch import FailurePolicy, launch

    script_args = args.script_args
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    return launch(
        args.script,
        args.num_ps,
        args.num_workers,
        script_args,
        timeout=args.timeout,
        grace=args.grace,
        security=security_from_flags(args),
        on_failure=FailurePolicy.from_flags(args.on_failure, args.max_restarts),
    )

"""``psframe reshard``: move the model onto other ps tasks while training goes on (ps tasks added or drained).

Asks ps 0 for a live re-layout onto ``--new_ps_hosts``, then (unless
``--no_wait``) waits until the new layout holds the model, or ``--timeout``
runs out.
"""

from __future__ import annotations

import argparse

from psframe.cli.cluster_args import cluster_named
from psframe.cluster import ClusterSpec
from psframe.errors import ClusterSpecError, ConnectTimeoutError
from psframe.flags import add_cluster_flags, add_security_flags, security_from_flags


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``reshard`` and its flags to ``commands``."""
    reshard = commands.add_parser(
        "reshard", help="move the model onto other ps tasks while training goes on (ps tasks added or drained)"
    )
    add_cluster_flags(reshard)
    reshard.add_argument(
        "--new_ps_hosts",
        required=True,
        help="the ps tasks to move onto, comma-separated: the running ones with new ones at the end (start "
        "those first, with this list), or the running ones less the last (they stop once drained)",
    )
    reshard.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up (exit 1) if the new layout does not hold the model by then",
    )
    reshard.add_argument("--no_wait", action="store_true", help="ask, and exit at once")
    add_security_flags(reshard)
    reshard.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Ask ps 0 for a live re-layout onto ``--new_ps_hosts``; wait until the new layout holds the model."""
    import time

    from psframe.worker.client import control_calls, relayout_calls
    from psframe.worker.client.ps_client import PsClient

    cluster = cluster_named(args)
    new = ClusterSpec({"ps": _host_list(args.new_ps_hosts), "worker": cluster.job_tasks("worker")})
    security = security_from_flags(args)
    start = time.monotonic()
    with PsClient(cluster, 0, job_name="tool", rpc_timeout=min(args.timeout, 60.0), security=security) as client:
        relayout_calls.ask_reshard(client, new)
        print(f"asked {ClusterSpec.task_name('ps', 0)} to move the model onto ps tasks {new.job_tasks('ps')}")
        if args.no_wait:
            return 0
        deadline = start + args.timeout
        while (status := relayout_calls.layout_status(client)).cluster != new or not status.moved or status.moving:
            if time.monotonic() >= deadline:
                stage = f" (at stage {status.stage.stage} of {status.stage.stages})" if status.stage else ""
                raise ConnectTimeoutError(
                    f"the chief did not take the re-layout within {args.timeout:.0f}s{stage} (is it training? it "
                    f"takes one stage between two steps); it stays asked for: "
                    f"{status.cluster and status.cluster.job_tasks('ps')}"
                )
            time.sleep(0.1)
    with PsClient(new, 0, job_name="tool", rpc_timeout=min(args.timeout, 60.0), security=security) as client:
        control_calls.wait_for_ps(client, max(1.0, deadline - time.monotonic()), ready=True)
    print(
        f"the ps tasks {new.job_tasks('ps')} hold the model: re-laid out {time.monotonic() - start:.2f}s after asking"
    )
    return 0


def _host_list(hosts: str) -> list[str]:
    listed = [h.strip() for h in hosts.split(",") if h.strip()]
    if not listed:
        raise ClusterSpecError("--new_ps_hosts must list at least one ps task (host:port, comma-separated)")
    return listed

"""ps tasks in processes of their own, and this process as their one worker: what the ps-side sections talk to.

:class:`PsCluster` starts ``num_ps`` ``psframe server`` processes and connects
worker 0's client to them; the transport, security and memory sections time
that client's push+pull, and the sparse section trains a ``psframe.Trainer``
on the cluster. Clusters started together are finished together
(:func:`finish_clusters`), and made ready in parallel (:func:`in_parallel`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

import psframe
from benchmarks.children import Children
from benchmarks.common import BenchmarkError, Deadline
from benchmarks.suite.psframe_internals import PsClient, control_calls, worker_client
from psframe.launch import pick_free_ports

RPC_TIMEOUT_S = 120.0
T = TypeVar("T")


class PsCluster:
    """``num_ps`` ps tasks (``python -m psframe.cli server``) and one worker (us).

    Args:
        children: where the ps processes are started (and killed at the end).
        num_ps: how many ps tasks.
        name: prefix of the children's names.
        timeout: the ps tasks give up (exit 1) after this many seconds.
        ports: the ``num_ps + 1`` ports to use (ps tasks, then the worker);
            default: picked now. Clusters started together take theirs from
            one :func:`pick_free_ports` call: ports picked apart are each free
            when picked, and the OS may hand one out twice before any process
            binds it.
        extra_flags: more flags of ``psframe server`` for every ps task
            (e.g. ``--serving_processes=2``).
        security: the worker's auth token and TLS settings (the ps tasks'
            are in ``extra_flags``); default: none.
    """

    def __init__(
        self,
        children: Children,
        num_ps: int,
        name: str,
        timeout: float,
        ports: Sequence[int] | None = None,
        extra_flags: Sequence[str] = (),
        security: psframe.Security | None = None,
    ) -> None:
        ports = pick_free_ports(num_ps + 1) if ports is None else list(ports)
        if len(ports) != num_ps + 1:
            raise ValueError(f"a cluster of {num_ps} ps tasks needs {num_ps + 1} ports, got {len(ports)}")
        self.cluster = psframe.ClusterSpec(
            {
                "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
                "worker": [f"127.0.0.1:{ports[-1]}"],
            }
        )
        self.children = children
        self.names = [f"{name}-ps{i}" for i in range(num_ps)]
        self.procs = [
            children.start(
                task,
                [
                    sys.executable,
                    "-m",
                    "psframe.cli",
                    "server",
                    f"--cluster_spec={self.cluster.to_string()}",
                    "--job_name=ps",
                    f"--task_index={i}",
                    f"--timeout={timeout:.0f}",
                    *extra_flags,
                ],
            )
            for i, task in enumerate(self.names)
        ]
        self.client: PsClient | None = None
        self.security = security

    @property
    def num_ps(self) -> int:
        return len(self.names)

    def connect(self, deadline: Deadline) -> PsClient:
        """Worker 0's client, once every ps task answers."""
        self.client = worker_client(
            self.cluster, rpc_timeout=min(RPC_TIMEOUT_S, deadline.remaining(1.0)), security=self.security
        )
        try:
            control_calls.wait_for_ps(self.client, deadline.remaining())
        except psframe.PsframeError as e:
            logs = "\n".join(f"--- {n}:\n{self.children.log_tail(n)}" for n in self.names)
            raise BenchmarkError(f"ps tasks did not come up: {e}\n{logs}") from e
        return self.client

    def finish(self, timeout: float = 15.0) -> list[int | None]:
        """Tell the ps tasks the worker is done and wait for them to exit (0 expected).

        Returns:
            Each ps task's exit code (None: still running; it is killed later).
        """
        return finish_clusters([self], timeout)


def finish_clusters(clusters: Sequence[PsCluster], timeout: float = 15.0) -> list[int | None]:
    """Finish the worker of every cluster, then wait (at most ``timeout`` s in
    all) for every ps task to exit; a code other than 0 is reported on stderr.

    Returns:
        The exit code of each ps task, cluster by cluster (None: still running).
    """
    for cluster in clusters:
        if cluster.client is not None:
            control_calls.finish(cluster.client)
            cluster.client.close()
            cluster.client = None
    deadline = Deadline(timeout, "ps tasks exiting")
    codes = []
    for cluster in clusters:
        for name in cluster.names:
            code = cluster.children.wait_exit(name, deadline.remaining(0.0))
            if code != 0:
                print(
                    f"[bench] warning: {name} ended with {code} (expected 0); log:\n"
                    f"{cluster.children.log_tail(name, 10)}",
                    file=sys.stderr,
                )
            codes.append(code)
    return codes


def in_parallel(calls: Sequence[Callable[[], T]], deadline: Deadline) -> list[T]:
    """Run ``calls`` in threads (e.g. Init of several clusters); their results in order."""
    if not calls:
        return []
    with futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        pending = [pool.submit(call) for call in calls]
        return [f.result(timeout=deadline.remaining()) for f in pending]

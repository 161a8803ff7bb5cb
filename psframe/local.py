"""A whole cluster's ps tasks in this process, for notebooks and tests.

psframe's counterpart of TF's ``tf.train.Server.create_local_server()`` and
``tf.test.create_local_cluster``: the ps tasks serve from this process on
free loopback ports, and :attr:`LocalCluster.cluster` holds their real
addresses, ready for :class:`psframe.Trainer` in this process (or for worker
processes started with ``--cluster_spec``).

Example::

    with psframe.local_cluster(num_ps=2, num_workers=1) as local:
        with psframe.Trainer(model, local.cluster, optimizer=psframe.optim.SGD(lr=0.1)) as trainer:
            for x, y in loader:
                trainer.step(F.cross_entropy(model(x), y))
    # the ps tasks have stopped
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any

from psframe.cluster import ClusterSpec
from psframe.errors import PortInUseError
from psframe.launch import pick_free_ports
from psframe.ps.serving.server import Server

log = logging.getLogger(__name__)

# Another process may take a port between picking and binding it (ps tasks after the
# first, whose addresses must be known before the first binds): start again, this often.
ATTEMPTS = 3
_NOT_ALLOWED = ("bind_address", "start")

__all__ = ["LocalCluster", "local_cluster"]


class LocalCluster:
    """The ps tasks of a cluster, serving in this process; see :func:`local_cluster`.

    Lifecycle: made serving; :meth:`stop` (or leaving a ``with`` block, or the
    interpreter exiting) stops every ps task, waiting at most ``grace`` + 1 s
    for each. The worker tasks have no server here: their addresses name them
    in the cluster, and the Trainers of this process (or of other processes)
    are them.

    Attributes:
        cluster: the cluster, with the real addresses of the ps tasks.
        ps_servers: the ps tasks' servers, in task order.
    """

    def __init__(self, cluster: ClusterSpec, ps_servers: list[Server]) -> None:
        self.cluster = cluster
        self.ps_servers = ps_servers
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(self.stop)  # a notebook's cluster stops with the interpreter

    @property
    def ps_targets(self) -> list[str]:
        """The ps tasks' ``grpc://host:port`` addresses, in task order."""
        return [server.target for server in self.ps_servers]

    def join(self, timeout: float) -> bool:
        """Wait until every worker has finished and the ps tasks stopped on their own.

        Args:
            timeout: seconds to wait at most, for all ps tasks together.

        Returns:
            True if every ps task is done, False if ``timeout`` ran out first.

        Raises:
            PsframeError: a ps task's serving process died.
        """
        deadline = time.monotonic() + timeout
        return all(server.join(timeout=max(0.0, deadline - time.monotonic())) for server in self.ps_servers)

    def stop(self, grace: float = 0.5) -> None:
        """Stop every ps task (idempotent); calls in flight get ``grace`` seconds to finish."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        for server in self.ps_servers:
            server.stop(grace)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "serving"
        return f"LocalCluster({self.cluster.to_string()!r}, {state})"


def local_cluster(
    num_ps: int = 1, num_workers: int = 2, host: str = "127.0.0.1", **server_options: Any
) -> LocalCluster:
    """Starts ``num_ps`` ps tasks in this process, on free ports of ``host``.

    The first ps task binds port 0 and reports the port it got; the others
    (whose addresses every ps task must know before it serves) take ports
    picked just before, and the cluster starts again, at most
    :data:`ATTEMPTS` times, if another process took one in between. The
    workers' addresses are free ports too, which nothing here listens on.

    Args:
        num_ps: ps tasks (>= 1).
        num_workers: worker tasks of the cluster (>= 1): the Trainers to come.
        host: the loopback (or other local) address everything listens on.
        **server_options: keyword arguments of :class:`psframe.Server` for every
            ps task, e.g. ``checkpoint_dir``, ``security``, ``liveness``,
            ``worker_timeout``; ``serving_processes`` defaults to 1 (this
            process alone serves).

    Returns:
        The serving :class:`LocalCluster`; use it in a ``with`` block, or call
        :meth:`LocalCluster.stop`.

    Raises:
        ValueError: ``num_ps`` or ``num_workers`` is not an int >= 1, or a
            server option is ``bind_address`` or ``start``.
        PortInUseError: every attempt found a port taken.

    Example::

        local = psframe.local_cluster(num_ps=1, num_workers=2)
        local.cluster    # ClusterSpec('ps|127.0.0.1:40123,worker|127.0.0.1:40125;127.0.0.1:40127')
        local.stop()
    """
    for name, value in (("num_ps", num_ps), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    given = sorted(set(server_options) & set(_NOT_ALLOWED))
    if given:
        raise ValueError(f"local_cluster() sets {' and '.join(given)} itself; leave them out of the server options")
    server_options.setdefault("serving_processes", 1)
    for _ in range(ATTEMPTS - 1):
        try:
            return _start(num_ps, num_workers, host, server_options)
        except PortInUseError as e:
            log.info("a port of the local cluster was taken (%s); starting again", e)
    return _start(num_ps, num_workers, host, server_options)


def _start(num_ps: int, num_workers: int, host: str, server_options: dict[str, Any]) -> LocalCluster:
    """One attempt: ps task 0 on port 0, then the others on the ports picked for them."""
    address = f"[{host}]" if ":" in host else host
    ports = pick_free_ports(num_ps - 1 + num_workers, host)
    ps = [f"{address}:0"] + [f"{address}:{p}" for p in ports[: num_ps - 1]]
    workers = [f"{address}:{p}" for p in ports[num_ps - 1 :]]
    first = Server(ClusterSpec({"ps": ps, "worker": workers}), "ps", 0, **server_options)
    servers = [first]
    cluster = first.cluster  # with the port task 0 got
    try:
        for k in range(1, num_ps):
            servers.append(Server(cluster, "ps", k, **server_options))
    except BaseException:
        for server in servers:
            server.stop(grace=0.0)
        raise
    return LocalCluster(cluster, servers)

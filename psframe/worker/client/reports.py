"""Tasks asked who they are, without torch (``psframe status``, ``psframe ping``).

:class:`ReportClient` asks a running cluster's ps tasks as a tool
(``job_name="tool"``, as :class:`~psframe.worker.client.ps_client.PsClient`
does for ``psframe shutdown``), and :func:`ping` asks one task at an address;
both read the answers with :func:`psframe.wire.task_info.status_without_settings`.
gRPC and protobuf only: a command that prints the reports starts in a
fraction of the time that importing torch takes.
"""

from __future__ import annotations

from psframe import errors
from psframe.cluster import ClusterSpec, parse_address
from psframe.config.security import Security
from psframe.status import TaskStatus
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport
from psframe.wire.task_info import status_without_settings


class ReportClient:
    """Channels to every ps task of ``cluster``, to ask each for its report.

    Args:
        cluster: the running cluster (its ps tasks are asked).
        rpc_timeout: deadline in seconds of each call.
        security: the auth token every call carries, and TLS (default: none).
    """

    def __init__(self, cluster: ClusterSpec, *, rpc_timeout: float, security: Security | None = None) -> None:
        self.rpc_timeout = rpc_timeout
        caller = pb.Caller(
            job_name="tool",
            task_index=0,
            cluster_fingerprint=cluster.fingerprint,
            ps_fingerprint=cluster.ps_fingerprint,
        )
        self._request = pb.InfoRequest(caller=caller)
        self._ps = [
            transport.Connection(address, f"{ClusterSpec.task_name('ps', k)} at {address}", security)
            for k, address in enumerate(cluster.job_tasks("ps"))
        ]

    def get_info(self, ps_task: int) -> TaskStatus:
        """One ps task's report; its ``optimizer``, ``table_optimizer`` and ``sync`` are left None (unread).

        Raises:
            PsframeError: the task did not answer (:class:`~psframe.errors.TaskUnavailableError`,
                :class:`~psframe.errors.RpcTimeoutError`), or refused the call.
        """
        info = self._ps[ps_task].call("GetInfo", self._request, timeout=self.rpc_timeout)
        return status_without_settings(info)

    def close(self) -> None:
        for connection in self._ps:
            connection.close()

    def __enter__(self) -> ReportClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ask(target: str, timeout: float = 5.0, security: Security | None = None) -> pb.TaskInfo:
    """The ``TaskInfo`` of the task at ``target`` (``grpc://host:port`` or ``host:port``), waiting for it
    to come up for ``timeout`` seconds (:func:`psframe.worker.client.control_calls.ping` reads it whole).

    Raises:
        ConnectTimeoutError: nothing answered within ``timeout`` seconds.
        AuthenticationError: the task refused the call (``security``'s token is missing or wrong).
        PsframeError: something answered, but not as a psframe task.
    """
    address = target.removeprefix("grpc://")
    parse_address(address)
    with transport.Connection(address, security=security) as connection:
        try:
            return connection.call("GetInfo", pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except errors.RpcTimeoutError as e:
            raise errors.ConnectTimeoutError(
                f"no psframe task answered at {address} within {timeout}s; is it started, and is the address right?"
            ) from e


def ping(target: str, timeout: float = 5.0, security: Security | None = None) -> TaskStatus:
    """Who the task at ``target`` is (:func:`ask`); its ``optimizer``, ``table_optimizer`` and
    ``sync`` are left None (unread)."""
    return status_without_settings(ask(target, timeout, security))

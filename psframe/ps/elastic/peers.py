"""A ps task's calls to the other ps tasks of its cluster.

A restarted ps task asks the others for their global step (it goes on from
the highest, so a sync cluster stays in lockstep), and in synchronous
training every ps task but the first asks ps task 0 which workers are the
members of a step's round.
"""

from __future__ import annotations

from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.errors import PsframeError
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport

# How long a restarted ps task waits for another's global step (one that
# does not answer quickly is left out).
PEER_STEP_TIMEOUT_S = 2.0


class PsPeers:
    """The connections from ps task ``task_index`` to the others, each made on first use."""

    def __init__(
        self, cluster: ClusterSpec, task_index: int, security: Security | None = None, liveness: Liveness | None = None
    ) -> None:
        self.cluster = cluster
        self.task_index = task_index
        self._security = security or Security()
        self._liveness = liveness
        self._connections: dict[int, transport.Connection] = {}

    def connection(self, ps_task: int) -> transport.Connection:
        """The connection to another ps task (made once)."""
        connection = self._connections.get(ps_task)
        if connection is None:
            address = self.cluster.task_address("ps", ps_task)
            connection = self._connections[ps_task] = transport.Connection(
                address, f"{ClusterSpec.task_name('ps', ps_task)} at {address}", self._security, self._liveness
            )
        return connection

    def global_steps(self) -> list[int]:
        """Global steps of the other ps tasks that hold a model (those that answer quickly)."""
        steps = []
        request = pb.InfoRequest()
        for k in range(self.cluster.num_ps):
            if k == self.task_index:
                continue
            try:
                info = self.connection(k).call("GetInfo", request, timeout=PEER_STEP_TIMEOUT_S)
            except PsframeError:
                continue
            if info.state == pb.TaskInfo.READY:
                steps.append(info.global_step)
        return steps

    def step_members(self, step: int, timeout: float) -> tuple[int, ...]:
        """The workers ps task 0 counted as the members of ``step``'s round (waits for its decision)."""
        caller = pb.Caller(job_name="ps", task_index=self.task_index, cluster_fingerprint=self.cluster.fingerprint)
        reply = self.connection(0).call(
            "StepMembers", pb.StepMembersRequest(caller=caller, step=step), timeout=timeout + 5.0, wait_for_ready=True
        )
        return tuple(reply.workers)

    def close(self) -> None:
        """Close every connection made."""
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()

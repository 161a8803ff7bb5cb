"""Where a ps task stands: the cluster it is in now, and its connections to the other ps tasks.

A re-layout (:mod:`psframe.ps.elastic.relayout`) that keeps a task at its
index moves it to the cluster after the cut (:meth:`TaskPlace.move`). The
connections of the layouts before stay open until the task closes: a round
may be asking ps 0 on one, and a later stage reads parts from them
(:meth:`TaskPlace.peers_at`).
"""

from __future__ import annotations

from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.ps.elastic.peers import PsPeers


class TaskPlace:
    """The cluster of ps task ``task_index`` and its connections to the other ps tasks.

    Attributes:
        cluster: the cluster the task is in now.
        peers: the connections to the other ps tasks of ``cluster``.
    """

    def __init__(
        self, cluster: ClusterSpec, task_index: int, security: Security | None, liveness: Liveness | None
    ) -> None:
        self.cluster = cluster
        self._task_index = task_index
        self._security, self._liveness = security, liveness
        self.peers = PsPeers(cluster, task_index, security, liveness)
        self._old_peers: list[PsPeers] = []  # of the layouts before a re-layout

    def move(self, after: ClusterSpec) -> None:
        """Be a task of ``after`` from now on (a re-layout kept this task at its index)."""
        self.cluster = after
        # The connections before stay open (a round may be asking ps 0 on one); closed with the task.
        self._old_peers.append(self.peers)
        self.peers = PsPeers(after, self._task_index, self._security, self._liveness)

    def peers_at(self, addresses: list[str]) -> PsPeers:
        """The connections to the ps tasks at ``addresses`` (the layout before a re-layout's stage):
        those this task has of its cluster now or of one before, or new ones, kept for later stages."""
        for peers in [self.peers, *self._old_peers]:
            if peers.cluster.job_tasks("ps") == addresses:
                return peers
        before = ClusterSpec({"ps": addresses, "worker": self.cluster.job_tasks("worker")})
        peers = PsPeers(before, self._task_index, self._security, self._liveness)
        self._old_peers.append(peers)
        return peers

    def close(self) -> None:
        """Close the connections to the other ps tasks, of every layout."""
        for peers in [*self._old_peers, self.peers]:
            peers.close()

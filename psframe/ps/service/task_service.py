"""What every task answers (GetInfo, Shutdown); the ps task's service builds on it.

Handlers take a request message and return a reply; :mod:`psframe.wire.transport`
serves them and turns the psframe errors they raise into status codes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError
from psframe.version import __version__
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


class TaskService:
    """What every task answers: who it is (GetInfo). Worker tasks serve only this."""

    def __init__(self, cluster: ClusterSpec, job_name: str, task_index: int) -> None:
        self.cluster = cluster
        self.job_name = job_name
        self.task_index = task_index
        self.task_name = ClusterSpec.task_name(job_name, task_index)
        self.all_finished = threading.Event()

    def info(self) -> pb.TaskInfo:
        return pb.TaskInfo(
            job_name=self.job_name,
            task_index=self.task_index,
            address=self.cluster.task_address(self.job_name, self.task_index),
            cluster_spec=self.cluster.to_string(),
            cluster_fingerprint=self.cluster.fingerprint,
            state=pb.TaskInfo.READY,
            version=__version__,
            pid=os.getpid(),
            restored_step=-1,
        )

    def get_info(self, request: pb.InfoRequest) -> pb.TaskInfo:
        return self.info()

    def check_training_over(self) -> bool:
        """Whether the task's work is done (a ps: every worker finished)."""
        return self.all_finished.is_set()

    def _same_cluster(self, caller: pb.Caller) -> bool:
        """Whether the caller was given this task's cluster."""
        return caller.cluster_fingerprint == self.cluster.fingerprint

    def _check_tool_or_worker(self, caller: pb.Caller) -> None:
        if not self._same_cluster(caller) or caller.job_name not in ("tool", "worker"):
            raise ClusterMismatchError(
                f"{self.task_name} takes this call only from a worker or tool of cluster "
                f"{self.cluster.to_string()!r} (fingerprint {self.cluster.fingerprint}); the caller has "
                f"job {caller.job_name!r} and fingerprint {caller.cluster_fingerprint or 'none'}: give it "
                f"the cluster the tasks were started with"
            )

    def shutdown(self, request: pb.ShutdownRequest) -> pb.ShutdownReply:
        self._check_tool_or_worker(request.caller)
        log.info(
            "%s: shutdown asked by %s",
            self.task_name,
            ClusterSpec.caller_name(request.caller.job_name, request.caller.task_index),
        )
        self.all_finished.set()
        return pb.ShutdownReply()

    def close(self) -> None:
        """Release what the service holds once the server stopped (nothing, for a bare task)."""

    def handlers(self) -> dict[str, Callable]:
        """The methods of the service this task answers, by name."""
        return {"GetInfo": self.get_info, "Shutdown": self.shutdown}

"""The gRPC servicer every task has (GetInfo, Shutdown), and the one place
where psframe errors become gRPC status codes, with the error's class name in
the trailing metadata.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable

import grpc

from psframe import errors
from psframe.wire.codec import ERROR_METADATA_KEY, SERVICE_NAME
from psframe.version import __version__
from psframe.cluster import ClusterSpec
from psframe.errors import (
    BarrierTimeoutError,
    ClusterMismatchError,
    InvalidGradientError,
    NotReadyError,
    OptimizerConfigError,
    PsframeError,
    WireFormatError,
)
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


_STATUS_OF = (
    (InvalidGradientError, grpc.StatusCode.INVALID_ARGUMENT),
    (WireFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (OptimizerConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (ClusterMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (BarrierTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
)


def translate_errors(method: Callable) -> Callable:
    """Turn a PsframeError into a status code plus the error's class name."""

    @functools.wraps(method)
    def wrapper(self, request, context: grpc.ServicerContext):
        try:
            return method(self, request, context)
        except PsframeError as e:
            code = next((c for cls, c in _STATUS_OF if isinstance(e, cls)), grpc.StatusCode.UNKNOWN)
            context.set_trailing_metadata(((ERROR_METADATA_KEY, type(e).__name__),))
            context.abort(code, str(e))
        except Exception as e:  # a bug, not bad input: say so, keep serving
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper


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
        )

    @translate_errors
    def get_info(self, request: pb.InfoRequest, context) -> pb.TaskInfo:
        return self.info()

    def check_training_over(self) -> bool:
        """Whether the task's work is done (a ps: every worker finished)."""
        return self.all_finished.is_set()

    def _check_tool_or_worker(self, caller: pb.Caller) -> None:
        if caller.cluster_fingerprint != self.cluster.fingerprint or caller.job_name not in ("tool", "worker"):
            raise ClusterMismatchError(
                f"{self.task_name} takes this call only from a worker or tool of cluster "
                f"{self.cluster.to_string()!r} (fingerprint {self.cluster.fingerprint}); the caller has "
                f"job {caller.job_name!r} and fingerprint {caller.cluster_fingerprint or 'none'}"
            )

    @translate_errors
    def shutdown(self, request: pb.ShutdownRequest, context) -> pb.ShutdownReply:
        self._check_tool_or_worker(request.caller)
        log.info("%s: shutdown asked by /job:%s/task:%d", self.task_name,
                 request.caller.job_name, request.caller.task_index)
        self.all_finished.set()
        return pb.ShutdownReply()

    def _method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "GetInfo": grpc.unary_unary_rpc_method_handler(
                self.get_info,
                request_deserializer=pb.InfoRequest.FromString,
                response_serializer=pb.TaskInfo.SerializeToString,
            ),
            "Shutdown": grpc.unary_unary_rpc_method_handler(
                self.shutdown,
                request_deserializer=pb.ShutdownRequest.FromString,
                response_serializer=pb.ShutdownReply.SerializeToString,
            ),
        }

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, self._method_handlers())

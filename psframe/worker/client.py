"""A worker's channels to every ps task: connect, init, push/pull, finish.

Requests go to all ps tasks in parallel (gRPC futures), and a failed call is
raised as the psframe error the ps raised, or as a named transport error.
Every wait has a deadline.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import torch

from psframe import errors
from psframe.wire import codec
from psframe.checkpoint.files import ShardRecord
from psframe.cluster import ClusterSpec, parse_address
from psframe.wire.codec import GRPC_OPTIONS, SERVICE_NAME, remote_error
from psframe.errors import ClusterMismatchError, ConnectTimeoutError, PsframeError
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)

# Reconnect quickly to a ps that comes up late or restarts; gRPC's default
# backoff grows to two minutes.
CLIENT_OPTIONS = GRPC_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
)
LOG_EVERY_SECONDS = 5.0
# PushPull requests in flight on one stream (see PsClient.push_pull).
WINDOW = 4


class PsClient:
    """Channels from one worker to every ps task of the cluster.

    Args:
        cluster: the cluster.
        task_index: the worker's index.
        rpc_timeout: deadline in seconds of each call once connected.
    """

    def __init__(self, cluster: ClusterSpec, task_index: int, *, rpc_timeout: float = 300.0,
                 job_name: str = "worker") -> None:
        if job_name == "worker":
            cluster.validate_task("worker", task_index)
        elif job_name != "tool":
            raise ValueError(f"job_name must be 'worker' or 'tool' (a command such as psframe shutdown), "
                             f"got {job_name!r}")
        self.cluster = cluster
        self.task_index = task_index
        self.rpc_timeout = rpc_timeout
        self.caller = pb.Caller(
            job_name=job_name, task_index=task_index, cluster_fingerprint=cluster.fingerprint
        )
        self.addresses = cluster.job_tasks("ps")
        self.names = [ClusterSpec.task_name("ps", i) for i in range(len(self.addresses))]
        self._channels = [grpc.insecure_channel(a, options=CLIENT_OPTIONS) for a in self.addresses]

        def method(name: str, serializer=None, deserializer=None) -> list[grpc.UnaryUnaryMultiCallable]:
            return [
                ch.unary_unary(f"/{SERVICE_NAME}/{name}", request_serializer=serializer,
                               response_deserializer=deserializer)
                for ch in self._channels
            ]

        self._get_info = method("GetInfo", pb.InfoRequest.SerializeToString, pb.TaskInfo.FromString)
        self._finish = method("Finish", pb.FinishRequest.SerializeToString, pb.FinishResponse.FromString)
        self._save = method("Save", pb.SaveRequest.SerializeToString, pb.SaveReply.FromString)
        self._shutdown = method("Shutdown", pb.ShutdownRequest.SerializeToString, pb.ShutdownReply.FromString)
        # Tensor-carrying methods send and receive bytes made by psframe.wire.codec.
        self._init = method("Init")
        self._push_pull = [ch.stream_stream(f"/{SERVICE_NAME}/PushPull") for ch in self._channels]
        self._streams: dict[int, _Stream] = {}
        self._watchdog = _Watchdog()

    @property
    def num_ps(self) -> int:
        return len(self.addresses)

    def describe(self, ps_task: int) -> str:
        return f"{self.names[ps_task]} at {self.addresses[ps_task]}"

    # ---- waiting for peers

    def wait_for_ps(self, timeout: float, *, ready: bool = False) -> list[pb.TaskInfo]:
        """Wait until every ps task answers (and, with ``ready``, holds the model).

        Logs whom it waits for every few seconds.

        Returns:
            Each ps task's :class:`TaskInfo`, by task index.

        Raises:
            ConnectTimeoutError: naming the tasks still missing after ``timeout``.
            ClusterMismatchError: a ps task was started with another cluster.
        """
        start = time.monotonic()
        deadline = start + timeout
        next_log = start  # say at once whom we wait for, then every few seconds
        infos: dict[int, pb.TaskInfo] = {}
        pending = list(range(self.num_ps))
        request = pb.InfoRequest(caller=self.caller)
        while True:
            for i in list(pending):
                try:
                    info = self._get_info[i](request, timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise remote_error(e, self.describe(i)) from e
                    continue
                self._check_identity(i, info)
                if info.state == pb.TaskInfo.FINISHED:
                    raise errors.TrainingFinishedError(
                        f"{self.describe(i)} has seen every worker finish; training is over"
                    )
                if ready and info.state != pb.TaskInfo.READY:
                    continue
                infos[i] = info
                pending.remove(i)
            if not pending:
                return [infos[i] for i in range(self.num_ps)]
            now = time.monotonic()
            what = "hold the model (the chief creates it)" if ready else "come up"
            missing = ", ".join(self.describe(i) for i in pending)
            if now >= deadline:
                raise ConnectTimeoutError(
                    f"/job:worker/task:{self.task_index} waited {now - start:.1f}s for {missing} "
                    f"to {what}; giving up"
                )
            if now >= next_log:
                log.info("worker %d waiting for %s to %s (%.0fs of %.0fs)",
                         self.task_index, missing, what, now - start, timeout)
                next_log = now + LOG_EVERY_SECONDS
            time.sleep(min(0.1, max(0.0, deadline - now)))

    def _check_identity(self, ps_task: int, info: pb.TaskInfo) -> None:
        if (info.job_name, info.task_index) != ("ps", ps_task) or info.cluster_spec != self.cluster.to_string():
            raise ClusterMismatchError(
                f"{self.addresses[ps_task]} should be {self.names[ps_task]} of cluster "
                f"{self.cluster.to_string()!r}, but it is /job:{info.job_name}/task:{info.task_index} "
                f"of cluster {info.cluster_spec!r}"
            )

    # ---- calls

    def get_info(self, ps_task: int) -> pb.TaskInfo:
        """One ps task's :class:`TaskInfo`."""
        return self._call(self._get_info, [(ps_task, pb.InfoRequest(caller=self.caller))])[0]

    def init(self, requests: Sequence[tuple[int, bytes]]) -> list[bytes]:
        """Send Init requests (encoded by the codec) to their ps tasks, in parallel."""
        return self._call(self._init, requests)

    def push_pull(self, requests: Sequence[tuple[int, bytes]], timeout: float | None = None
                  ) -> list[tuple[pb.PushPullReplyHeader, list[torch.Tensor]]]:
        """Send PushPull requests (encoded by the codec) to their ps tasks, in parallel.

        Each ps task is reached over one long-lived stream (opened on first
        use, reopened after a failure). At most :data:`WINDOW` requests are in
        flight on a stream: enough to keep sending while the ps works, few
        enough that neither side buffers a whole large model.

        Returns:
            The decoded replies, in the order of ``requests``.

        Raises:
            PsframeError: the error a ps task raised, or a transport error
                naming the task; RpcTimeoutError after ``timeout`` seconds.
        """
        timeout = timeout or self.rpc_timeout
        unsent: dict[int, collections.deque[int]] = {}
        for i, (ps_task, _) in enumerate(requests):
            unsent.setdefault(ps_task, collections.deque()).append(i)
        in_flight = {ps_task: collections.deque() for ps_task in unsent}
        replies: list = [None] * len(requests)
        failure: PsframeError | None = None

        def send_more(ps_task: int) -> None:
            while unsent[ps_task] and len(in_flight[ps_task]) < WINDOW:
                i = unsent[ps_task].popleft()
                self._stream(ps_task).send(requests[i][1], timeout)
                in_flight[ps_task].append(i)

        for ps_task in unsent:
            send_more(ps_task)
        while any(in_flight.values()):
            for ps_task, waiting in in_flight.items():
                if not waiting:
                    continue
                i = waiting.popleft()
                stream = self._streams[ps_task]
                try:
                    data = stream.receive()
                except grpc.RpcError as e:
                    self._streams.pop(ps_task, None)
                    stream.close()
                    failure = failure or (
                        errors.RpcTimeoutError(f"{self.describe(ps_task)} did not answer within {timeout}s")
                        if stream.expired else remote_error(e, self.describe(ps_task), timeout)
                    )
                    waiting.clear()
                    unsent[ps_task].clear()
                    continue
                header, tensors = codec.decode(data, pb.PushPullReplyHeader)
                if header.error_class:
                    cls = getattr(errors, header.error_class, None)
                    if not (isinstance(cls, type) and issubclass(cls, PsframeError)):
                        cls = errors.RemoteError
                    failure = failure or cls(header.error_message)
                replies[i] = (header, tensors)
                send_more(ps_task)
        if failure is not None:
            raise failure
        return replies

    def _stream(self, ps_task: int) -> _Stream:
        stream = self._streams.get(ps_task)
        if stream is None:
            stream = self._streams[ps_task] = _Stream(self._push_pull[ps_task], self._watchdog)
        return stream

    def save(self, checkpoint_dir: str, step: int) -> list[ShardRecord]:
        """Ask every ps task to write its shard of checkpoint ``step``, in parallel."""
        request = pb.SaveRequest(caller=self.caller, checkpoint_dir=checkpoint_dir, step=step)
        replies = self._call(self._save, [(i, request) for i in range(self.num_ps)])
        return [ShardRecord(ps_task=k, file=r.file, sha256=r.sha256, nbytes=r.nbytes, global_step=r.global_step)
                for k, r in enumerate(replies)]

    def shutdown(self, ps_task: int) -> None:
        """Ask a ps task to stop serving (it exits 0)."""
        self._call(self._shutdown, [(ps_task, pb.ShutdownRequest(caller=self.caller))],
                   timeout=min(self.rpc_timeout, 30.0))

    def reset_streams(self) -> None:
        """Forget the PushPull streams (after a ps task went away); new ones open on next use."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def finish(self) -> None:
        """Tell every ps task this worker is done; a ps that is gone is only logged."""
        request = pb.FinishRequest(caller=self.caller)
        for i in range(self.num_ps):
            try:
                self._call(self._finish, [(i, request)], timeout=min(self.rpc_timeout, 30.0))
            except (errors.TaskUnavailableError, errors.RpcTimeoutError) as e:
                log.warning("worker %d could not report that it finished: %s", self.task_index, e)

    def _call(self, methods: list[Callable], requests: Sequence[tuple[int, object]],
              timeout: float | None = None) -> list:
        timeout = timeout or self.rpc_timeout
        if len(requests) == 1:  # a blocking call costs less than a future
            (i, request), = requests
            try:
                return [methods[i](request, timeout=timeout)]
            except grpc.RpcError as e:
                raise remote_error(e, self.describe(i), timeout) from e
        pending = [(i, methods[i].future(request, timeout=timeout)) for i, request in requests]
        replies, failure = [], None
        for i, future in pending:
            try:
                replies.append(future.result())
            except grpc.RpcError as e:
                failure = failure or remote_error(e, self.describe(i), timeout)
        if failure is not None:
            raise failure
        return replies

    def close(self) -> None:
        self.reset_streams()
        self._watchdog.stop()
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Stream:
    """One long-lived PushPull call: send a request, then receive its reply."""

    _CLOSE = object()

    def __init__(self, method: Callable, watchdog: _Watchdog) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, self._CLOSE))
        self._watchdog = watchdog
        self.expired = False

    def send(self, data: bytes, timeout: float) -> None:
        self._watchdog.arm(self, time.monotonic() + timeout)
        self._requests.put(data)

    def receive(self) -> bytes:
        try:
            return next(self._call)
        finally:
            self._watchdog.disarm(self)

    def expire(self) -> None:
        self.expired = True
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(self._CLOSE)
        self._call.cancel()


class _Watchdog:
    """Cancels a stream whose reply is overdue: a stream has no per-message deadline.

    One thread per client, started on first use, checking a few times a second.
    """

    def __init__(self) -> None:
        self._deadlines: dict[_Stream, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, stream: _Stream, deadline: float) -> None:
        with self._lock:
            self._deadlines[stream] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="psframe-deadlines", daemon=True)
                self._thread.start()

    def disarm(self, stream: _Stream) -> None:
        with self._lock:
            self._deadlines.pop(stream, None)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                overdue = [s for s, deadline in self._deadlines.items() if deadline <= now]
                for stream in overdue:
                    del self._deadlines[stream]
            for stream in overdue:
                stream.expire()

    def stop(self) -> None:
        self._stop.set()


def ping(target: str, timeout: float = 5.0) -> pb.TaskInfo:
    """Ask the task at ``target`` (``grpc://host:port`` or ``host:port``) who it is.

    Raises:
        ConnectTimeoutError: nothing answered within ``timeout`` seconds.
        PsframeError: something answered, but not as a psframe task.
    """
    address = target.removeprefix("grpc://")
    parse_address(address)
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        get_info = channel.unary_unary(
            f"/{SERVICE_NAME}/GetInfo",
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.TaskInfo.FromString,
        )
        try:
            return get_info(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConnectTimeoutError(f"no psframe task answered at {address} within {timeout}s") from e
            raise remote_error(e, address, timeout) from e

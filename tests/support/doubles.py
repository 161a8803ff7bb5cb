"""Test doubles: stand-ins for what a unit test must not wait on or start.

- :class:`FakeClock`: the clock of components where time is the subject (the ps task's
  roster and staleness gate take ``clock=``); a test moves it with :meth:`FakeClock.advance`
  instead of sleeping.
- :class:`InProcessCluster`: ps tasks served in this process without gRPC, reached through
  :class:`InProcessChannel` (the transport's one seam, ``divert_channels``): a ``Trainer``,
  its hooks and tables run in the unit tier, through the real client, codec and service.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from psframe.cluster import ClusterSpec
from psframe.ps.service import ParameterServerService
from psframe.wire import transport


class FakeClock:
    """A monotonic clock that stands still until a test moves it (thread-safe).

    Pass the clock itself where a component takes ``clock: Callable[[], float]``. A component
    that waits on real time in short slices, re-reading its clock (the staleness gate), sees
    a deadline that :meth:`advance` moved past within one slice.
    """

    def __init__(self, start: float = 1000.0, tick: float = 0.0) -> None:
        self._now = start  # not 0: a roster reads 0 as "never heard from"
        self._tick = tick
        self._lock = threading.Lock()

    def now(self) -> float:
        """The time: moved on by ``tick`` at each reading (a clock that runs by itself, as far as
        the component reads it, however long the test takes to get there), then read."""
        with self._lock:
            self._now += self._tick
            return self._now

    __call__ = now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on (never back)."""
        if seconds < 0:
            raise ValueError(f"a clock never goes back, got {seconds}")
        with self._lock:
            self._now += seconds


# ---- ps tasks in this process, reached without gRPC


class RpcFailed(grpc.RpcError):
    """How a call through an :class:`InProcessChannel` fails: as gRPC's own errors read
    (a status code, details, trailing metadata; :func:`psframe.wire.transport.error_from_rpc`)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


class _Context:
    """What the transport's handlers use of ``grpc.ServicerContext``."""

    def __init__(self, timeout: float | None) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._trailing: tuple = ()
        self.callbacks: list[Callable[[], object]] = []

    def time_remaining(self) -> float:
        return 1e18 if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RpcFailed(code, details, self._trailing)

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self.callbacks.append(callback)
        return True

    def peer(self) -> str:
        return "in-process"

    def invocation_metadata(self) -> tuple:
        return ()


def _identity(value: Any) -> Any:
    return value


class _UnaryCall:
    """One unary method of an :class:`InProcessChannel`: the request's bytes to the handler in a
    thread of its own, the reply's bytes back, within the call's deadline."""

    def __init__(self, handler: Any, name: str, serialize: Callable | None, deserialize: Callable | None) -> None:
        self._handler, self._name = handler, name
        self._serialize, self._deserialize = serialize or _identity, deserialize or _identity

    def __call__(self, request: Any, timeout: float | None = None, metadata: Any = None, **_: Any) -> Any:
        if self._handler is None:
            raise RpcFailed(grpc.StatusCode.UNIMPLEMENTED, f"{self._name} is not served here")
        handler, data = self._handler, self._serialize(request)
        outcome: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            try:
                parsed = (handler.request_deserializer or _identity)(data)
                reply = handler.unary_unary(parsed, _Context(timeout))
                outcome.put((True, (handler.response_serializer or _identity)(reply)))
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                outcome.put((False, e))

        threading.Thread(target=serve, name=f"in-process-{self._name}", daemon=True).start()
        try:
            done, value = outcome.get(timeout=timeout)
        except queue.Empty:
            raise RpcFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        if not done:
            raise value if isinstance(value, grpc.RpcError) else RpcFailed(grpc.StatusCode.UNKNOWN, repr(value))
        return self._deserialize(value)


class _StreamCall:
    """One two-way stream of an :class:`InProcessChannel`: the handler runs in a thread of its own,
    taking the caller's requests as they come; replies are read in order; cancel ends the reading."""

    _END = object()

    def __init__(self, handler: Any, requests: Any, serialize: Callable, deserialize: Callable) -> None:
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._deserialize = deserialize
        self._context = _Context(None)
        parse = handler.request_deserializer or _identity
        incoming = (parse(serialize(request)) for request in requests)
        threading.Thread(target=self._serve, args=(handler, incoming), name="in-process-stream", daemon=True).start()

    def _serve(self, handler: Any, incoming: Any) -> None:
        write = handler.response_serializer or _identity
        try:
            for reply in handler.stream_stream(incoming, self._context):
                if self._cancelled.is_set():
                    return
                self._replies.put(write(reply))
            self._replies.put(self._END)
        except BaseException as e:  # noqa: BLE001 - the caller's to raise
            self._replies.put(e if isinstance(e, grpc.RpcError) else RpcFailed(grpc.StatusCode.UNKNOWN, repr(e)))

    def __iter__(self) -> _StreamCall:
        return self

    def __next__(self) -> Any:
        reply = self._replies.get() if not self._cancelled.is_set() else None
        if self._cancelled.is_set():
            raise RpcFailed(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        if reply is self._END:
            self._replies.put(self._END)  # a stream that ended stays ended
            raise StopIteration
        if isinstance(reply, grpc.RpcError):
            self._replies.put(reply)
            raise reply
        return self._deserialize(reply)

    def cancel(self) -> bool:
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._replies.put(None)  # wakes a reader
            for callback in self._context.callbacks:
                callback()
        return True


class InProcessChannel:
    """A channel to a task's handlers in this process (what :func:`psframe.wire.transport.method_handlers`
    makes of a service's ``handlers()``): each request is serialized, handed to its handler as the
    bytes gRPC would carry, and the reply's bytes parsed; errors come back as gRPC's would."""

    def __init__(self, table: Mapping[str, Any]) -> None:
        self._table = table

    def unary_unary(
        self, path: str, request_serializer: Callable | None = None, response_deserializer: Callable | None = None
    ) -> _UnaryCall:
        name = path.rsplit("/", 1)[-1]
        return _UnaryCall(self._table.get(name), name, request_serializer, response_deserializer)

    def stream_stream(
        self, path: str, request_serializer: Callable | None = None, response_deserializer: Callable | None = None
    ) -> Callable[..., _StreamCall]:
        name = path.rsplit("/", 1)[-1]
        handler = self._table.get(name)

        def open_stream(requests: Any, metadata: Any = None, **_: Any) -> _StreamCall:
            if handler is None:
                raise RpcFailed(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served here")
            return _StreamCall(handler, requests, request_serializer or _identity, response_deserializer or _identity)

        return open_stream

    def close(self) -> None:
        """Nothing to release: the streams' threads end with their streams."""


class InProcessCluster:
    """The ps tasks of a cluster as services in this process, reached by every client of this
    process through :class:`InProcessChannel` (no gRPC server or channel, no child process):
    a ``Trainer`` on :attr:`cluster` runs in the unit tier.

    Use as a context manager: it diverts channels (:func:`psframe.wire.transport.divert_channels`)
    to its tasks' addresses while open, and closes the services at the end. ``service_options``
    go to each :class:`~psframe.ps.service.ParameterServerService` (``worker_timeout``, ...).

    Not as gRPC: no auth token, no message or per-peer limits, no keepalive; a unary call's
    handler runs on past its deadline, as a cancelled one would on a server.
    """

    def __init__(self, num_ps: int = 1, num_workers: int = 1, **service_options: Any) -> None:
        # Addresses nobody listens on: a call that missed the diversion fails, it never reaches a task.
        self.cluster = ClusterSpec(
            {
                "ps": [f"ps{k}.in-process.invalid:1" for k in range(num_ps)],
                "worker": [f"worker{k}.in-process.invalid:1" for k in range(num_workers)],
            }
        )
        self.services = [ParameterServerService(self.cluster, k, **service_options) for k in range(num_ps)]
        self._tables = {
            self.cluster.task_address("ps", k): transport.method_handlers(service.handlers())
            for k, service in enumerate(self.services)
        }
        self._replaced: Any = None

    def _channel(self, address: str) -> InProcessChannel | None:
        table = self._tables.get(address)
        return None if table is None else InProcessChannel(table)

    def __enter__(self) -> InProcessCluster:
        self._replaced = transport.divert_channels(self._channel)
        return self

    def __exit__(self, *exc: object) -> None:
        transport.divert_channels(self._replaced)
        for service in self.services:
            service.close()

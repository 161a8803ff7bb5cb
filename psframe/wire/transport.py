"""The one place psframe meets gRPC.

Everything that travels between tasks goes through this module:

- :data:`METHODS`, the service's methods as the ``ParameterServer`` service
  of ``psframe.proto`` describes them (names, message types, streaming), so
  nothing else spells out a method path or a serializer. Methods whose
  request carries tensors (a ``header`` + ``payload`` envelope) travel as
  the bytes :mod:`psframe.wire.codec` made, untouched; the others as their
  generated message classes.
- the channel and server options (no 4 MiB message cap, quick reconnects);
- errors both ways: a :class:`PsframeError` raised by a handler becomes a
  status code plus the error's class name in trailing metadata, and a failed
  call becomes that same error class (or a named transport error) again;
- :class:`RpcServer` (a task's server) and :class:`Connection` (calls and
  streams to one task), each with a deadline on every call.

Nothing outside this module imports ``grpc``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from psframe import errors
from psframe.errors import PsframeError
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"]
# A failing call carries the psframe error's class name in this trailing
# metadata key, so the caller can raise the same class.
ERROR_METADATA_KEY = "psframe-error"
# No gRPC message limit of its own (its default is 4 MiB): large variables are
# split into parts that each fit a message (see psframe.cluster.placement).
MESSAGE_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
# Reconnect quickly to a task that comes up late or restarts; gRPC's default
# backoff grows to two minutes.
CHANNEL_OPTIONS = MESSAGE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
)
# Two tasks must never share a port: gRPC would otherwise allow it.
SERVER_OPTIONS = MESSAGE_OPTIONS + (("grpc.so_reuseport", 0),)


@dataclass(frozen=True)
class Method:
    """One method of the service, read from its descriptor."""

    name: str
    path: str  # "/psframe.ParameterServer/PushPull"
    request_type: type[Message]
    reply_type: type[Message]
    streaming: bool  # a long-lived stream each way (PushPull); else one request, one reply

    @property
    def carries_tensors(self) -> bool:
        """Its messages are codec envelopes: they travel as bytes, serialized by the codec."""
        return "payload" in self.request_type.DESCRIPTOR.fields_by_name

    def serializers(self, side: str) -> dict[str, Callable | None]:
        """The keyword arguments gRPC takes for this method's (de)serializers on ``side``."""
        if self.carries_tensors:
            return {}
        if side == "server":
            return {"request_deserializer": self.request_type.FromString,
                    "response_serializer": self.reply_type.SerializeToString}
        return {"request_serializer": self.request_type.SerializeToString,
                "response_deserializer": self.reply_type.FromString}


def _method(descriptor: Any) -> Method:
    if descriptor.client_streaming != descriptor.server_streaming:
        raise TypeError(f"{descriptor.full_name}: psframe serves unary calls and two-way streams only")
    return Method(
        name=descriptor.name,
        path=f"/{SERVICE.full_name}/{descriptor.name}",
        request_type=getattr(pb, descriptor.input_type.name),
        reply_type=getattr(pb, descriptor.output_type.name),
        streaming=descriptor.client_streaming,
    )


METHODS: dict[str, Method] = {d.name: _method(d) for d in SERVICE.methods}

# ---- errors, both ways

_STATUS_OF = (
    (errors.InvalidGradientError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.WireFormatError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.OptimizerConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ClusterMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.NotReadyError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.BarrierTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_code(error: PsframeError) -> grpc.StatusCode:
    """The gRPC status code a psframe error is answered with."""
    return next((code for cls, code in _STATUS_OF if isinstance(error, cls)), grpc.StatusCode.UNKNOWN)


def error_from_rpc(error: grpc.RpcError, peer: str, timeout: float | None = None) -> PsframeError:
    """The psframe error for a failed call to ``peer``.

    A handler's psframe error comes back as the same class (its name travels
    in trailing metadata); transport failures get named ones.
    """
    metadata = dict(error.trailing_metadata() or ())
    name = metadata.get(ERROR_METADATA_KEY)
    if name:
        return errors.error_from_name(str(name), error.details())
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return errors.TaskUnavailableError(f"{peer} is unavailable: {error.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.RpcTimeoutError(f"{peer} did not answer within {timeout}s")
    return errors.RemoteError(f"{peer} failed with {code.name}: {error.details()}")


def _abort(context: grpc.ServicerContext, error: BaseException, method: str) -> None:
    """End a call with the status of ``error`` (raises, as ``context.abort`` does)."""
    if isinstance(error, PsframeError):
        context.set_trailing_metadata(((ERROR_METADATA_KEY, type(error).__name__),))
        context.abort(status_code(error), str(error))
    # A bug, not bad input: say so, keep serving.
    log.error("%s failed", method, exc_info=error)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


# ---- the server side

def _unary_handler(method: Method, handler: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    def serve(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            _abort(context, e, method.name)

    return grpc.unary_unary_rpc_method_handler(serve, **method.serializers("server"))


def _stream_handler(method: Method, handler: Callable[[Iterator], Iterator]) -> grpc.RpcMethodHandler:
    def serve(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        try:
            yield from handler(requests)
        except grpc.RpcError:
            return  # the caller closed or cancelled the stream: the call is over, nothing to answer
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            _abort(context, e, method.name)

    return grpc.stream_stream_rpc_method_handler(serve, **method.serializers("server"))


class RpcServer:
    """A task's gRPC server, answering the methods in ``handlers``.

    Args:
        handlers: method name -> handler. A unary handler takes the request
            and returns the reply; a streaming one takes an iterator of
            requests and yields replies. A handler that raises ends the call
            with the error's status code (a :class:`PsframeError` keeps its class).
        name: the task, for thread names and errors.
        max_threads: calls served at once.

    Raises:
        ValueError: a handler names no method of the service.
    """

    def __init__(self, handlers: Mapping[str, Callable], *, name: str, max_threads: int) -> None:
        unknown = sorted(set(handlers) - set(METHODS))
        if unknown:
            raise ValueError(f"{unknown} are not methods of {SERVICE.full_name}; expected some of {sorted(METHODS)}")
        table = {
            name_: (_stream_handler if METHODS[name_].streaming else _unary_handler)(METHODS[name_], handler)
            for name_, handler in handlers.items()
        }
        self.name = name
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=name.strip("/").replace("/", "-")),
            handlers=(grpc.method_handlers_generic_handler(SERVICE.full_name, table),),
            options=SERVER_OPTIONS,
        )

    def bind(self, address: str) -> int:
        """Listen on ``address`` (``host:port``; port 0 lets the OS choose).

        Returns:
            The port bound.

        Raises:
            PortInUseError: the address cannot be listened on.
        """
        try:
            port = self._server.add_insecure_port(address)
        except RuntimeError as e:
            port, cause = 0, e
        else:
            cause = None
        if port == 0:
            raise errors.PortInUseError(
                f"{self.name} cannot listen on {address}: the port is in use by another process "
                f"or the host is not an address of this machine"
            ) from cause
        return port

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float) -> None:
        """Stop serving; calls in flight get ``grace`` seconds to finish (waited for)."""
        self._server.stop(grace).wait(grace + 1.0)


# ---- the client side

class Connection:
    """Calls to one task, over one channel made on construction.

    Args:
        address: ``host:port`` of the task.
        peer: how errors name the task, e.g. ``"/job:ps/task:1 at h0:2223"``.
    """

    def __init__(self, address: str, peer: str | None = None) -> None:
        self.address = address
        self.peer = peer or address
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._callables: dict[str, Any] = {}

    def _callable(self, name: str) -> Any:
        found = self._callables.get(name)
        if found is None:
            method = METHODS[name]
            make = self._channel.stream_stream if method.streaming else self._channel.unary_unary
            found = self._callables[name] = make(method.path, **method.serializers("client"))
        return found

    def call(self, method: str, request: Any, *, timeout: float, wait_for_ready: bool = False) -> Any:
        """One unary call; its reply.

        Raises:
            PsframeError: the error the task raised, or a transport error naming it
                (:class:`TaskUnavailableError`, :class:`RpcTimeoutError` after ``timeout``).
        """
        try:
            return self._callable(method)(request, timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.peer, timeout) from e

    def start_call(self, method: str, request: Any, *, timeout: float) -> PendingCall:
        """Start a unary call and return at once; :meth:`PendingCall.result` waits for it."""
        return PendingCall(self._callable(method).future(request, timeout=timeout), self.peer, timeout)

    def open_stream(self, method: str, watchdog: Watchdog) -> Stream:
        """A long-lived two-way stream of ``method``; ``watchdog`` enforces each reply's deadline."""
        return Stream(self._callable(method), self.peer, watchdog)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PendingCall:
    """A unary call in flight (see :meth:`Connection.start_call`)."""

    def __init__(self, future: Any, peer: str, timeout: float) -> None:
        self._future, self._peer, self._timeout = future, peer, timeout

    def result(self) -> Any:
        """The reply, once it came (the call's own deadline bounds the wait)."""
        try:
            return self._future.result()
        except grpc.RpcError as e:
            raise error_from_rpc(e, self._peer, self._timeout) from e


def call_all(calls: Sequence[tuple[Connection, str, Any]], timeout: float) -> list[Any]:
    """Make unary calls to several tasks in parallel; their replies, in order.

    Every call is waited for; then the first failure, if any, is raised.
    """
    if len(calls) == 1:  # a blocking call costs less than a future
        (connection, method, request), = calls
        return [connection.call(method, request, timeout=timeout)]
    pending = [connection.start_call(method, request, timeout=timeout) for connection, method, request in calls]
    replies, failure = [], None
    for call in pending:
        try:
            replies.append(call.result())
        except PsframeError as e:
            failure = failure or e
            replies.append(None)
    if failure is not None:
        raise failure
    return replies


class Stream:
    """One long-lived two-way call: send a request, then receive its reply, in order.

    Replies are matched to requests by order; at most as many requests are
    in flight as the caller chooses. Each sent request arms a deadline in
    the :class:`Watchdog` (a stream has no per-message deadline of its own).
    """

    _CLOSE = object()

    def __init__(self, method: Any, peer: str, watchdog: Watchdog) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call = method(iter(self._requests.get, self._CLOSE))
        self._peer = peer
        self._watchdog = watchdog
        self._timeout = 0.0
        self._expired = False

    def send(self, data: Any, timeout: float) -> None:
        """Queue a request; its reply must come within ``timeout`` seconds."""
        self._timeout = timeout
        self._watchdog.arm(self, time.monotonic() + timeout)
        self._requests.put(data)

    def receive(self) -> Any:
        """The reply to the oldest request not yet answered.

        Raises:
            RpcTimeoutError: the reply was overdue (the stream is then cancelled).
            PsframeError: the stream failed (the task went away, or a bug there).
        """
        try:
            return next(self._call)
        except grpc.RpcError as e:
            if self._expired:
                raise errors.RpcTimeoutError(f"{self._peer} did not answer within {self._timeout}s") from e
            raise error_from_rpc(e, self._peer, self._timeout) from e
        except StopIteration:
            raise errors.RemoteError(f"{self._peer} ended the stream") from None
        finally:
            self._watchdog.disarm(self)

    def expire(self) -> None:
        self._expired = True
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(self._CLOSE)
        self._call.cancel()


class Watchdog:
    """Cancels a stream whose reply is overdue.

    One thread per owner, started on first use, checking a few times a second.
    """

    def __init__(self) -> None:
        self._deadlines: dict[Stream, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, stream: Stream, deadline: float) -> None:
        with self._lock:
            self._deadlines[stream] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="psframe-deadlines", daemon=True)
                self._thread.start()

    def disarm(self, stream: Stream) -> None:
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

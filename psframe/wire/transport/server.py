"""A task's gRPC server: handlers by method name, errors turned into status codes.

A server may forward the methods it does not handle to another task, as
the bytes it received and with the caller's deadline: the reply, or the
error with its status code and class name, comes back unchanged. A ps task
served from several processes does this (see :mod:`psframe.ps.serving.serving_processes`).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from psframe import errors
from psframe.cluster import parse_address
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.wire.transport.auth import call_metadata, interceptors, open_channel, server_credentials
from psframe.wire.transport.error_codec import abort
from psframe.wire.transport.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PeerLimiter,
    default_calls_per_peer,
    server_options,
)
from psframe.wire.transport.methods import METHODS, SERVICE, Method

# The longest a forwarded unary call may wait when its caller set no deadline.
# A stream keeps its caller's (none, for PushPull: its replies are timed by
# the caller's watchdog, and cancelling it cancels the forwarded one).
FORWARD_TIMEOUT_S = 3600.0
_NO_DEADLINE_S = 1e12  # gRPC reports ~9.2e18 s left for a call without a deadline


def _unary_handler(method: Method, handler: Callable[[Any], Any], limiter: PeerLimiter | None) -> grpc.RpcMethodHandler:
    def serve(request: Any, context: grpc.ServicerContext) -> Any:
        release = limiter.admit(context) if limiter is not None else None
        try:
            return handler(request if method.carries_tensors else _parse(method, request))
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            abort(context, e, method.name)
        finally:
            if release is not None:
                release()

    # The request arrives as bytes and is parsed here, so that one which does not
    # parse is answered INVALID_ARGUMENT, naming the message (gRPC's own
    # deserializer would answer INTERNAL).
    return grpc.unary_unary_rpc_method_handler(
        serve, response_serializer=(None if method.carries_tensors else method.reply_type.SerializeToString)
    )


def _parse(method: Method, data: bytes) -> Any:
    try:
        return method.request_type.FromString(data)
    except DecodeError as e:
        raise errors.WireFormatError(
            f"{method.name}: the request is not a {method.request_type.__name__} message ({e})"
        ) from None


def _stream_handler(
    method: Method, handler: Callable[[Iterator], Iterator], limiter: PeerLimiter | None
) -> grpc.RpcMethodHandler:
    # The limiter counts the stream in here, not in a wrapper of its own: each request
    # of a PushPull stream passes this one generator on its way to the handler's.
    def serve(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        release = limiter.admit(context) if limiter is not None else None
        try:
            yield from handler(requests)
        except grpc.RpcError:
            return  # the caller closed or cancelled the stream: the call is over, nothing to answer
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            abort(context, e, method.name)
        finally:
            if release is not None:
                release()

    return grpc.stream_stream_rpc_method_handler(serve, **method.serializers("server"))


def method_handlers(
    handlers: Mapping[str, Callable], limiter: PeerLimiter | None = None
) -> dict[str, grpc.RpcMethodHandler]:
    """gRPC's handler of each method in ``handlers`` (see :class:`RpcServer`): requests parsed,
    replies serialized, a raised error turned into the call's status, and each call counted
    against its caller's host by ``limiter`` (none: not limited).

    Raises:
        ValueError: a handler names no method of the service.
    """
    unknown = sorted(set(handlers) - set(METHODS))
    if unknown:
        raise ValueError(f"{unknown} are not methods of {SERVICE.full_name}; expected some of {sorted(METHODS)}")
    return {
        name: (_stream_handler if METHODS[name].streaming else _unary_handler)(METHODS[name], handler, limiter)
        for name, handler in handlers.items()
    }


class _Forwarder:
    """Passes calls on to another task as raw bytes, and its answers (or errors) back.

    The forwarded calls carry this server's own token (the caller's was checked here).
    """

    def __init__(self, address: str, security: Security, liveness: Liveness) -> None:
        self._channel = open_channel(address, security, liveness)
        self._metadata = call_metadata(security)

    def handler(self, method: Method, limiter: PeerLimiter) -> grpc.RpcMethodHandler:
        """The handler that forwards ``method``, its calls counted by ``limiter`` as the server's own are."""
        if method.streaming:
            call = self._channel.stream_stream(method.path)
            return grpc.stream_stream_rpc_method_handler(
                lambda requests, context: self._stream(call, requests, context, limiter)
            )
        call = self._channel.unary_unary(method.path)
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: self._unary(call, request, context, limiter)
        )

    def _unary(self, call: Any, request: bytes, context: grpc.ServicerContext, limiter: PeerLimiter) -> bytes:
        release = limiter.admit(context)
        try:
            return call(request, timeout=_timeout_of(context), metadata=self._metadata)
        except grpc.RpcError as e:
            _relay(e, context)
        finally:
            release()

    def _stream(
        self, call: Any, requests: Iterator[bytes], context: grpc.ServicerContext, limiter: PeerLimiter
    ) -> Iterator[bytes]:
        release = limiter.admit(context)
        try:
            forwarded = call(
                _until_closed(requests), timeout=_timeout_of(context, streaming=True), metadata=self._metadata
            )
            context.add_callback(forwarded.cancel)  # the caller went away: so does the forwarded stream
            try:
                yield from forwarded
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    _relay(e, context)
        finally:
            release()

    def close(self) -> None:
        self._channel.close()


def _timeout_of(context: grpc.ServicerContext, streaming: bool = False) -> float | None:
    """The deadline of a forwarded call: the caller's time left; with none, no deadline
    for a stream and :data:`FORWARD_TIMEOUT_S` for a unary call."""
    remaining = context.time_remaining()
    if remaining < _NO_DEADLINE_S:
        return remaining
    return None if streaming else FORWARD_TIMEOUT_S


def _until_closed(requests: Iterator[bytes]) -> Iterator[bytes]:
    """The caller's requests, ending quietly when the caller closes or cancels its stream."""
    try:
        yield from requests
    except grpc.RpcError:
        return


def _relay(error: grpc.RpcError, context: grpc.ServicerContext) -> NoReturn:
    """End a forwarded call as the task it was forwarded to ended it (raises)."""
    context.set_trailing_metadata(error.trailing_metadata() or ())
    context.abort(error.code(), error.details())
    raise AssertionError("grpc's context.abort returned")  # it raises; said for the type checker


_GENERIC_BIND_FAILURE = "the port is in use by another process, or the host is not an address of this machine"


def _why_not_listening(address: str, share_port: bool = False) -> str | None:
    """Why ``address`` (``host:port``) cannot be listened on, and what to do; None if it can.

    Asked of a plain socket, before gRPC (which says nothing but logs a line of its own),
    bound as gRPC binds: ``SO_REUSEADDR``, and ``SO_REUSEPORT`` for a port shared by the
    processes of one task. An address psframe cannot parse is left for gRPC to judge (None).
    """
    try:
        host, port = parse_address(address, any_port=True)
    except errors.ClusterSpecError:
        return None
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:  # a host name that does not resolve
        return f"host {host!r} has no address; is the host name right?"
    failure: OSError | None = None
    for family, kind, proto, _, sockaddr in found:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if share_port and hasattr(socket, "SO_REUSEPORT"):
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                probe.bind(sockaddr)
            return None  # gRPC listens on every address of the host it can bind
        except OSError as e:
            failure = failure or e
    if failure is not None and failure.errno == errno.EADDRINUSE:
        return (
            f"port {port} is in use by another process (an earlier run still going?); stop it "
            f"(`ss -ltnp 'sport = :{port}'` names it) or give this task a free port"
        )
    if failure is not None and failure.errno == errno.EADDRNOTAVAIL:
        return (
            f"{host} is not an address of this machine; give this task an address of its own host, "
            f"or listen on every address with --bind_address=0.0.0.0:{port}"
        )
    if failure is not None and failure.errno == errno.EACCES:
        return f"port {port} is privileged (below 1024); give this task a port of 1024 or more"
    return _GENERIC_BIND_FAILURE if failure is None else f"{failure.strerror or failure}"


class RpcServer:
    """A task's gRPC server, answering the methods in ``handlers``.

    Args:
        handlers: method name -> handler. A unary handler takes the request
            and returns the reply; a streaming one takes an iterator of
            requests and yields replies. A handler that raises ends the call
            with the error's status code (a :class:`PsframeError` keeps its class).
        name: the task, for thread names and errors.
        max_threads: calls served at once; a call beyond is answered
            ``RESOURCE_EXHAUSTED`` at once (see :mod:`psframe.wire.transport.limits`).
        forward_to: ``host:port`` of a task to forward every other method to;
            None answers them UNIMPLEMENTED.
        share_port: let other processes of this task listen on the same port
            (``SO_REUSEPORT``: the kernel spreads connections among them).
            Off, as for every task with one process: two tasks must never share a port.
        security: the token every call must carry, and the TLS this server
            listens with (and its forwarded calls use); default: none.
        max_message_bytes: the largest request accepted; a larger one is
            answered ``RESOURCE_EXHAUSTED``.
        max_calls_per_peer: calls in flight allowed from one host (and
            streams on one connection); default: three quarters of ``max_threads``.
        liveness: how the server probes its callers' connections (and its
            forwarded calls' channel); default: :meth:`Liveness.resolve`.

    Raises:
        ValueError: a handler names no method of the service.
        SecurityConfigError: TLS is on but the task has no certificate, or a file cannot be read.
    """

    def __init__(
        self,
        handlers: Mapping[str, Callable],
        *,
        name: str,
        max_threads: int,
        forward_to: str | None = None,
        share_port: bool = False,
        security: Security | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_calls_per_peer: int | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        per_peer = max_calls_per_peer or default_calls_per_peer(max_threads)
        # Counted by the method handlers, which run after the token check (an interceptor):
        # a refused caller's calls end at once and are not counted.
        self.limiter = PeerLimiter(per_peer, name)
        table = method_handlers(handlers, self.limiter)
        security = security or Security()
        liveness = liveness or Liveness.resolve()
        self._credentials = server_credentials(security, name)
        self._forwarder = _Forwarder(forward_to, security, liveness) if forward_to else None
        if self._forwarder is not None:
            table.update(
                {name_: self._forwarder.handler(m, self.limiter) for name_, m in METHODS.items() if name_ not in table}
            )
        self.name = name
        self._share_port = share_port
        self._interceptors = interceptors(security)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix=name.strip("/").replace("/", "-")),
            handlers=(grpc.method_handlers_generic_handler(SERVICE.full_name, table),),
            interceptors=self._interceptors,
            options=server_options(max_message_bytes, per_peer, share_port, liveness),
            maximum_concurrent_rpcs=max_threads,
        )

    def bind(self, address: str) -> int:
        """Listen on ``address`` (``host:port``; port 0 lets the OS choose), with TLS if configured.

        Returns:
            The port bound.

        Raises:
            PortInUseError: the address cannot be listened on.
        """
        reason = _why_not_listening(address, self._share_port)
        if reason is not None:
            raise errors.PortInUseError(f"{self.name} cannot listen on {address}: {reason}")
        cause: RuntimeError | None = None
        try:
            if self._credentials is None:
                port = self._server.add_insecure_port(address)
            else:
                port = self._server.add_secure_port(address, self._credentials)
        except RuntimeError as e:
            port, cause = 0, e
        if port == 0:  # taken since the probe, or refused for a reason of gRPC's own
            reason = _why_not_listening(address, self._share_port) or _GENERIC_BIND_FAILURE
            raise errors.PortInUseError(f"{self.name} cannot listen on {address}: {reason}") from cause
        return port

    def bind_local(self, path: str) -> str:
        """Also listen on the Unix socket ``path``, for processes of this task on this
        host: plaintext (its folder's permissions guard it), the token still checked.

        Returns:
            The address to reach it: ``unix:PATH``.

        Raises:
            PortInUseError: the socket cannot be made.
        """
        address = f"unix:{path}"
        cause: RuntimeError | None = None
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as e:
            bound, cause = 0, e
        if bound == 0:
            raise errors.PortInUseError(f"{self.name} cannot listen on {address}") from cause
        return address

    @property
    def refused_calls(self) -> int:
        """Calls this server refused as unauthenticated (this process only)."""
        return sum(interceptor.refused for interceptor in self._interceptors)

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float) -> None:
        """Stop serving; calls in flight get ``grace`` seconds to finish (waited for)."""
        self._server.stop(grace).wait(grace + 1.0)
        if self._forwarder is not None:
            self._forwarder.close()

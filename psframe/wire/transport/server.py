"""A task's gRPC server: handlers by method name, errors turned into status codes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc

from psframe import errors
from psframe.wire.transport.methods import METHODS, SERVER_OPTIONS, SERVICE, Method, abort


def _unary_handler(method: Method, handler: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    def serve(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            abort(context, e, method.name)

    return grpc.unary_unary_rpc_method_handler(serve, **method.serializers("server"))


def _stream_handler(method: Method, handler: Callable[[Iterator], Iterator]) -> grpc.RpcMethodHandler:
    def serve(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        try:
            yield from handler(requests)
        except grpc.RpcError:
            return  # the caller closed or cancelled the stream: the call is over, nothing to answer
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            abort(context, e, method.name)

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

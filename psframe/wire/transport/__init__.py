"""The one place psframe meets gRPC: nothing outside this package imports ``grpc``.

- :mod:`~psframe.wire.transport.methods`: the method table read from the
  ``.proto``'s service, and the channel and server options;
- :mod:`~psframe.wire.transport.error_codec`: errors both ways, one codec
  for every path (a handler's :class:`~psframe.errors.PsframeError` becomes
  its class name and message, with a status code when it ends the call, or
  in a PushPull reply that refuses its request; the caller rebuilds the same
  class, or gets a named transport error);
- :mod:`~psframe.wire.transport.server`: :class:`RpcServer`, a task's server
  (handlers take a request and return a reply, or a stream of requests and
  yield replies; methods it does not handle may be forwarded, as bytes, to
  another task);
- :mod:`~psframe.wire.transport.client`: :class:`Connection` (calls and
  streams to one task), :func:`call_all`, and :class:`Watchdog`, which gives
  each reply on a stream a deadline;
- :mod:`~psframe.wire.transport.auth`: every channel and server made with a
  task's :class:`~psframe.config.security.Security` (the auth token in each call's
  metadata, checked by one server interceptor; TLS), and the one seam where a
  test puts channels of its own (:func:`divert_channels`);
- :mod:`~psframe.wire.transport.limits`: what one caller may take of a
  server (message size, calls in flight per host, streams per connection).
"""

from psframe.wire.transport.auth import (
    UNAUTHENTICATED_MESSAGE,
    TokenInterceptor,
    call_metadata,
    divert_channels,
    open_channel,
)
from psframe.wire.transport.client import Connection, Stream, Watchdog, call_all, call_each
from psframe.wire.transport.error_codec import (
    ERROR_METADATA_KEY,
    decode_error,
    encode_error,
    error_from_rpc,
    status_code,
)
from psframe.wire.transport.limits import DEFAULT_MAX_MESSAGE_BYTES, PeerLimiter
from psframe.wire.transport.methods import CHANNEL_OPTIONS, METHODS, SERVICE, Method
from psframe.wire.transport.server import RpcServer, method_handlers

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ERROR_METADATA_KEY",
    "METHODS",
    "SERVICE",
    "UNAUTHENTICATED_MESSAGE",
    "Connection",
    "Method",
    "PeerLimiter",
    "RpcServer",
    "Stream",
    "TokenInterceptor",
    "Watchdog",
    "call_all",
    "call_each",
    "call_metadata",
    "decode_error",
    "divert_channels",
    "encode_error",
    "error_from_rpc",
    "method_handlers",
    "open_channel",
    "status_code",
]

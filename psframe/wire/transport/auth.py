"""Channels and servers made with a task's :class:`~psframe.config.security.Security`.

Every gRPC channel psframe opens comes from :func:`open_channel`, and every
server gets :func:`server_credentials` and :func:`interceptors`:

- the auth token travels in each call's metadata (``authorization: Bearer
  <token>``); one server interceptor (:class:`TokenInterceptor`) compares it
  in constant time before any handler runs, and answers a call without it,
  or with another, ``UNAUTHENTICATED`` with a message that says nothing
  more (the request is never read);
- with TLS, channels use ``grpc.ssl_channel_credentials`` (the CA, and this
  task's certificate as a client certificate where it has one) and servers
  ``grpc.ssl_server_credentials`` (client certificates required when the
  task has a CA: mutual TLS);
- a Unix socket (``unix:PATH``, the link between a ps task's own processes,
  in a folder only its user may enter) is plaintext: the file system's
  permissions guard it, as they guard the variables the processes share in
  memory; the token is checked there all the same.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.errors import SecurityConfigError
from psframe.wire.transport.methods import channel_options

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer "
# What a refused caller is told: nothing about the cluster, the method or why.
UNAUTHENTICATED_MESSAGE = "unauthenticated"
_LOG_EVERY_S = 10.0


def call_metadata(security: Security) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call of a channel made with ``security`` carries (None: none)."""
    if security.auth_token is None:
        return None
    return ((TOKEN_METADATA_KEY, _BEARER + security.auth_token),)


def _read(path: str | None, what: str) -> bytes:
    if path is None:
        raise SecurityConfigError(f"TLS needs {what}: it is not set")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SecurityConfigError(f"cannot read {what} {path!r}: {e.strerror or e}") from None


ChannelMaker = Callable[[str], Any]
"""Given an address, a channel to it (an object with ``grpc.Channel``'s methods), or None: a gRPC one."""

_diverted: ChannelMaker | None = None


def divert_channels(maker: ChannelMaker | None) -> ChannelMaker | None:
    """Have :func:`open_channel` ask ``maker`` first for every channel (None: stop); returns the one it replaces.

    The seam of tests that serve tasks in this process without gRPC (``tests/support/doubles.py``):
    everything above the channel (calls, streams, deadlines, errors) runs as it does over gRPC.
    """
    global _diverted
    replaced, _diverted = _diverted, maker
    return replaced


def open_channel(address: str, security: Security, liveness: Liveness | None = None) -> grpc.Channel:
    """A channel to ``address`` (``host:port`` or ``unix:PATH``): TLS where ``security`` says so,
    probing its connection as ``liveness`` says (default: :meth:`Liveness.resolve`).

    The channel does not add the token by itself: pass :func:`call_metadata` with each call.

    Raises:
        SecurityConfigError: a certificate, key or CA file cannot be read.
    """
    if _diverted is not None and (diverted := _diverted(address)) is not None:
        return diverted
    options = channel_options(liveness or Liveness.resolve())
    if not security.tls or address.startswith("unix:"):
        return grpc.insecure_channel(address, options=options)
    root = _read(security.tls_ca_file, "tls_ca_file") if security.tls_ca_file else None
    key = cert = None
    if security.tls_cert_file is not None:
        key, cert = _read(security.tls_key_file, "tls_key_file"), _read(security.tls_cert_file, "tls_cert_file")
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials, options=options)


def server_credentials(security: Security, task_name: str) -> grpc.ServerCredentials | None:
    """The TLS credentials a server of ``task_name`` listens with; None without TLS.

    Raises:
        SecurityConfigError: TLS is on but the task has no certificate, or a file cannot be read.
    """
    if not security.tls:
        return None
    if security.tls_cert_file is None:
        raise SecurityConfigError(
            f"{task_name} cannot serve TLS without a certificate: give it tls_cert_file and tls_key_file "
            f"(--tls_cert_file/--tls_key_file), or no TLS setting at all"
        )
    pair = (_read(security.tls_key_file, "tls_key_file"), _read(security.tls_cert_file, "tls_cert_file"))
    root = _read(security.tls_ca_file, "tls_ca_file") if security.tls_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)


def interceptors(security: Security) -> tuple[grpc.ServerInterceptor, ...]:
    """The server interceptors ``security`` needs: the token check, or none."""
    return () if security.auth_token is None else (TokenInterceptor(security.auth_token),)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only if its metadata carries the token (compared in constant time).

    Any other call, to any method (one the service does not have included),
    gets ``UNAUTHENTICATED`` before its request is read. Refusals are
    logged at most every few seconds, with their count and the last caller's
    address, never with what it sent.
    """

    def __init__(self, token: str) -> None:
        self._expected = (_BEARER + token).encode("ascii")
        self._deny = grpc.stream_stream_rpc_method_handler(self._refuse)
        self._lock = threading.Lock()
        self._refused = 0
        self._last_log = 0.0

    def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        offered = [value for key, value in handler_call_details.invocation_metadata or () if key == TOKEN_METADATA_KEY]
        if (
            len(offered) == 1
            and isinstance(offered[0], str)
            and hmac.compare_digest(offered[0].encode("ascii", "replace"), self._expected)
        ):
            return continuation(handler_call_details)
        return self._deny

    def _refuse(self, requests: Any, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            report = now - self._last_log >= _LOG_EVERY_S
            if report:
                self._last_log, refused = now, self._refused
        if report:
            log.warning("refused %d unauthenticated call(s) so far; the last from %s", refused, context.peer())
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)  # raises

    @property
    def refused(self) -> int:
        """Calls refused so far."""
        return self._refused

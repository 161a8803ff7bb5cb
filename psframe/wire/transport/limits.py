"""What one caller may take of a task's server: message size, calls in flight.

A server's calls run on a fixed pool of threads, and a PushPull stream holds
one for as long as it is open. Without limits, one process that opens enough
streams (or one that sends a message of gigabytes) leaves nothing for the
others. So every server:

- refuses a message larger than ``max_message_bytes``
  (:data:`DEFAULT_MAX_MESSAGE_BYTES`; gRPC answers ``RESOURCE_EXHAUSTED``
  before it buffers the message);
- runs at most ``max_threads`` calls at once and answers any call beyond
  ``RESOURCE_EXHAUSTED`` at once, rather than queueing it behind calls that
  may never end (gRPC's ``maximum_concurrent_rpcs``);
- runs at most ``max_calls_per_peer`` of them for callers on one host
  (:class:`PeerLimiter`; the others' calls keep the remaining threads), and
  lets one connection open no more streams than that (HTTP/2's
  ``max_concurrent_streams``, so the client queues the rest).

The tasks' own calls stay far below these limits: a worker keeps one stream
and a call or two in flight per ps task.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from psframe.config.liveness import Liveness
from psframe.wire.transport.methods import PING_POLICY_OPTIONS, keepalive_options

MiB = 1 << 20
# 64 times the messages psframe sends by default (placement's max_shard_bytes,
# 4 MiB); a Trainer given a larger max_shard_bytes needs ps tasks with a larger cap.
DEFAULT_MAX_MESSAGE_BYTES = 256 * MiB


def default_calls_per_peer(max_threads: int) -> int:
    """The calls one host may have in flight on a server of ``max_threads`` threads:
    three quarters of them (at least one), so that a quarter always serves other hosts."""
    return max(1, max_threads - max(1, max_threads // 4))


def server_options(
    max_message_bytes: int, max_streams_per_connection: int, share_port: bool, liveness: Liveness
) -> tuple[tuple[str, Any], ...]:
    """gRPC server options: the receive cap, streams per connection, whether the port is
    shared (never between two tasks: gRPC would otherwise let them both listen on it),
    and keepalive (a caller that went silent is noticed, and its calls end, within
    ``liveness.detect_within`` seconds: its streams no longer count against its host)."""
    return (
        (
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_concurrent_streams", max_streams_per_connection),
            ("grpc.so_reuseport", int(share_port)),
        )
        + keepalive_options(liveness)
        + PING_POLICY_OPTIONS
    )


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: ``"ipv4:10.0.0.5:41234"`` -> ``"ipv4:10.0.0.5"``;
    every Unix-socket caller is the one host ``"unix"``."""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer.split(":", 1)[0]


class PeerLimiter:
    """Runs at most ``max_calls`` calls at once from one host; answers the next ``RESOURCE_EXHAUSTED``.

    The server's method handlers (:mod:`psframe.wire.transport.server`) count each
    call in as it starts (:meth:`admit`), so that a stream's every request passes
    no wrapper of its own. A call counts from when its handler starts until it
    ends (a stream: until it is closed, cancelled or fails).

    Args:
        max_calls: calls in flight allowed per caller host.
        name: the server, for the refusal's message.
    """

    def __init__(self, max_calls: int, name: str) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.max_calls = max_calls
        self._name = name
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self.refused = 0

    def admit(self, context: grpc.ServicerContext) -> Callable[[], None]:
        """Count the call in, or end it with ``RESOURCE_EXHAUSTED`` (raises); the function that counts it out."""
        host = peer_host(context.peer())
        with self._lock:
            admitted = self._in_flight[host] < self.max_calls
            if admitted:
                self._in_flight[host] += 1
            else:
                self.refused += 1
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._name} runs at most {self.max_calls} calls at once from one host; "
                f"{host} has that many in flight",
            )
        released: list[bool] = []

        def release() -> None:
            with self._lock:
                if not released:  # once, from whichever comes first: the handler's end or the call's
                    released.append(True)
                    self._in_flight[host] -= 1
                    if not self._in_flight[host]:
                        del self._in_flight[host]

        if not context.add_callback(release):
            release()  # the call is over already
        return release

    def in_flight(self) -> dict[str, int]:
        """Calls in flight, by caller host."""
        with self._lock:
            return dict(self._in_flight)

"""The service's methods and options as gRPC sees them.

- :data:`METHODS`: the methods of the ``ParameterServer`` service of
  ``psframe.proto`` (names, message types, streaming), read from its
  descriptor, so nothing else spells out a method path or a serializer.
  Methods whose request carries tensors (a ``header`` + ``payload``
  envelope) travel as the bytes :mod:`psframe.wire.codec` made, untouched;
  the others as their generated message classes.
- the channel options (no 4 MiB message cap, quick reconnects, keepalive
  pings: see :mod:`psframe.config.liveness`).

Errors cross in :mod:`psframe.wire.transport.error_codec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message

from psframe.config.liveness import Liveness
from psframe.wire import psframe_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"]
# A channel has no gRPC message limit of its own (its default is 4 MiB): large
# variables are split into parts that each fit a message (see
# psframe.cluster.placement). Servers cap what they receive
# (psframe.wire.transport.limits).
MESSAGE_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
# Reconnect quickly to a task that comes up late or restarts; gRPC's default
# backoff grows to two minutes. Every channel has a connection of its own
# (gRPC shares one among the channels of a process to the same address):
# a ps task served from several processes spreads connections, not channels.
CHANNEL_OPTIONS = MESSAGE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.use_local_subchannel_pool", 1),
)


def keepalive_options(liveness: Liveness) -> tuple[tuple[str, Any], ...]:
    """The options that make a channel or a server probe its connections (see
    :mod:`psframe.config.liveness`). gRPC sets ``TCP_USER_TIMEOUT`` to the keepalive
    timeout whenever keepalive is on, so unacknowledged data is bounded too."""
    return (
        ("grpc.keepalive_time_ms", round(liveness.keepalive_time * 1000)),
        ("grpc.keepalive_timeout_ms", round(liveness.keepalive_timeout * 1000)),
        # Ping while no call is open, and without data in between (a worker
        # waiting at a barrier sends nothing for as long as the round takes).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


# What a server accepts of its callers' pings: any number, at any interval,
# so a caller with shorter settings than this task's is never sent away
# (gRPC's default answers a ping more often than every 5 minutes with GOAWAY).
PING_POLICY_OPTIONS = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 0),
    ("grpc.http2.max_ping_strikes", 0),
)


def channel_options(liveness: Liveness) -> tuple[tuple[str, Any], ...]:
    """Every option of a channel to a task: :data:`CHANNEL_OPTIONS` and keepalive."""
    return CHANNEL_OPTIONS + keepalive_options(liveness)


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
            return {
                "request_deserializer": self.request_type.FromString,
                "response_serializer": self.reply_type.SerializeToString,
            }
        return {
            "request_serializer": self.request_type.SerializeToString,
            "response_deserializer": self.reply_type.FromString,
        }


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

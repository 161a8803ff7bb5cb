"""How soon a task notices that a peer is gone: keepalive pings and TCP's user timeout.

On a real network a peer is lost for seconds far more often than it
crashes: a switch reboots, a link flaps, a host is partitioned. Without a
probe, a connection whose far end went silent looks exactly like a slow
one: a worker that sent its request (acknowledged by the peer's kernel) and
waits for the reply has nothing to retransmit, and waits until its call's
deadline, minutes later. So every channel and every server psframe makes
(:mod:`psframe.wire.transport`) sends HTTP/2 keepalive pings on its
connections, with or without calls in flight:

- a ping goes out after ``keepalive_time`` seconds without traffic;
- a ping not acknowledged within ``keepalive_timeout`` seconds closes the
  connection, and so does data sent but not acknowledged for as long
  (gRPC sets the socket's ``TCP_USER_TIMEOUT`` to the same value);
- servers accept pings as often as clients send them, so two tasks
  configured differently never refuse each other.

A dead peer is thus noticed within ``keepalive_time + keepalive_timeout``
seconds (10 s by default), its calls fail with
:class:`~psframe.errors.TaskUnavailableError`, and the layers above
reconnect. A link that comes back within ``keepalive_timeout`` keeps its
connections. The settings come from arguments (``Server``/``Trainer(liveness=...)``),
the ``--keepalive_time``/``--keepalive_timeout`` flags, or the environment
(``PSFRAME_KEEPALIVE_TIME``, ``PSFRAME_KEEPALIVE_TIMEOUT``, in seconds).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

KEEPALIVE_TIME_ENV = "PSFRAME_KEEPALIVE_TIME"
KEEPALIVE_TIMEOUT_ENV = "PSFRAME_KEEPALIVE_TIMEOUT"
# Below this, pings and the TCP timeout would fire on an ordinary busy link.
MIN_SECONDS = 0.5
# gRPC takes milliseconds as a C int.
MAX_SECONDS = (2**31 - 1) / 1000


@dataclass(frozen=True)
class Liveness:
    """How a task probes its connections; ``Liveness()`` is the default (5 s + 5 s).

    Args:
        keepalive_time: seconds without traffic on a connection before a ping is sent.
        keepalive_timeout: seconds a ping (or any data sent) may go
            unacknowledged before the connection is closed as dead.

    Raises:
        ValueError: a setting is not a number of seconds from 0.5 to ~24 days.

    Example::

        trainer = psframe.Trainer(model, cluster, liveness=Liveness(keepalive_time=2, keepalive_timeout=3))
    """

    keepalive_time: float = 5.0
    keepalive_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("keepalive_time", "keepalive_timeout"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not MIN_SECONDS <= value <= MAX_SECONDS
            ):
                raise ValueError(
                    f"{name} must be a number of seconds from {MIN_SECONDS} to {MAX_SECONDS:.0f}, got {value!r}"
                )

    @property
    def detect_within(self) -> float:
        """The longest a dead peer goes unnoticed, in seconds."""
        return self.keepalive_time + self.keepalive_timeout

    @classmethod
    def resolve(cls, keepalive_time: float | None = None, keepalive_timeout: float | None = None) -> Liveness:
        """The settings given, the environment's for those not given, else the defaults.

        Raises:
            ValueError: a setting (or an environment variable) is not a valid number of seconds.
        """
        defaults = cls()
        return cls(
            keepalive_time=_pick(keepalive_time, KEEPALIVE_TIME_ENV, defaults.keepalive_time),
            keepalive_timeout=_pick(keepalive_timeout, KEEPALIVE_TIMEOUT_ENV, defaults.keepalive_timeout),
        )


def _pick(value: float | None, env: str, default: float) -> float:
    if value is not None:
        return value
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {text!r}") from None

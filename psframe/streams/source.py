"""What psframe reads a stream through: :class:`StreamSource`, and the :class:`StreamRecord` it gives.

A stream is cut into ``partitions``; each partition is an ordered sequence of
records, each at an offset (an int that grows along the partition; gaps are
allowed). A source reads a partition from an offset on, and nothing else:
which worker reads which partition, and where each partition stands, is kept
by the ps tasks with the model (:meth:`psframe.Trainer.stream`), never by the
broker, so that an offset is committed exactly when the update that trained on
its record is, and a restored checkpoint rolls the offsets back with the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class StreamRecord:
    """One record of a stream: its partition, its offset there, its bytes, and when the broker took it.

    Attributes:
        partition: the partition it is in.
        offset: where it is in the partition; the next record to read after it is at ``offset + 1`` or later.
        value: its payload, as published.
        timestamp: seconds since the epoch at which the broker stored it (None if the broker keeps no time).
    """

    partition: int
    offset: int
    value: bytes
    timestamp: float | None = None


@runtime_checkable
class StreamSource(Protocol):
    """A partitioned stream whose records are read by offset (:class:`psframe.streams.JetStream` is one).

    Attributes:
        name: the stream's name in the job: its offsets are committed under it (every worker's
            source of one stream gives the same name).
        partitions: how many partitions it has (the same on every worker).
    """

    name: str
    partitions: int

    def read(self, partition: int, offset: int, max_records: int, timeout: float) -> Sequence[StreamRecord]:
        """Up to ``max_records`` records of ``partition`` from ``offset`` on, in order (offsets
        ``>= offset``, growing), waiting at most ``timeout`` seconds for the first; none by then: empty.

        Offset 0 means the partition's first record held by the broker.
        """
        ...

    def close(self) -> None:
        """Let go of the connection (reading after this is an error)."""
        ...

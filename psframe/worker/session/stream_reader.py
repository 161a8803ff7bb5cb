"""A worker's side of a stream read by partition (:meth:`psframe.Trainer.stream`).

The worker asks ps 0 for its partitions (:mod:`psframe.ps.protocol.stream_partitions`),
and every ps task how far its updates of each reached; it reads records of
each partition (:class:`~psframe.streams.StreamSource`) from the lowest of those
offsets, and gives out batches of one partition's records in order, taking its
partitions in turn, each batch ending where some task's updates stop, if one
does within it. Each batch goes out through :meth:`RangeFeed.out
<psframe.worker.session.data_reader.RangeFeed.out>`: every push of its step
says where the batch is and where the worker last knew that task to be, and
each task applies it once. A batch whose step was not applied comes again; a
push refused (the partition went to another worker while this one was
presumed dead, or a ps task restored a checkpoint) drops every partition with
what was read ahead of it, and the worker asks again.

Every ``rebalance_seconds`` the worker asks again: it gets free partitions up
to its share, and gives back between two batches those it is told to (a
worker joined). When the iteration ends, it gives all of them back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from psframe.errors import PsframeError, StreamError
from psframe.streams.source import StreamRecord, StreamSource
from psframe.worker.client import control_calls
from psframe.worker.client.control_calls import StreamLease
from psframe.worker.client.operations import StreamProgress
from psframe.worker.session.data_reader import Outcome, RangeFeed
from psframe.worker.session.session import Session

log = logging.getLogger(__name__)

SCAN_TIMEOUT_S = 0.05  # how long a read waits for a partition's next records while others are looked at
WAIT_FOR_PARTITIONS_S = 0.2  # how long a worker with no partition waits before it asks again


@dataclass
class _Partition:
    """One partition this worker holds: where it trains from, how far each ps task's updates of
    it reached (as last known), and the records read ahead."""

    lease: int
    partition: int
    offset: int  # the next record to train on: every ps task's updates reached it (or past it)
    reached: dict[int, int]  # ps task: the offset its updates of the partition reached
    ahead: list[StreamRecord] = field(default_factory=list)  # read from `offset` on, not yet trained

    def next_offset(self) -> int:
        return self.ahead[-1].offset + 1 if self.ahead else self.offset

    def batch(self, size: int) -> list[StreamRecord]:
        """The next batch: up to ``size`` records, none past an offset some ps task reached (a
        batch is applied by a ps task whole, or not at all)."""
        while True:
            past = [reached for reached in self.reached.values() if reached > self.offset]
            limit = min(past) if past else None
            records = self.ahead[:size]
            if limit is None:
                return records
            records = [record for record in records if record.offset < limit]
            if records or not self.ahead:
                return records
            self.offset = limit  # no record lies before it: nothing to train there

    def progress(self, name: str, partitions: int, stop: int) -> dict[int, StreamProgress]:
        """What the step on the batch ending at ``stop`` tells each ps task (the leases are ps 0's)."""
        return {
            task: StreamProgress(
                name, self.lease if task == 0 else 0, self.partition, partitions, self.offset, stop, seen
            )
            for task, seen in self.reached.items()
        }

    def applied(self, stop: int, carried: set[int], trained: int) -> None:
        """The step on the batch ending at ``stop`` (its first ``trained`` records) was applied by
        the ps tasks ``carried`` (or was there already)."""
        self.offset = stop
        del self.ahead[:trained]
        for task in carried:
            self.reached[task] = max(self.reached.get(task, 0), stop)


def stream_batches(
    feed: RangeFeed,
    session: Session,
    source: StreamSource,
    batch_size: int,
    *,
    idle_timeout: float | None = None,
    rebalance_seconds: float = 2.0,
    read_ahead: int | None = None,
    broker_timeout: float = 60.0,
) -> Iterator[list[StreamRecord]]:
    """The batches of ``source`` for this worker (``Trainer.stream``; see :class:`StreamReader`).

    Raises:
        PsframeError: training is synchronous, or /job:ps/task:0 holds no dense variable.
    """
    if session.sync is not None:
        raise PsframeError(
            "stream() is for asynchronous training: a synchronous round would wait for a worker whose "
            "partitions have no record yet (read a data set in ranges with read(), or train asynchronously)"
        )
    feed.check_queue_task("stream()")

    def ask(name: str, partitions: int, given_back: Sequence[int], leaving: bool) -> list[StreamLease]:
        return session.call(
            lambda at: control_calls.stream_partitions(at.client, 0, name, partitions, given_back, leaving), lost=False
        )

    def offsets(name: str) -> list[dict[int, int]]:
        return session.call(lambda at: control_calls.stream_offsets(at.client, name), lost=False)

    reader = StreamReader(
        feed,
        ask,
        offsets,
        source,
        batch_size,
        idle_timeout=idle_timeout,
        rebalance_seconds=rebalance_seconds,
        read_ahead=read_ahead if read_ahead is not None else 4 * batch_size,
        broker_timeout=broker_timeout,
    )
    return reader.batches()


class StreamReader:
    """One worker's batches of a stream.

    Args:
        feed: gives each batch out for one step, and learns what became of it.
        ask: asks ps 0 for this worker's partitions (``control_calls.stream_partitions``'s
            arguments after the client: name, partitions, given back, leaving).
        offsets: asks every ps task how far its updates of each partition of a stream reached
            (``control_calls.stream_offsets``).
        source: the stream.
        batch_size: records a batch at most (fewer when fewer have come).
        idle_timeout: end the iteration once no record came for this long (None: never).
        rebalance_seconds: how often the worker asks for its partitions again.
        read_ahead: records read from the broker at once, per partition.
        broker_timeout: how long reads may fail (the broker away) before the error is raised.
    """

    def __init__(
        self,
        feed: RangeFeed,
        ask: Callable[..., list[StreamLease]],
        offsets: Callable[[str], list[dict[int, int]]],
        source: StreamSource,
        batch_size: int,
        *,
        idle_timeout: float | None,
        rebalance_seconds: float,
        read_ahead: int,
        broker_timeout: float = 60.0,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("read_ahead", read_ahead)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, seconds in (
            ("idle_timeout", idle_timeout),
            ("rebalance_seconds", rebalance_seconds),
            ("broker_timeout", broker_timeout),
        ):
            if seconds is not None and not 0 < seconds < 1e9:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
        if not isinstance(source, StreamSource):
            raise TypeError(f"source must be a psframe.streams.StreamSource, got {type(source).__name__}")
        self._feed, self._ask, self._offsets, self._source = feed, ask, offsets, source
        self._batch_size, self._idle_timeout, self._rebalance = batch_size, idle_timeout, rebalance_seconds
        self._read_ahead = max(read_ahead, batch_size)
        self._held: dict[int, _Partition] = {}  # by lease id
        self._turn = 0
        self._broker_timeout = broker_timeout
        self._failing_since: float | None = None  # reads have failed since then

    def batches(self) -> Iterator[list[StreamRecord]]:
        """Batches of records until none came for ``idle_timeout`` seconds; then the partitions go back."""
        source = self._source
        next_ask, idle_since = 0.0, time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if not self._held or now >= next_ask:
                    self._ask_partitions()
                    next_ask = now + self._rebalance
                picked = self._next_batch()
                if picked is None:
                    if self._idle_timeout is not None and time.monotonic() - idle_since >= self._idle_timeout:
                        return
                    if not self._held:
                        time.sleep(WAIT_FOR_PARTITIONS_S)
                    continue
                idle_since = time.monotonic()
                part, records = picked
                stop = records[-1].offset + 1
                progress = part.progress(source.name, source.partitions, stop)
                outcome = yield from self._feed.out(source.name, part.lease, stop, records, progress)
                if outcome is Outcome.APPLIED:
                    part.applied(stop, self._feed.carried, len(records))
                elif outcome is Outcome.LOST:
                    self._held = {}  # the ps tasks say where each partition is: ask again now
                    next_ask = 0.0
        finally:
            self._leave()

    # ---- inside

    def _ask_partitions(self) -> None:
        """Take this worker's partitions from ps 0, giving back those it is told to (between batches)."""
        source = self._source
        leases = self._ask(source.name, source.partitions, (), False)
        give_back = [lease.lease for lease in leases if lease.give_back]
        if give_back:
            log.info("stream %r: giving back partitions %s", source.name, [x.partition for x in leases if x.give_back])
            leases = self._ask(source.name, source.partitions, give_back, False)
        held, self._held = self._held, {}
        kept = [lease for lease in leases if not lease.give_back]
        new = [lease for lease in kept if lease.lease not in held]
        reached = self._offsets(source.name) if new else []  # each ps task's offsets of each partition
        for lease in kept:
            part = held.get(lease.lease)
            if part is None:  # read from where the ps task that is furthest behind is
                at = {task: offsets.get(lease.partition, 0) for task, offsets in enumerate(reached)}
                part = _Partition(lease.lease, lease.partition, min(at.values(), default=0), at)
            self._held[lease.lease] = part

    def _next_batch(self) -> tuple[_Partition, list[StreamRecord]] | None:
        """The next partition in turn with records, and its batch (its first records read ahead)."""
        parts = sorted(self._held.values(), key=lambda part: part.partition)
        for i in range(len(parts)):
            part = parts[(self._turn + i) % len(parts)]
            if len(part.ahead) < self._batch_size:
                part.ahead += self._read(part)
            records = part.batch(self._batch_size)
            if records:
                self._turn = (self._turn + i + 1) % len(parts)
                return part, records
        return None

    def _read(self, part: _Partition) -> Sequence[StreamRecord]:
        start = part.next_offset()
        try:
            records = self._source.read(part.partition, start, self._read_ahead - len(part.ahead), SCAN_TIMEOUT_S)
        except StreamError as e:  # the broker is away (restarting?): no record, until broker_timeout
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                log.warning("stream %r: %s; reading again for up to %gs", self._source.name, e, self._broker_timeout)
            if now - self._failing_since > self._broker_timeout:
                raise
            time.sleep(SCAN_TIMEOUT_S)
            return ()
        if self._failing_since is not None:
            log.info("stream %r: the broker answers again", self._source.name)
            self._failing_since = None
        last = start - 1
        for record in records:
            if record.partition != part.partition or record.offset <= last:
                raise PsframeError(
                    f"stream {self._source.name!r}: a read of partition {part.partition} from offset {start} gave "
                    f"partition {record.partition}'s offset {record.offset} after {last}: offsets must grow"
                )
            last = record.offset
        return records

    def _leave(self) -> None:
        """Give every partition back (the iteration is over), if ps 0 can be told."""
        self._held.clear()
        try:
            self._ask(self._source.name, self._source.partitions, (), True)
        except Exception as e:  # noqa: BLE001 (the trainer may be closed: the partitions go back once it is gone)
            if log is not None:  # None: the interpreter is exiting, and collected the generator late
                log.warning("stream %r: could not give its partitions back (%s)", self._source.name, e)

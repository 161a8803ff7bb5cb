"""A stream on NATS JetStream: :class:`JetStream`, read by partition and offset, and written to.

One JetStream stream holds a psframe stream: partition ``p`` is the subject
``<subject>.<p>``, and a record's offset is its sequence number in the
JetStream stream (so the offsets of one partition grow, with gaps where
other partitions' records sit). Reading uses a pull consumer per partition
that acknowledges nothing and is kept by no name: the broker keeps no
position for psframe, whose ps tasks commit the offsets with the model
(:mod:`psframe.streams.source`). The broker must keep the records until they
are trained and checkpointed: a stream's retention (``max_age``, ``max_msgs``)
that drops records a restored checkpoint has not trained on loses them.

The client is ``nats-py`` (the ``stream`` extra), which is asyncio: the
source runs its own event loop in a thread, so that training code calls it
as plain functions, each with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from psframe.errors import StreamError
from psframe.streams.source import StreamRecord

T = TypeVar("T")
log = logging.getLogger(__name__)

CONSUMER_IDLE_S = 60.0  # the broker drops a reader's consumer after this long unused
CONSUMER_CHECK_S = 1.0  # how often a reader that finds nothing asks whether its consumer is still there
CLOSE_DEADLINE_S = 2.0  # how long a close waits for the client to say goodbye, before it stops regardless


class JetStream:
    """A partitioned stream on a NATS JetStream server: a :class:`~psframe.streams.StreamSource`
    for :meth:`psframe.Trainer.stream`, and a producer's :meth:`publish`.

    Args:
        servers: the NATS server's URL (``nats://host:4222``), or several.
        stream: the JetStream stream's name (letters, digits, ``-`` and ``_``).
        partitions: how many partitions it has.
        subject: the subjects' prefix (partition ``p`` is ``<subject>.<p>``); default: ``stream``.
        timeout: the deadline of connecting, and of each call to the broker.

    Raises:
        ValueError: a name or count out of range.
        StreamError: the server could not be reached within ``timeout``.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        stream: str,
        partitions: int,
        *,
        subject: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        if not stream or not all(c.isalnum() or c in "-_" for c in stream):
            raise ValueError(f"stream must be a non-empty name of letters, digits, '-' and '_', got {stream!r}")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= 1 << 16:
            raise ValueError(f"partitions must be an int in 1..65536, got {partitions!r}")
        if not 0 < timeout < 1e6:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        import nats  # the `stream` extra: imported only by a job that reads or writes a stream

        self.name, self.partitions, self.subject = stream, partitions, subject or stream
        self._timeout = timeout
        self._nats = nats
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"psframe-jetstream-{stream}", daemon=True)
        self._thread.start()
        # partition: its pull subscription, the offset it reads next, its consumer's name
        self._readers: dict[int, tuple[Any, int, str]] = {}
        self._checked: dict[int, float] = {}  # partition: when its consumer was last found on the broker
        self._id, self._consumers = secrets.token_hex(6), 0  # the consumers' names: psframe-<id>-<partition>-<n>
        servers = [servers] if isinstance(servers, str) else list(servers)
        try:
            self._connection = self._call(
                nats.connect(servers, connect_timeout=timeout, allow_reconnect=True, error_cb=self._connection_error)
            )
        except BaseException:
            self._stop_loop()
            raise
        self._js = self._connection.jetstream(timeout=timeout)

    def subject_of(self, partition: int) -> str:
        """The subject of ``partition``."""
        return f"{self.subject}.{partition}"

    def create(self, *, max_age: float | None = None, storage: str = "file") -> None:
        """Make the JetStream stream, if it is not there (its subjects ``<subject>.*``).

        Args:
            max_age: seconds a record is kept (None: until the stream's limits drop it; never, by default).
            storage: ``"file"`` (survives a broker restart) or ``"memory"``.
        """
        from nats.js.api import StorageType, StreamConfig

        config = StreamConfig(
            name=self.name,
            subjects=[f"{self.subject}.*"],
            storage=StorageType.FILE if storage == "file" else StorageType.MEMORY,
            max_age=max_age,
        )
        self._call(self._js.add_stream(config))

    def publish(self, partition: int, value: bytes, *, msg_id: str | None = None) -> int:
        """Write ``value`` to ``partition`` once the broker has stored it; its offset.

        Args:
            msg_id: the record's id: the broker stores a record once for each id within its
                duplicate window (two minutes by default), so a publish tried again after an
                error whose first try was stored is stored once (and answers the first's offset).
        """
        self._check_partition(partition)
        headers = {"Nats-Msg-Id": msg_id} if msg_id is not None else None
        ack = self._call(self._js.publish(self.subject_of(partition), value, timeout=self._timeout, headers=headers))
        return int(ack.seq)

    def read(self, partition: int, offset: int, max_records: int, timeout: float) -> list[StreamRecord]:
        """Up to ``max_records`` records of ``partition`` from ``offset`` on (see
        :meth:`~psframe.streams.StreamSource.read`)."""
        self._check_partition(partition)
        if max_records < 1 or offset < 0:
            raise ValueError(f"read needs max_records >= 1 and offset >= 0, got {max_records} and {offset}")
        return self._call(self._read(partition, offset, max_records, timeout), timeout + self._timeout)

    def close(self) -> None:
        """Close the connection and stop the client's thread."""
        if self._loop.is_closed():
            return
        for goodbye in (self._drop_readers(), self._connection.close()):
            try:
                self._call(goodbye, CLOSE_DEADLINE_S)
            except Exception:  # noqa: BLE001 (closing regardless: the broker may be gone already)
                pass
        self._stop_loop()

    def __enter__(self) -> JetStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inside: the event loop's side

    async def _connection_error(self, error: Exception) -> None:
        """The client's errors between calls (the broker away: it reconnects by itself); a call
        that fails says so to its caller."""
        log.debug("stream %r: %s: %s", self.name, type(error).__name__, error)

    async def _read(self, partition: int, offset: int, max_records: int, timeout: float) -> list[StreamRecord]:
        reader, next_offset, consumer = self._readers.get(partition, (None, -1, ""))
        if reader is not None and next_offset != offset:
            await self._drop_reader(partition)
            reader = None
        if reader is None:
            reader, consumer = await self._reader(partition, offset)
            self._readers[partition] = (reader, offset, consumer)
        try:
            messages = await reader.fetch(max_records, timeout=max(timeout, 0.001))
        except TimeoutError:  # nothing came in time (nats' timeout is one too)
            messages = []
            if not await self._consumer_alive(partition, consumer):
                return []  # the next read makes the partition's consumer anew
        except self._nats.errors.Error:  # its consumer is gone (a broker restarted: no responders)
            await self._forget_reader(partition)
            raise
        records = [
            StreamRecord(partition, int(m.metadata.sequence.stream), m.data, m.metadata.timestamp.timestamp())
            for m in messages
            if m.metadata.sequence.stream >= offset
        ]
        self._readers[partition] = (reader, records[-1].offset + 1 if records else offset, consumer)
        return records

    async def _reader(self, partition: int, offset: int) -> tuple[Any, str]:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        self._consumers += 1
        name = f"psframe-{self._id}-{partition}-{self._consumers}"
        config = ConsumerConfig(
            filter_subject=self.subject_of(partition),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=CONSUMER_IDLE_S,
            mem_storage=True,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if offset > 0 else DeliverPolicy.ALL,
            opt_start_seq=offset if offset > 0 else None,
        )
        # Named (nats-py names a consumer it makes unnamed), so that it can be looked up and deleted;
        # the broker deletes it by itself once unused for CONSUMER_IDLE_S (a reader that died).
        return await self._js.pull_subscribe(
            self.subject_of(partition), durable=name, stream=self.name, config=config
        ), name

    async def _consumer_alive(self, partition: int, consumer: str) -> bool:
        """Whether ``partition``'s consumer is still on the broker (a broker restarted loses the
        consumers kept in its memory, and a fetch from one that is gone only times out); looked
        at once a second at most, while reads find nothing. A lost one is dropped here."""
        now = time.monotonic()
        if now < self._checked.get(partition, 0.0) + CONSUMER_CHECK_S:
            return True
        self._checked[partition] = now
        try:
            await self._js.consumer_info(self.name, consumer)
            return True
        except self._nats.js.errors.NotFoundError:
            await self._forget_reader(partition)
            return False

    async def _forget_reader(self, partition: int) -> None:
        """Drop ``partition``'s reader whose consumer is gone: the next read makes one anew."""
        reader, _, _ = self._readers.pop(partition, (None, 0, ""))
        try:
            if reader is not None:
                await reader.unsubscribe()
        except self._nats.errors.Error:  # its subscription went with the old connection
            pass

    async def _drop_reader(self, partition: int) -> None:
        """Stop reading ``partition`` and delete its consumer on the broker (an unused one would
        count against the stream's consumers until the broker drops it)."""
        reader, _, consumer = self._readers.pop(partition)
        await reader.unsubscribe()
        try:
            await self._js.delete_consumer(self.name, consumer)
        except self._nats.js.errors.NotFoundError:  # the unsubscribe deleted it
            pass

    async def _drop_readers(self) -> None:
        for partition in list(self._readers):
            await self._drop_reader(partition)

    # ---- inside: the caller's side

    def _call(self, work: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self._loop.is_closed():
            work.close()
            raise StreamError(f"stream {self.name!r} is closed")
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        deadline = self._timeout if timeout is None else timeout
        try:
            return future.result(deadline)
        except TimeoutError as e:
            if future.done():  # the call itself timed out (a nats timeout)
                raise StreamError(f"stream {self.name!r}: {type(e).__name__}: {e}") from e
            future.cancel()
            raise StreamError(f"stream {self.name!r}: the broker did not answer within {deadline:g}s") from e
        except self._nats.errors.Error as e:
            raise StreamError(f"stream {self.name!r}: {type(e).__name__}: {e}") from e
        except OSError as e:
            raise StreamError(f"stream {self.name!r}: cannot reach the broker: {e}") from e

    def _check_partition(self, partition: int) -> None:
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < self.partitions:
            raise ValueError(f"stream {self.name!r} has partitions 0..{self.partitions - 1}, not {partition!r}")

    def _stop_loop(self) -> None:
        async def cancel_the_rest() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self._loop).result(CLOSE_DEADLINE_S)
        except Exception:  # noqa: BLE001 (stopping regardless)
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self._timeout)
        if not self._thread.is_alive():
            self._loop.close()

"""Partitions of streams handed to workers so that each record is trained once. No network.

A stream (a JetStream stream, a Kafka topic) is cut into partitions, each an
ordered sequence of records addressed by offsets that only grow. ps 0 keeps a
:class:`StreamPartitions`: each partition is out with one worker at a time
(a *lease*), with the offset it is consumed up to, the next record to train
on. A worker trains on a batch of one partition's records in order, and the
step's push to this task says where the batch ends
(:class:`~psframe.ps.protocol.data_ranges.Progress`, as for data read in
ranges): the queue records that under the store's lock with the push's
gradients, so an offset is committed exactly when the update that trained on
its records is applied. The offsets go into this task's checkpoint shard, so
a restore rolls them back with the variables: the records the restored model
did not train on are read again, and none is trained twice.

Partitions are shared out evenly among the workers that read the stream:
a worker asking again (:meth:`StreamPartitions.assign`, every few
seconds) gets free partitions up to its share, and is told which of its own
to give back when it holds more than its share (a worker joined). It gives
them back between two batches, so no push in flight loses its partition. A
worker that is gone (finished, or presumed dead: see
:mod:`psframe.ps.protocol.roster`) loses its partitions to the others from
the offsets its applied pushes reached; if it comes back and pushes on one,
the push is refused (:class:`~psframe.errors.DataRangeLostError`) and
nothing of it is applied.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psframe.errors import CheckpointError, DataRangeLostError, WireFormatError

if TYPE_CHECKING:  # the data ranges' queue holds this one, and hands it their progress
    from psframe.ps.protocol.data_ranges import Progress

STATE_PREFIX = "stream:"  # a stream's key in a checkpoint's record of pushes
MAX_PARTITIONS = 1 << 16


@dataclass
class PartitionLease:
    """A partition out with a worker (or free, ``worker`` None), committed up to ``offset``."""

    lease_id: int
    partition: int
    offset: int  # the next record to train on
    worker: int | None


@dataclass(frozen=True)
class Assignment:
    """A worker's partitions of a stream: its leases, lowest partition first, and the ids of
    those it should give back (beyond its share)."""

    leases: tuple[PartitionLease, ...]
    give_back: tuple[int, ...]


@dataclass
class _Stream:
    partitions: int
    leases: dict[int, PartitionLease] = field(default_factory=dict)  # by lease id; one per partition
    members: set[int] = field(default_factory=set)  # the workers reading it (they asked, and did not leave)


class StreamPartitions:
    """The streams a ps task shares out by partition.

    Args:
        gone: whether a worker has left or is presumed dead (its partitions go to the others).
        lock: guards the leases; the store's, so that offsets are committed with the push they ride on.
    """

    def __init__(self, gone: Callable[[int], bool], lock: Any | None = None) -> None:
        self._gone = gone
        self._lock = lock if lock is not None else threading.RLock()
        self._streams: dict[str, _Stream] = {}
        # Lease ids drawn afresh by each process, so that a lease of before a restart (a push
        # in flight as the ps task was lost) names none of after it.
        self._next_lease = secrets.randbits(62) | 1 << 62

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a stream of this queue (hold the lock, or read once)."""
        return name in self._streams

    def assign(
        self, worker: int, name: str, partitions: int, given_back: Sequence[int] = (), *, leaving: bool = False
    ) -> Assignment:
        """``worker``'s partitions of stream ``name``: those it holds (less ``given_back``), and free
        ones up to its share; those beyond its share are named to give back. ``leaving``: it reads
        the stream no more, and gives all of its partitions back.

        The shares are even: with ``P`` partitions among ``W`` readers, the ``P % W`` readers of
        the lowest task indices take one more than the others.

        Raises:
            WireFormatError: ``partitions`` is out of range, or other workers declared the stream
                with another number of partitions.
        """
        with self._lock:
            stream = self._stream(name, partitions)
            for lease in stream.leases.values():
                if lease.worker is not None and self._gone(lease.worker):
                    lease.worker = None
                elif lease.worker == worker and (leaving or lease.lease_id in given_back):
                    lease.worker = None
            stream.members = {member for member in stream.members if not self._gone(member)}
            if leaving:
                stream.members.discard(worker)
                return Assignment((), ())
            stream.members.add(worker)
            readers = sorted(stream.members)
            share, more = divmod(stream.partitions, len(readers))
            share += readers.index(worker) < more
            by_partition = sorted(stream.leases.values(), key=lambda lease: lease.partition)
            own = [lease for lease in by_partition if lease.worker == worker]
            for lease in by_partition:
                if len(own) >= share:
                    break
                if lease.worker is None:
                    lease.worker = worker
                    own.append(lease)
            own.sort(key=lambda lease: lease.partition)
            extra = own[share:]
            return Assignment(tuple(own), tuple(lease.lease_id for lease in extra))

    def check(self, worker: int, progress: Progress) -> None:
        """Raise unless ``progress`` may be recorded (hold the lock; before the push is applied).

        Raises:
            DataRangeLostError: the partition is not this worker's (it went to another while this
                one was presumed dead, or the ps task restored a checkpoint), or the offset goes back.
        """
        lease = self._lease(progress)
        if lease is None or lease.worker != worker:
            raise DataRangeLostError(
                f"lease {progress.lease_id} of stream {progress.name!r} is no longer worker {worker}'s (it was "
                f"presumed dead and the partition went to another worker, or the ps task restored a checkpoint): "
                f"nothing of this push was applied; ask for partitions again"
            )
        if progress.offset < lease.offset:
            raise DataRangeLostError(
                f"worker {worker} says it consumed partition {lease.partition} of stream {progress.name!r} up to "
                f"offset {progress.offset}, but it was committed up to {lease.offset} already"
            )

    def record(self, worker: int, progress: Progress) -> bool:
        """Commit a push's offset (hold the lock, with the push applied, :meth:`check` passed when
        it came); False, and nothing recorded, if it no longer fits its lease."""
        lease = self._lease(progress)
        if lease is None or lease.worker != worker or progress.offset < lease.offset:
            return False
        lease.offset = progress.offset
        return True

    def offsets(self) -> dict[str, list[int]]:
        """Each stream's committed offset of each partition."""
        with self._lock:
            return {name: _offsets(stream) for name, stream in self._streams.items()}

    # ---- checkpoints

    def state_dict(self) -> dict[str, list[int]]:
        """What a checkpoint keeps: for each stream, under ``"stream:<name>"``, ``[partitions]``
        and then each partition's committed offset."""
        with self._lock:
            return {
                f"{STATE_PREFIX}{name}": [stream.partitions, *_offsets(stream)]
                for name, stream in self._streams.items()
            }

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        """Take a checkpoint's offsets (its ``"stream:"`` keys): every partition goes back to the
        queue at them, and the leases of before are void.

        Raises:
            CheckpointError: a stream's record is malformed.
        """
        with self._lock:
            self._streams = {}
            for key, values in state.items():
                if not key.startswith(STATE_PREFIX):
                    continue
                name = key[len(STATE_PREFIX) :]
                if not values or not 1 <= int(values[0]) <= MAX_PARTITIONS or len(values) != 1 + int(values[0]):
                    raise CheckpointError(f"the record of stream {name!r} is malformed: {list(values)!r}")
                stream = self._new_stream(int(values[0]))
                for lease, offset in zip(sorted(stream.leases.values(), key=lambda x: x.partition), values[1:]):
                    lease.offset = int(offset)
                self._streams[name] = stream

    # ---- inside

    def _stream(self, name: str, partitions: int) -> _Stream:
        if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= MAX_PARTITIONS:
            raise WireFormatError(f"stream {name!r}: partitions must be 1..{MAX_PARTITIONS}, got {partitions!r}")
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = self._new_stream(partitions)
        elif stream.partitions != partitions:
            raise WireFormatError(
                f"stream {name!r} has {stream.partitions} partitions here; this worker reads it with {partitions} "
                f"(every worker must read it with the same number)"
            )
        return stream

    def _new_stream(self, partitions: int) -> _Stream:
        stream = _Stream(partitions)
        for partition in range(partitions):
            lease = PartitionLease(self._next_lease, partition, 0, None)
            self._next_lease += 1
            stream.leases[lease.lease_id] = lease
        return stream

    def _lease(self, progress: Progress) -> PartitionLease | None:
        stream = self._streams.get(progress.name)
        return None if stream is None else stream.leases.get(progress.lease_id)


def _offsets(stream: _Stream) -> list[int]:
    return [lease.offset for lease in sorted(stream.leases.values(), key=lambda lease: lease.partition)]

"""Partitions of streams handed to workers so that each record is trained once. No network.

A stream (a JetStream stream, a Kafka topic) is cut into partitions, each an
ordered sequence of records addressed by offsets that only grow. ps 0 shares
the partitions out: each is out with one worker at a time (a *lease*).
Partitions are shared out evenly among the workers that read the stream: a
worker asking again (:meth:`StreamPartitions.assign`, every few seconds) gets
free partitions up to its share, and is told which of its own to give back
when it holds more than its share (a worker joined); it gives them back
between two batches, so no push in flight loses its partition. A worker that
is gone (finished, or presumed dead: see :mod:`psframe.ps.protocol.roster`)
loses its partitions to the others; if it comes back and pushes on one, ps 0
refuses the push (:class:`~psframe.errors.DataRangeLostError`).

Every ps task, ps 0 or not, keeps how far its own updates of each partition
reached, in its checkpoint shard too, so that a restore rolls it back with
the task's values. A worker trains on a batch of one partition's records in
order, and each of the step's pushes to every ps task says where the batch
starts and ends and where the worker last knew that task to be
(:class:`~psframe.ps.protocol.data_ranges.Progress`): the task applies it once
it is there (and records the end with the step's last push, under the store's
lock, with the update), answers it as applied if it is past the batch's end,
and refuses it otherwise (:meth:`StreamPartitions.check`). A worker refused
asks every ps task where it is, and reads again from the lowest offset, its
batches cut where any task's updates stop. So each record's update reaches
each ps task once: whichever of a step's pushes a killed worker had sent,
whichever ps task restored a checkpoint while the others went on.
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

STATE_PREFIX = "stream:"  # a stream whose leases are kept here (ps 0), in a checkpoint's record of pushes
APPLIED_PREFIX = "stream-applied:"  # how far a ps task's updates of a stream's partitions reached
MAX_PARTITIONS = 1 << 16


@dataclass
class PartitionLease:
    """A partition out with a worker (or free, ``worker`` None)."""

    lease_id: int
    partition: int
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
        self._streams: dict[str, _Stream] = {}  # the leases: kept on ps 0
        self._applied: dict[str, dict[int, int]] = {}  # stream: partition: offset this task's updates reached
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

    def check(self, worker: int, progress: Progress) -> bool:
        """Whether a push's batch of a stream may be applied here (hold the lock; before the push
        is applied): False, apply it; True, it was applied here already (answer it, apply nothing).

        Every ps task keeps how far its own updates of each partition reached, in its checkpoints
        too: a batch ``[start, offset)`` applies once ``seen`` (where the worker last knew this task
        to be) is that, and the batch starts there or later; one that ends there or before is
        applied already. So each record's update reaches each ps task once, whichever of a
        step's pushes a killed worker had sent, and whichever ps task restored a checkpoint.

        Raises:
            DataRangeLostError: the partition is not this worker's (kept here: ps 0), or the worker
                read it from elsewhere than this task is: nothing applies; it asks ps 0 for its
                partitions and every ps task where each reached, and reads again from the lowest.
        """
        stream = self._streams.get(progress.name)
        if stream is not None:  # the leases are kept here (ps 0)
            lease = stream.leases.get(progress.lease_id)
            if lease is None or lease.worker != worker:
                raise DataRangeLostError(
                    f"lease {progress.lease_id} of stream {progress.name!r} is no longer worker {worker}'s (it was "
                    f"presumed dead and the partition went to another worker, or the ps task restored a checkpoint)"
                    f": nothing of this push was applied; ask for partitions again"
                )
        reached = self._applied.get(progress.name, {}).get(progress.partition, 0)
        if reached and progress.offset <= reached:
            return True
        if progress.seen != reached or progress.start < reached:
            raise DataRangeLostError(
                f"partition {progress.partition} of stream {progress.name!r} is applied up to offset {reached} here; "
                f"worker {worker} sent records [{progress.start}, {progress.offset}) as if it were at {progress.seen} "
                f"(a ps task restored a checkpoint, or another worker read the partition): nothing of this push was "
                f"applied; read again from where every ps task is"
            )
        return False

    def record(self, worker: int, progress: Progress) -> bool:
        """Commit a push's batch here (hold the lock, with the push applied, :meth:`check` passed
        when it came); False, and nothing recorded, if its lease went meanwhile."""
        stream = self._streams.get(progress.name)
        lease = None if stream is None else stream.leases.get(progress.lease_id)
        if stream is not None and (lease is None or lease.worker != worker):
            return False
        applied = self._applied.setdefault(progress.name, {})
        applied[progress.partition] = max(applied.get(progress.partition, 0), progress.offset)
        return True

    def applied(self, name: str) -> dict[int, int]:
        """How far this task's updates of each partition of stream ``name`` reached (those it has
        applied a batch of)."""
        with self._lock:
            return dict(self._applied.get(name, {}))

    def offsets(self) -> dict[str, list[int]]:
        """Each stream whose leases are kept here: how far this task's updates of each partition
        reached (0: none yet)."""
        with self._lock:
            return {name: self._reached(name, stream.partitions) for name, stream in self._streams.items()}

    def report(self) -> dict[str, tuple[list[int], list[int]]]:
        """Each stream this task applied batches of or keeps the leases of: how far its updates of
        each partition reached (0: none yet), and the worker reading each (-1: none; leases kept
        elsewhere: no entries)."""
        with self._lock:
            report = {}
            for name in sorted(set(self._applied) | set(self._streams)):
                stream = self._streams.get(name)
                count = stream.partitions if stream is not None else max(self._applied[name], default=-1) + 1
                readers = []
                if stream is not None:
                    by_partition = sorted(stream.leases.values(), key=lambda lease: lease.partition)
                    readers = [-1 if lease.worker is None else lease.worker for lease in by_partition]
                report[name] = (self._reached(name, count), readers)
            return report

    # ---- checkpoints

    def state_dict(self) -> dict[str, list[int]]:
        """What a checkpoint keeps: for each stream whose leases are kept here, under
        ``"stream:<name>"``, ``[partitions]``; for each stream this task applied batches of, under
        ``"stream-applied:<name>"``, pairs of a partition and the offset its updates reached."""
        with self._lock:
            state = {f"{STATE_PREFIX}{name}": [s.partitions] for name, s in self._streams.items()}
            for name, applied in self._applied.items():
                state[f"{APPLIED_PREFIX}{name}"] = [x for p in sorted(applied) for x in (p, applied[p])]
            return state

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        """Take a checkpoint's streams (its ``"stream:"`` and ``"stream-applied:"`` keys): the offsets
        its values hold, and every partition back in the queue (the leases of before are void).

        Raises:
            CheckpointError: a stream's record is malformed.
        """
        with self._lock:
            self._streams, self._applied = {}, {}
            for key, values in state.items():
                if key.startswith(APPLIED_PREFIX):
                    self._applied[key[len(APPLIED_PREFIX) :]] = _pairs(key, values)
                if not key.startswith(STATE_PREFIX):
                    continue
                name = key[len(STATE_PREFIX) :]
                if len(values) != 1 or not 1 <= int(values[0]) <= MAX_PARTITIONS:
                    raise CheckpointError(f"the record of stream {name!r} is malformed: {list(values)!r}")
                self._streams[name] = self._new_stream(int(values[0]))

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
            lease = PartitionLease(self._next_lease, partition, None)
            self._next_lease += 1
            stream.leases[lease.lease_id] = lease
        return stream

    def _reached(self, name: str, partitions: int) -> list[int]:
        applied = self._applied.get(name, {})
        return [applied.get(partition, 0) for partition in range(partitions)]

    def _lease(self, progress: Progress) -> PartitionLease | None:
        stream = self._streams.get(progress.name)
        return None if stream is None else stream.leases.get(progress.lease_id)


def _pairs(key: str, values: Sequence[int]) -> dict[int, int]:
    if len(values) % 2 or any(int(v) < 0 for v in values):
        raise CheckpointError(f"the record {key!r} is malformed: {list(values)!r}")
    return {int(values[i]): int(values[i + 1]) for i in range(0, len(values), 2)}

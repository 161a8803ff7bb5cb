"""Ranges of a data set handed to workers so that each example of an epoch is trained once. No network.

ps 0 keeps a :class:`RangeQueue` (its push ends every step of a worker, and
in synchronous training it decides each round's members: a worker with no
range left to train on is not waited for,
:meth:`psframe.ps.protocol.sync.SyncAggregator.pause`). A data set is cut into ranges
of ``range_size`` positions in its epoch's order (the workers draw the order;
the queue deals in positions); a worker asks for a range (a *lease*), trains
on its batches in order, and each step's push to this task carries how far
into the range the worker got (:class:`Progress`). The queue records that
under the store's lock, with the push's gradients: a position counts as
consumed exactly when the update that trained on it is applied here (and a
push sent again after a reconnect is a duplicate, applied and recorded once).

A lease of a worker that is gone (finished, or presumed dead: see
:mod:`psframe.ps.protocol.roster`) goes back to the queue with what was consumed of
it, and the next worker to ask gets the rest. A worker that comes back and
pushes progress on a lease taken from it is refused
(:class:`~psframe.errors.DataRangeLostError`) and nothing of that push is
applied. A worker that starts again under its index gets its own unfinished
lease back. The queue's state goes into this task's checkpoint shard, so a
restore rolls it back with the variables: what the restored model did not
train on is handed out again.

A worker that asks while every range of the last epoch is out, held by live
workers, is told to ask again later (one of them may die): the data set is
exhausted only once every position was consumed.

The queue also keeps the streams read by partition
(:mod:`psframe.ps.protocol.stream_partitions`, :attr:`RangeQueue.streams`): a push's
progress names a data set or a stream, and is checked, recorded and checkpointed
the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psframe.errors import CheckpointError, DataRangeLostError, WireFormatError
from psframe.ps.protocol.stream_partitions import Assignment, StreamPartitions

RETRY_AFTER_S = 0.2  # how soon a worker asks again while every range left is out with others
STATE_PREFIX = "data:"  # a data set's key in a checkpoint's record of pushes


@dataclass(frozen=True)
class DataSpec:
    """How a data set is cut: ``num_examples`` positions an epoch, ranges of ``range_size``, ``epochs`` epochs."""

    num_examples: int
    range_size: int
    epochs: int

    def __post_init__(self) -> None:
        if not (self.num_examples >= 1 and self.range_size >= 1 and self.epochs >= 1):
            raise WireFormatError(
                f"a data set needs num_examples, range_size and epochs >= 1, got {self.num_examples}, "
                f"{self.range_size} and {self.epochs}"
            )

    @property
    def ranges_per_epoch(self) -> int:
        return -(-self.num_examples // self.range_size)

    def bounds(self, index: int) -> tuple[int, int]:
        """The positions ``[start, end)`` of range ``index`` of an epoch."""
        start = index * self.range_size
        return start, min(start + self.range_size, self.num_examples)


@dataclass
class Lease:
    """A range out with a worker (or back in the queue, ``worker`` None), and how much of it is consumed."""

    lease_id: int
    epoch: int
    index: int  # the range's index in its epoch
    start: int
    end: int
    offset: int  # consumed up to here
    worker: int | None


@dataclass(frozen=True)
class Progress:
    """What a step's push says of a worker's lease: consumed up to ``offset``. A stream's batch
    (``partitions`` > 0) also says its first offset ``start``, its ``partition``, and ``seen``:
    where the worker last knew this task's updates of the partition to have reached
    (:meth:`psframe.ps.protocol.stream_partitions.StreamPartitions.check`)."""

    name: str
    lease_id: int
    offset: int
    start: int = 0
    seen: int = 0
    partition: int = 0
    partitions: int = 0


@dataclass
class _DataSet:
    spec: DataSpec
    next_range: int = 0  # ranges handed out, over all epochs (epoch * ranges_per_epoch + index)
    leases: dict[int, Lease] = field(default_factory=dict)  # not yet fully consumed
    consumed: int = 0  # positions consumed, over all epochs

    @property
    def total(self) -> int:
        return self.spec.num_examples * self.spec.epochs

    def exhausted(self) -> bool:
        return self.consumed >= self.total


@dataclass(frozen=True)
class Grant:
    """The answer to a worker asking for a range: a lease, or none yet (``retry_after``), or the end."""

    lease: Lease | None
    exhausted: bool = False
    retry_after: float = 0.0
    consumed: int = 0
    total: int = 0


class RangeQueue:
    """The data sets a ps task hands out in ranges.

    Args:
        gone: whether a worker has left or is presumed dead (its leases go back to the queue).
        lock: guards the queue; the store's, so that progress is recorded with the push it rides on.
    """

    def __init__(self, gone: Callable[[int], bool], lock: Any | None = None) -> None:
        self._gone = gone
        self._lock = lock if lock is not None else threading.RLock()
        self._sets: dict[str, _DataSet] = {}
        self._next_lease = 1
        # Streams read by partition: their offsets go with the pushes as the ranges' positions do.
        self.streams = StreamPartitions(gone, self._lock)

    def acquire(self, worker: int, name: str, spec: DataSpec) -> Grant:
        """A range for ``worker`` of data set ``name``: its own unfinished lease (it started again),
        one given back by a worker that is gone, or the next new one.

        Raises:
            WireFormatError: ``name`` was declared with another cut.
        """
        with self._lock:
            if self.streams.knows(name):
                raise WireFormatError(f"{name!r} is read as a stream here; it cannot be a data set read in ranges too")
            data = self._data_set(name, spec)
            self._reclaim(data)
            own = [lease for lease in data.leases.values() if lease.worker == worker]
            if own:
                return self._grant(data, min(own, key=lambda lease: lease.lease_id))
            free = [lease for lease in data.leases.values() if lease.worker is None]
            if free:
                lease = min(free, key=lambda lease: (lease.epoch, lease.index))
                lease.worker = worker
                return self._grant(data, lease)
            per_epoch = spec.ranges_per_epoch
            if data.next_range < per_epoch * spec.epochs:
                epoch, index = divmod(data.next_range, per_epoch)
                start, end = spec.bounds(index)
                data.next_range += 1
                lease = Lease(self._next_lease, epoch, index, start, end, start, worker)
                self._next_lease += 1
                data.leases[lease.lease_id] = lease
                return self._grant(data, lease)
            if data.exhausted():
                return Grant(None, exhausted=True, consumed=data.consumed, total=data.total)
            return Grant(None, retry_after=RETRY_AFTER_S, consumed=data.consumed, total=data.total)

    def assign_stream(
        self, worker: int, name: str, partitions: int, given_back: Sequence[int] = (), *, leaving: bool = False
    ) -> Assignment:
        """``worker``'s partitions of stream ``name`` (:meth:`StreamPartitions.assign`).

        Raises:
            WireFormatError: ``name`` is a data set read in ranges, or is declared with another
                number of partitions.
        """
        with self._lock:
            if name in self._sets:
                raise WireFormatError(f"{name!r} is a data set read in ranges here; it cannot be read as a stream too")
            return self.streams.assign(worker, name, partitions, given_back, leaving=leaving)

    def check(self, worker: int, progress: Progress) -> bool:
        """Raise unless ``progress`` may be recorded (hold the lock; before the push is applied);
        True: a stream's batch applied here already (the push is answered, not applied again).

        Raises:
            DataRangeLostError: the lease is not this worker's (taken back and handed out
                again while it was presumed dead, or unknown after a restore), or the
                offset goes backwards or past the range.
        """
        if progress.partitions:
            return self.streams.check(worker, progress)
        lease = self._lease(progress)
        if lease is None or lease.worker != worker:
            raise DataRangeLostError(
                f"range {progress.lease_id} of data set {progress.name!r} is no longer worker {worker}'s "
                f"(it was presumed dead and the range went to another worker, or the ps task restored a "
                f"checkpoint): nothing of this push was applied; ask for another range"
            )
        if not lease.offset <= progress.offset <= lease.end:
            raise DataRangeLostError(
                f"worker {worker} says it consumed range {progress.lease_id} of {progress.name!r} up to "
                f"{progress.offset}, but it was at {lease.offset} of [{lease.start}, {lease.end})"
            )
        return False

    def record(self, worker: int, progress: Progress) -> bool:
        """Record a push's progress (hold the lock, with the push applied, :meth:`check` passed
        when it came); False, and nothing recorded, if it no longer fits its lease."""
        if progress.partitions:
            return self.streams.record(worker, progress)
        lease = self._lease(progress)
        if lease is None or lease.worker != worker or not lease.offset <= progress.offset <= lease.end:
            return False
        data = self._sets[progress.name]
        data.consumed += progress.offset - lease.offset
        lease.offset = progress.offset
        if lease.offset == lease.end:
            del data.leases[lease.lease_id]
        return True

    def counts(self) -> dict[str, tuple[int, int]]:
        """Each data set's (positions consumed, positions in all its epochs)."""
        with self._lock:
            return {name: (data.consumed, data.total) for name, data in self._sets.items()}

    def ranges_out(self) -> dict[str, int]:
        """Each data set's ranges handed out and not yet consumed (with a worker, or back in the queue)."""
        with self._lock:
            return {name: len(data.leases) for name, data in self._sets.items()}

    # ---- checkpoints

    def state_dict(self) -> dict[str, list[int]]:
        """What a checkpoint keeps, beside the push ledger's counts (:mod:`psframe.ps.protocol.ledger`): for each
        data set, under ``"data:<name>"``, ``[num_examples, range_size, epochs, ranges handed out,
        positions consumed]`` and then ``epoch, index, offset`` of each range not fully consumed;
        and the streams' offsets (:meth:`StreamPartitions.state_dict`)."""
        with self._lock:
            state = self.streams.state_dict()
            for name, data in self._sets.items():
                spec = data.spec
                values = [spec.num_examples, spec.range_size, spec.epochs, data.next_range, data.consumed]
                for lease in sorted(data.leases.values(), key=lambda lease: (lease.epoch, lease.index)):
                    values += [lease.epoch, lease.index, lease.offset]
                state[f"{STATE_PREFIX}{name}"] = values
            return state

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        """Take a checkpoint's state (its ``"data:"`` keys; the rest is the ledger's): every range
        not fully consumed goes back to the queue, and the leases of before are void.

        Raises:
            CheckpointError: a data set's record is malformed.
        """
        with self._lock:
            self.streams.load_state_dict(state)
            self._sets = {}
            for key, values in state.items():
                if not key.startswith(STATE_PREFIX):
                    continue
                name = key[len(STATE_PREFIX) :]
                if len(values) < 5 or (len(values) - 5) % 3:
                    raise CheckpointError(f"the record of data set {name!r} is malformed: {list(values)!r}")
                num_examples, range_size, epochs, next_range, consumed = (int(v) for v in values[:5])
                spec = DataSpec(num_examples, range_size, epochs)
                data = _DataSet(spec, next_range, consumed=consumed)
                for i in range(5, len(values), 3):
                    epoch, index, offset = (int(v) for v in values[i : i + 3])
                    start, end = spec.bounds(index)
                    lease = Lease(self._next_lease, epoch, index, start, end, offset, None)
                    self._next_lease += 1
                    data.leases[lease.lease_id] = lease
                self._sets[name] = data

    # ---- inside

    def _data_set(self, name: str, spec: DataSpec) -> _DataSet:
        data = self._sets.get(name)
        if data is None:
            data = self._sets[name] = _DataSet(spec)
        elif data.spec != spec:
            raise WireFormatError(
                f"data set {name!r} is cut as {data.spec}; this worker asks for it as {spec} "
                f"(every worker must read it with the same num_examples, range_size and epochs)"
            )
        return data

    def _reclaim(self, data: _DataSet) -> None:
        """Give the leases of workers that are gone back to the queue."""
        for lease in data.leases.values():
            if lease.worker is not None and self._gone(lease.worker):
                lease.worker = None

    def _lease(self, progress: Progress) -> Lease | None:
        data = self._sets.get(progress.name)
        return None if data is None else data.leases.get(progress.lease_id)

    def _grant(self, data: _DataSet, lease: Lease) -> Grant:
        return Grant(lease, consumed=data.consumed, total=data.total)

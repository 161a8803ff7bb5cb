"""The partitions of streams on ps 0, no network: even shares, giving back, offsets committed with
pushes, workers gone, checkpoints.

This file holds the unit tier's tests of the subject; `tests/cluster/test_streams.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest

from psframe.errors import CheckpointError, DataRangeLostError, WireFormatError
from psframe.ps.protocol.data_ranges import DataSpec, Progress, RangeQueue
from psframe.ps.protocol.stream_partitions import StreamPartitions

pytestmark = pytest.mark.unit


def partitions_of(assignment) -> list[int]:
    return [lease.partition for lease in assignment.leases]


def batch(lease, start: int, end: int, seen: int, partitions: int = 2, name: str = "clicks") -> Progress:
    """A step's batch of records ``[start, end)`` of the lease's partition, its worker having seen ``seen``
    (``lease``: a PartitionLease, or a partition where the leases are kept elsewhere)."""
    lease_id, partition = (0, lease) if isinstance(lease, int) else (lease.lease_id, lease.partition)
    return Progress(name, lease_id, end, start, seen, partition, partitions)


def test_one_reader_takes_every_partition_from_offset_zero():
    streams = StreamPartitions(gone=lambda worker: False)
    mine = streams.assign(0, "clicks", 4)
    assert partitions_of(mine) == [0, 1, 2, 3] and mine.give_back == ()
    assert streams.offsets() == {"clicks": [0, 0, 0, 0]}


def test_a_joining_worker_gets_its_share_once_the_holder_gives_back():
    streams = StreamPartitions(gone=lambda worker: False)
    first = streams.assign(0, "clicks", 5)
    assert partitions_of(first) == [0, 1, 2, 3, 4]
    joined = streams.assign(1, "clicks", 5)
    assert partitions_of(joined) == []  # nothing free yet: worker 0 holds them all
    told = streams.assign(0, "clicks", 5)
    back = [lease for lease in told.leases if lease.lease_id in told.give_back]
    assert [lease.partition for lease in back] == [3, 4]  # worker 0's share is 3 of 5 (the lower index)
    streams.assign(0, "clicks", 5, given_back=told.give_back)
    assert partitions_of(streams.assign(1, "clicks", 5)) == [3, 4]
    assert partitions_of(streams.assign(0, "clicks", 5)) == [0, 1, 2]


def test_given_back_ids_of_another_worker_change_nothing():
    streams = StreamPartitions(gone=lambda worker: False)
    mine = streams.assign(0, "clicks", 2)
    streams.assign(1, "clicks", 2, given_back=[lease.lease_id for lease in mine.leases])
    assert partitions_of(streams.assign(0, "clicks", 2)) == [0, 1]


def test_a_gone_workers_partitions_go_to_the_others_at_their_committed_offsets():
    gone: set[int] = set()
    streams = StreamPartitions(gone=lambda worker: worker in gone)
    streams.assign(0, "clicks", 2)
    streams.assign(1, "clicks", 2)
    told = streams.assign(0, "clicks", 2)
    assert partitions_of(streams.assign(0, "clicks", 2, given_back=told.give_back)) == [0]
    theirs = streams.assign(1, "clicks", 2)
    (lease,) = theirs.leases
    assert not streams.check(1, batch(lease, 0, 17, 0))
    assert streams.record(1, batch(lease, 0, 17, 0))
    gone.add(1)
    taken = streams.assign(0, "clicks", 2)
    assert partitions_of(taken) == [0, 1] and streams.offsets()["clicks"][1] == 17
    with pytest.raises(DataRangeLostError, match="no longer worker 1's"):
        streams.check(1, batch(lease, 17, 20, 17))  # it came back: its push is refused
    assert not streams.record(1, batch(lease, 17, 20, 17))
    assert streams.offsets() == {"clicks": [0, 17]} and streams.applied("clicks") == {1: 17}


def test_a_batch_applies_where_the_worker_saw_this_task_and_once_only():
    streams = StreamPartitions(gone=lambda worker: False)
    (lease,) = streams.assign(0, "clicks", 1).leases
    assert not streams.check(0, batch(lease, 0, 10, 0, partitions=1))
    assert streams.record(0, batch(lease, 0, 10, 0, partitions=1))
    assert streams.check(0, batch(lease, 4, 10, 0, partitions=1))  # applied here already: answered, not applied
    with pytest.raises(DataRangeLostError, match="applied up to offset 10 here"):
        streams.check(0, batch(lease, 10, 14, 6, partitions=1))  # the worker thought this task elsewhere
    with pytest.raises(DataRangeLostError, match="applied up to offset 10 here"):
        streams.check(0, batch(lease, 8, 14, 10, partitions=1))  # it would apply records 8 and 9 again
    assert not streams.check(0, batch(lease, 12, 14, 10, partitions=1))  # records 10, 11 never touched this task
    assert streams.offsets() == {"clicks": [10]}


def test_a_task_that_keeps_no_leases_tracks_its_own_offsets_and_restores_them():
    other = StreamPartitions(gone=lambda worker: False)  # ps 1: the leases are ps 0's
    assert not other.check(3, batch(1, 0, 7, 0))
    other.record(3, batch(1, 0, 7, 0))
    other.record(3, batch(1, 7, 9, 7))
    assert other.applied("clicks") == {1: 9} and other.offsets() == {}
    state = other.state_dict()
    assert state == {"stream-applied:clicks": [1, 9]}
    restored = StreamPartitions(gone=lambda worker: False)
    restored.load_state_dict({**state, "stream-applied:views": [0, 3, 2, 5]})
    assert restored.applied("clicks") == {1: 9} and restored.applied("views") == {0: 3, 2: 5}
    with pytest.raises(DataRangeLostError):  # a worker that saw it further on: records 9.. are not here
        restored.check(0, batch(1, 12, 15, 12))


def test_leaving_gives_every_partition_back_and_leaves_the_shares():
    streams = StreamPartitions(gone=lambda worker: False)
    streams.assign(0, "clicks", 4)
    streams.assign(1, "clicks", 4)
    streams.assign(0, "clicks", 4, leaving=True)
    assert partitions_of(streams.assign(1, "clicks", 4)) == [0, 1, 2, 3]


def test_a_stream_declared_with_other_partitions_or_as_a_data_set_is_refused():
    queue = RangeQueue(gone=lambda worker: False)
    queue.assign_stream(0, "clicks", 4)
    with pytest.raises(WireFormatError, match="4 partitions here; this worker reads it with 3"):
        queue.assign_stream(1, "clicks", 3)
    with pytest.raises(WireFormatError, match="read as a stream"):
        queue.acquire(0, "clicks", DataSpec(10, 5, 1))
    queue.acquire(0, "train", DataSpec(10, 5, 1))
    with pytest.raises(WireFormatError, match="data set read in ranges"):
        queue.assign_stream(0, "train", 2)
    with pytest.raises(WireFormatError, match="partitions must be"):
        queue.assign_stream(0, "other", 0)


def test_the_queue_routes_progress_by_name_and_checkpoints_both_kinds():
    queue = RangeQueue(gone=lambda worker: False)
    grant = queue.acquire(0, "train", DataSpec(10, 5, 1))
    (_, second) = queue.assign_stream(0, "clicks", 2).leases
    for progress in (Progress("train", grant.lease.lease_id, 3), batch(second, 0, 41, 0)):
        assert not queue.check(0, progress)
        assert queue.record(0, progress)
    state = queue.state_dict()
    assert state["stream:clicks"] == [2] and state["stream-applied:clicks"] == [1, 41]
    restored = RangeQueue(gone=lambda worker: False)
    restored.load_state_dict({**state, "last_push": [5]})
    assert restored.streams.offsets() == {"clicks": [0, 41]} and restored.counts() == {"train": (3, 10)}
    again = restored.assign_stream(0, "clicks", 2)
    assert partitions_of(again) == [0, 1]
    with pytest.raises(DataRangeLostError):  # the leases of before the restore are void
        restored.check(0, batch(second, 41, 50, 41))


@pytest.mark.parametrize("record", [[], [0], [2, 5], [70000], [-1]])
def test_a_malformed_stream_record_in_a_checkpoint_is_refused(record):
    with pytest.raises(CheckpointError, match="record of stream 'clicks' is malformed"):
        StreamPartitions(gone=lambda worker: False).load_state_dict({"stream:clicks": record})


@pytest.mark.parametrize("record", [[1], [1, 2, 3], [0, -1]])
def test_a_malformed_record_of_offsets_applied_is_refused(record):
    with pytest.raises(CheckpointError, match="'stream-applied:clicks' is malformed"):
        StreamPartitions(gone=lambda worker: False).load_state_dict({"stream-applied:clicks": record})

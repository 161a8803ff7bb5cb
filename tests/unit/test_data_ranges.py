"""Data read in ranges: each example of each epoch trained on once, whoever joins, leaves or dies.

The queue alone (no network), then workers in threads against ps tasks in
this process: the multiset of examples whose step was applied equals the
epochs', with a worker that dies mid-range (its range goes to another from
where it got to), one that joins late, synchronous rounds that drop late
batches (trained again), and a checkpoint restored (what the restored model
did not train on is handed out again).

This file holds the unit tier's tests of the subject; `tests/service/test_data_ranges.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest

import psframe
from psframe.errors import CheckpointError, DataRangeLostError, WireFormatError
from psframe.ps.protocol.data_ranges import DataSpec, Progress
from tests.service.test_data_ranges import queue


def test_ranges_are_handed_out_in_order_and_end_once_every_example_is_consumed():
    q, spec = queue(), DataSpec(num_examples=10, range_size=4, epochs=2)
    grants = [q.acquire(w, "d", spec) for w in (0, 1, 2)]
    assert [(g.lease.epoch, g.lease.start, g.lease.end) for g in grants] == [(0, 0, 4), (0, 4, 8), (0, 8, 10)]
    assert q.acquire(0, "d", spec).lease is grants[0].lease  # its own, until consumed
    for worker, grant in enumerate(grants):
        q.check(worker, Progress("d", grant.lease.lease_id, grant.lease.end))
        assert q.record(worker, Progress("d", grant.lease.lease_id, grant.lease.end))
    second = q.acquire(0, "d", spec)
    assert (second.lease.epoch, second.lease.start, second.consumed, second.total) == (1, 0, 10, 20)
    for worker in (1, 2):
        lease = q.acquire(worker, "d", spec).lease
        q.record(worker, Progress("d", lease.lease_id, lease.end))
    waiting = q.acquire(1, "d", spec)  # all handed out, one still out with worker 0: ask again
    assert waiting.lease is None and waiting.retry_after > 0 and not waiting.exhausted
    q.record(0, Progress("d", second.lease.lease_id, 4))
    assert q.acquire(1, "d", spec).exhausted
    assert q.counts() == {"d": (20, 20)}


def test_a_gone_workers_range_goes_to_the_next_from_where_it_got_and_its_late_push_is_refused():
    gone: set[int] = set()
    q, spec = queue(gone), DataSpec(100, 10, 1)
    lease = q.acquire(0, "d", spec).lease
    q.record(0, Progress("d", lease.lease_id, 3))
    gone.add(0)  # presumed dead
    taken = q.acquire(1, "d", spec).lease
    assert (taken.lease_id, taken.offset, taken.worker) == (lease.lease_id, 3, 1)
    with pytest.raises(DataRangeLostError, match="no longer worker 0's"):
        q.check(0, Progress("d", lease.lease_id, 6))
    assert not q.record(0, Progress("d", lease.lease_id, 6))  # nothing recorded
    with pytest.raises(DataRangeLostError, match="up to 2, but it was at 3"):
        q.check(1, Progress("d", lease.lease_id, 2))


def test_a_data_set_is_cut_one_way():
    q = queue()
    q.acquire(0, "d", DataSpec(100, 10, 1))
    with pytest.raises(WireFormatError, match="every worker must read it with the same"):
        q.acquire(1, "d", DataSpec(100, 20, 1))
    with pytest.raises(WireFormatError, match=">= 1"):
        DataSpec(0, 10, 1)


def test_the_queue_state_round_trips_and_a_restore_voids_the_leases():
    q, spec = queue(), DataSpec(25, 10, 2)
    first = q.acquire(0, "d", spec).lease
    q.record(0, Progress("d", first.lease_id, 7))
    q.acquire(1, "d", spec)
    state = q.state_dict()
    assert state == {"data:d": [25, 10, 2, 2, 7, 0, 0, 7, 0, 1, 10]}
    restored = queue()
    restored.load_state_dict({**state, "last_push": [1, 2]})  # beside the ledger's keys
    with pytest.raises(DataRangeLostError):
        restored.check(0, Progress("d", first.lease_id, 9))
    again = restored.acquire(2, "d", spec).lease
    assert (again.epoch, again.index, again.offset) == (0, 0, 7)
    with pytest.raises(CheckpointError, match="malformed"):
        restored.load_state_dict({"data:d": [25, 10, 2, 2]})


def test_data_ranges_options_are_checked():
    assert psframe.DataRanges("d", 100, batch_size=8).examples_per_range == 128
    for bad in ({"num_examples": 0}, {"batch_size": 0}, {"range_size": 0}, {"epochs": 0}, {"name": ""}):
        with pytest.raises(ValueError):
            psframe.DataRanges(**{"name": "d", "num_examples": 10, "batch_size": 2, **bad})

"""WorkerRoster: who finished, who is alive (no network; time is a fake clock)."""

from __future__ import annotations

import pytest

from psframe.ps.protocol.roster import LIVE_SNAPSHOT_MAX_AGE, WorkerRoster
from tests.support.doubles import FakeClock


def test_nobody_is_presumed_dead_before_someone_finished():
    roster = WorkerRoster(2, worker_timeout=0.0)
    assert roster.presumed_dead() is None
    assert roster.finished == [] and not roster.all_finished


def test_silent_workers_are_presumed_dead_once_another_finished():
    clock = FakeClock()
    roster = WorkerRoster(3, worker_timeout=1.0, clock=clock)
    assert roster.finish(0) is True
    assert roster.finish(0) is False  # counted once
    clock.advance(1.0)
    assert roster.presumed_dead() is None  # silent for exactly worker_timeout: not yet
    clock.advance(0.01)
    assert roster.presumed_dead() == [1, 2]
    roster.finish(1)
    roster.finish(2)
    assert roster.all_finished and roster.finished == [0, 1, 2]


def test_a_worker_in_a_call_or_heard_from_recently_is_alive():
    roster = WorkerRoster(2, worker_timeout=60.0)
    roster.finish(0)
    with roster.call(1):
        assert roster.presumed_dead() is None
    assert roster.presumed_dead() is None  # heard from just now, timeout 60 s
    clock = FakeClock()
    fast = WorkerRoster(2, worker_timeout=1.0, clock=clock)
    fast.finish(0)
    with fast.call(1):
        clock.advance(10.0)
        assert fast.presumed_dead() is None  # busy: never presumed dead mid-call
    clock.advance(1.01)
    assert fast.presumed_dead() == [1]


def test_seen_reports_never_busy_and_finished():
    roster = WorkerRoster(3, worker_timeout=60.0)
    with roster.call(1):
        seen = {w: (ago, done) for w, ago, done in roster.seen()}
        assert seen[0] == (-1.0, False)  # never heard from
        assert seen[1] == (0.0, False)  # in a call right now
    roster.finish(2)
    assert {w: done for w, _, done in roster.seen()} == {0: False, 1: False, 2: True}


def test_nobody_is_presumed_dead_once_everyone_finished():
    """The last Finish must not read as "[] presumed dead"."""
    roster = WorkerRoster(2, worker_timeout=0.0)
    roster.finish(0)
    roster.finish(1)
    assert roster.all_finished
    assert roster.presumed_dead() is None
    assert roster.waiting_for_chief() is None


def test_the_chief_is_waited_for_longer_than_other_workers():
    clock = FakeClock()
    roster = WorkerRoster(3, worker_timeout=1.0, chief_timeout=60.0, clock=clock)
    roster.finish(1)
    clock.advance(2.0)
    # Worker 2 alone would be presumed dead, but the chief is unfinished and within its timeout.
    assert roster.presumed_dead() is None
    assert roster.waiting_for_chief() is not None  # worker 2 is presumed dead: only the chief holds the job
    roster.finish(2)
    clock.advance(3.0)
    assert roster.waiting_for_chief() == 5.0
    with roster.call(0):  # the chief came back: nobody is waited for in silence
        assert roster.waiting_for_chief() is None
        assert roster.presumed_dead() is None


def test_a_chief_silent_beyond_chief_timeout_is_presumed_dead():
    clock = FakeClock()
    roster = WorkerRoster(2, worker_timeout=1.0, chief_timeout=20.0, clock=clock)
    roster.finish(1)
    clock.advance(20.0)
    assert roster.presumed_dead() is None and roster.waiting_for_chief() == 20.0
    clock.advance(0.5)
    assert roster.presumed_dead() == [0]
    assert roster.waiting_for_chief() is None


def test_a_silent_non_chief_is_not_waited_for_once_the_chief_finished():
    clock = FakeClock()
    roster = WorkerRoster(3, worker_timeout=1.0, chief_timeout=3600.0, clock=clock)
    roster.finish(0)
    roster.finish(1)
    clock.advance(1.5)
    assert roster.presumed_dead() == [2]


def test_chief_timeout_defaults_to_ten_worker_timeouts_and_is_never_shorter():
    assert WorkerRoster(2, worker_timeout=60.0).chief_timeout == 600.0
    with pytest.raises(ValueError, match="chief_timeout"):
        WorkerRoster(2, worker_timeout=60.0, chief_timeout=30.0)


def test_the_live_snapshot_follows_silence_and_membership_without_waiting():
    """The snapshot counted from (no lock) agrees with the exact answer as the clock moves,
    and at once when a worker finishes, or comes back with a call."""
    clock = FakeClock()
    roster = WorkerRoster(3, worker_timeout=1.0, clock=clock)
    assert roster.live_snapshot() == (0, 1, 2) and roster.live() == [0, 1, 2]
    with roster.call(1):
        clock.advance(0.6)
        with roster.call(2):
            clock.advance(0.6)  # worker 0 silent for 1.2 s, past its timeout; 1 and 2 in a call
            assert roster.live_snapshot() == (1, 2) == tuple(roster.live())
    roster.finish(2)
    assert roster.live_snapshot() == (1,) == tuple(roster.live())
    clock.advance(1.01)  # worker 1 silent past its timeout too
    assert roster.live_snapshot() == () == tuple(roster.live())
    with roster.call(0):  # back: live at once, not after the snapshot's age
        assert roster.live_snapshot() == (0,) == tuple(roster.live())
    clock.advance(LIVE_SNAPSHOT_MAX_AGE)
    assert roster.live_snapshot() == (0,) == tuple(roster.live())

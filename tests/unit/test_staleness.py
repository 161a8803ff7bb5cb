"""Bounded staleness (SSP): a worker runs at most ``steps`` ahead of the slowest live worker.

Unit tests of the ps task's gate (:mod:`psframe.ps.protocol.staleness`), then workers on ps
tasks served in this process (``in_process_cluster``), one of them slowed on purpose: the steps ahead every push found
(counted by the ps task, and by each worker) never exceed the bound, and without
a bound the fast worker does run ahead (the same test would fail).

This file holds the unit tier's tests of the subject; `tests/service/test_staleness.py` holds the
other tiers'.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import psframe
from psframe.errors import BarrierTimeoutError
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import StalenessGate
from tests.support.doubles import FakeClock

# ---- the gate, no network; time is a fake clock

JOIN_S = 10.0  # real seconds a thread of these tests is given to end


def gate(
    num_workers: int = 3, worker_timeout: float = 60.0
) -> tuple[StalenessGate, PushLedger, WorkerRoster, FakeClock]:
    clock = FakeClock()
    ledger, roster = PushLedger(num_workers), WorkerRoster(num_workers, worker_timeout, clock=clock)
    return StalenessGate(ledger, roster, "/job:ps/task:0", clock=clock), ledger, roster, clock


def steps(ledger: PushLedger, worker: int, count: int) -> None:
    for _ in range(count):
        ledger.record(worker, ledger.last_push(worker) + 1, ends_step=True)


def test_steps_ahead_are_counted_against_the_slowest_other_live_worker():
    _, ledger, roster, _ = gate()
    steps(ledger, 0, 5)
    steps(ledger, 1, 3)
    steps(ledger, 2, 4)

    def ahead(worker: int) -> int:
        return ledger.steps_ahead(worker, roster.live_snapshot())

    assert ahead(0) == 2 and ahead(1) == 0 and ahead(2) == 1
    roster.finish(1)  # a finished worker is no longer waited for: 2 is now the slowest other
    assert ahead(0) == 1
    steps(ledger, 0, 40)
    assert ahead(0) == 41


def test_a_wait_ends_when_the_slowest_catches_up():
    staleness, ledger, _, _ = gate(num_workers=2)
    steps(ledger, 0, 3)
    steps(ledger, 1, 1)
    staleness.wait(0, bound=2, timeout=0.0)  # 2 ahead: within the bound, without waiting at all

    def catch_up() -> None:
        time.sleep(0.05)  # real, and only for order: the wait has begun (it passes if not)
        steps(ledger, 1, 1)
        staleness.stepped()

    thread = threading.Thread(target=catch_up)
    thread.start()
    staleness.wait(0, bound=1, timeout=60.0)  # the clock stands still: only worker 1's step releases it
    thread.join(JOIN_S)
    assert not thread.is_alive()


def test_a_wait_gives_up_when_its_clock_passes_the_timeout_naming_who_is_behind():
    staleness, ledger, _, clock = gate(num_workers=2)
    steps(ledger, 0, 3)
    steps(ledger, 1, 2)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            staleness.wait(0, bound=0, timeout=30.0)
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(0.1)
    assert thread.is_alive() and not outcome  # real time passing ends no wait: its clock stands still
    clock.advance(30.0)
    deadline = time.monotonic() + JOIN_S  # far less than the wait's 30 s: it must not sleep them out
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.05)
        clock.advance(1.0)  # in case the wait read its start only after the first advance
    assert not thread.is_alive(), "the wait did not give up on its clock"
    assert len(outcome) == 1 and isinstance(outcome[0], BarrierTimeoutError), outcome
    assert re.search(
        r"worker/task:0 \(3 steps\) waited 3\d\.\ds .* at most 0 steps ahead.*worker/task:1 \(2 steps\)",
        str(outcome[0]),
    ), outcome[0]


def test_a_silent_worker_is_not_waited_for_past_the_worker_timeout():
    staleness, ledger, roster, clock = gate(num_workers=2, worker_timeout=5.0)
    steps(ledger, 0, 5)
    with roster.call(0):
        clock.advance(5.0)
        with pytest.raises(BarrierTimeoutError):  # a timeout of 0: look once, fail if too far ahead
            staleness.wait(0, bound=0, timeout=0.0)  # worker 1 silent for worker_timeout: still waited for
        clock.advance(0.1)  # worker 1 silent past the timeout: presumed lost
        staleness.wait(0, bound=0, timeout=0.0)
    assert ledger.steps_ahead(0, roster.live_snapshot()) == 0


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"steps": -1}, ValueError, "steps must be an int >= 0, got -1"),
        ({"steps": 1.5}, ValueError, "steps must be an int >= 0, got 1.5"),
        ({"steps": 1, "timeout": 0}, ValueError, "timeout must be a positive number of seconds, got 0"),
    ],
)
def test_bad_bounds_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        psframe.BoundedStaleness(**kwargs)


# ---- workers, one slowed on purpose


STEPS = 30


def run(ps, bound: int | None, slow_seconds: float = 0.02) -> tuple[dict[int, dict[int, int]], list[int]]:
    """Two workers train STEPS steps each on ``ps`` (an in-process cluster), worker 1 sleeping
    ``slow_seconds`` a step; each worker's steps ahead, and ps task 0's counts as the chief finished."""
    cluster = ps.cluster
    results: dict[int, dict[int, int]] = {}
    errors: list[BaseException] = []
    staleness = None if bound is None else psframe.BoundedStaleness(bound, timeout=60.0)

    def worker(index: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        try:
            with psframe.Trainer(
                model, cluster, task_index=index, optimizer=psframe.optim.SGD(lr=0.01), staleness=staleness
            ) as trainer:
                for step in range(STEPS):
                    if index == 1:
                        time.sleep(slow_seconds)
                    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
                    trainer.step(F.mse_loss(model(x), x.sum(1, keepdim=True)))
                results[index] = trainer.stats.steps_ahead
                if index == 0:
                    counts.extend(ps.services[0].staleness.counts)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    counts: list[int] = []
    threads = [threading.Thread(target=worker, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return results, counts


@pytest.mark.parametrize("bound", [0, 2])
def test_a_fast_worker_never_runs_more_than_the_bound_ahead_of_a_slowed_one(in_process_cluster, bound):
    results, counts = run(in_process_cluster(num_ps=2, num_workers=2), bound)
    for index, ahead in results.items():
        assert sum(ahead.values()) == STEPS and max(ahead) <= bound, (index, ahead)
    # The ps task counted every step-ending push of both workers (some of worker 1's came
    # after worker 0 read the counts); none past the bound.
    assert sum(counts) >= STEPS and not any(counts[bound + 1 :]), counts


def test_without_a_bound_the_fast_worker_runs_ahead(in_process_cluster):
    results, counts = run(in_process_cluster(num_ps=1, num_workers=2), None)
    assert max(results[0]) > 2, results  # the oracle of the test above can fail
    assert any(counts[3:]), counts

"""Bounded staleness on a ps task: a worker's step is answered once it is not too far ahead. No network.

Asynchronous training with a bound ``s`` (:class:`psframe.BoundedStaleness`,
SSP): a worker may be at most ``s`` steps ahead of the slowest live worker.
A ps task applies every push at once, as in asynchronous training, and
holds back only the reply to the push that ends a worker's step
(``PushPullHeader.staleness_bound``), until the worker's steps applied here
are at most ``s`` more than the slowest other live worker's. The worker
cannot begin its next step before every ps task answered, so when any of
its pushes is applied it is at most ``s`` steps ahead on every ps task.

*Steps ahead* is counted at each push that ends a worker's step, bound or
not: the worker's steps applied here before it, less the slowest other live
worker's (:meth:`PushLedger.steps_ahead`; the data plane has the ledger count
it as it records the step, and adds it to :attr:`StalenessGate.counts`, so
that a step passes here only where a reply waits for a bound). The counts
make the histogram of ``psframe status`` (``TaskInfo.steps_ahead_counts``),
and the reply tells the worker its own. Counting takes no lock of its own (a
feature that is off costs a step nothing): it reads the roster's snapshot of
the live workers
(:meth:`~psframe.ps.protocol.roster.WorkerRoster.live_snapshot`), so a silent
worker another serving process has just heard from again may be left out of
a count for a few milliseconds. Only a wait decides anything, and it asks
the roster under its lock.

A live worker is one neither finished nor silent for over the task's
``worker_timeout`` (:meth:`psframe.ps.protocol.roster.WorkerRoster.live`): a lost
worker is waited for that long at most, and a wait that outlasts the
bound's own timeout fails with :class:`~psframe.errors.BarrierTimeoutError`,
naming the workers it waited for. Steps come from the push ledger
(:mod:`psframe.ps.protocol.ledger`), shared by a task's serving processes; a process
also looks again every few milliseconds for steps another one applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from psframe.cluster import ClusterSpec
from psframe.errors import BarrierTimeoutError
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster

HISTOGRAM_BUCKETS = 16
"""Steps ahead counted 0, 1, ... 14, and 15 or more."""

# How often a wait looks again without being told: for steps another process applied, and
# for its deadline on a clock that is not time's own (a test's).
_POLL_SECONDS = 0.01


class StalenessGate:
    """Counts how far ahead each step-ending push finds its worker, and holds replies to a bound.

    Args:
        ledger: the task's push ledger (each worker's steps applied here).
        roster: the task's workers (which are live).
        task_name: for errors.
        clock: seconds, never going back, that waits' deadlines are read from (a test's fake one;
            a wait still waits in real time, in slices of at most :data:`_POLL_SECONDS`).
    """

    def __init__(
        self, ledger: PushLedger, roster: WorkerRoster, task_name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ledger = ledger
        self._roster = roster
        self._task_name = task_name
        self._clock = clock
        self._changed = threading.Condition()
        self.waiting = 0
        """Replies held to a bound now: without any, a step wakes no one (read without a lock)."""
        self.counts = [0] * HISTOGRAM_BUCKETS
        """How many step-ending pushes found their worker 0, 1, ... steps ahead (the last: that many or more)."""

    def stepped(self) -> None:
        """A worker's step was recorded: waits look again (no lock taken while none waits)."""
        if self.waiting:
            with self._changed:
                self._changed.notify_all()

    def wait(self, worker: int, bound: int, timeout: float) -> None:
        """Return once ``worker`` is at most ``bound`` steps ahead of the slowest other live worker
        here (call without the store's lock).

        Raises:
            BarrierTimeoutError: still too far ahead after ``timeout`` seconds.
        """
        started = self._clock()
        deadline = started + timeout
        with self._changed:
            self.waiting += 1  # before the first look: a step recorded after it wakes this wait
        try:
            while self._ledger.steps_ahead(worker, self._roster.live()) > bound:
                now = self._clock()
                remaining = deadline - now
                if remaining <= 0:
                    raise self._timeout_error(worker, bound, now - started)
                with self._changed:
                    self._changed.wait(min(remaining, _POLL_SECONDS))
        finally:
            with self._changed:
                self.waiting -= 1

    def _timeout_error(self, worker: int, bound: int, waited: float) -> BarrierTimeoutError:
        mine = self._ledger.applied_steps(worker)
        behind = [
            f"{ClusterSpec.task_name('worker', w)} ({self._ledger.applied_steps(w)} steps)"
            for w in self._roster.live()
            if w != worker and mine - self._ledger.applied_steps(w) > bound
        ]
        return BarrierTimeoutError(
            f"{ClusterSpec.task_name('worker', worker)} ({mine} steps) waited {waited:.1f}s on {self._task_name} "
            f"to be at most {bound} steps ahead (BoundedStaleness); behind: {', '.join(behind) or 'none now'}"
        )

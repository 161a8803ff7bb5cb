"""Which workers a ps task has heard from, which are busy, which finished. No network.

When a ps task decides that training is over (the rules, in one place):

1. once every worker has finished (said so with a Finish call), training is over;
2. a worker killed for good never finishes, so once some workers have
   finished, an unfinished one must show signs of life (a call in progress,
   or one within ``worker_timeout`` seconds) to be waited for: a silent
   non-chief is presumed dead;
3. the chief (worker 0) is different: it writes the final checkpoint and
   reports the job's result, and a chief cut off by the network comes back.
   It is waited for until it has been silent for ``chief_timeout`` seconds
   (longer than ``worker_timeout``), and the ps says every few seconds that
   it waits (:meth:`WorkerRoster.waiting_for_chief`);
4. before any worker has finished, nobody is presumed dead: a job never
   ends because its workers are slow or unreachable for a while.

Elastic clusters (a ps task given ``max_workers``): the roster has that many
slots. The workers of the cluster the task started with are members from
the start; a worker of another slot becomes one when it is first heard from
(it joined), and one that finished becomes one again when it joins anew
(:meth:`WorkerRoster.join`). "Every worker" above means every member. The
roster keeps the last changes (:meth:`WorkerRoster.record`) for ``status``.

Live workers (neither finished nor silent for over ``worker_timeout``) are
asked for exactly, under the roster's lock, where they decide something
(:meth:`WorkerRoster.live`), and without a lock where they are only counted
(:meth:`WorkerRoster.live_snapshot`, for every step-ending push).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy


def check_max_workers(max_workers: int | None, num_workers: int) -> int:
    """A ps task's worker slots: ``max_workers`` checked, or the cluster's ``num_workers`` for None.

    Raises:
        ValueError: not an int, or fewer than the cluster's workers.
    """
    if max_workers is None:
        return num_workers
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < num_workers:
        raise ValueError(
            f"max_workers must be an int >= the cluster's {num_workers} workers (the slots workers may join "
            f"up to), got {max_workers!r}"
        )
    return max_workers


def default_chief_timeout(worker_timeout: float) -> float:
    """How long a ps task waits for a silent chief when not told: ten times ``worker_timeout``."""
    return 10.0 * worker_timeout


MEMBERSHIP_KEPT = 256  # changes of membership a roster remembers for status


class Change(enum.Enum):
    """How a worker's membership changed (the wire's ``MembershipChange.Kind``)."""

    JOINED = "joined"
    LEFT = "left"
    PRESUMED_DEAD = "presumed_dead"
    RETURNED = "returned"


@dataclass(frozen=True)
class MembershipChange:
    worker: int
    change: Change
    global_step: int
    when: float  # the roster's clock (time.monotonic())


LIVE_SNAPSHOT_MAX_AGE = 0.05
"""Seconds a snapshot of the live workers is used at most (see :meth:`WorkerRoster.live_snapshot`)."""


@dataclass(frozen=True)
class _LiveSnapshot:
    workers: tuple[int, ...]
    until: float  # on the roster's clock: when some worker of it may go silent past its timeout


class WorkerRoster:
    """The workers of one ps task.

    Args:
        num_workers: the workers of the cluster the task started with (members from the start).
        worker_timeout: once some workers finished, seconds of silence after
            which an unfinished worker other than the chief is presumed dead.
        last_seen: when each worker was last heard from (on ``clock``,
            one float64 per slot; 0: not a member), shared with the task's other serving
            processes (:mod:`psframe.ps.serving.shared_store`); this roster's own by default.
        chief_timeout: seconds of silence after which the chief too is
            presumed dead (default: ten times ``worker_timeout``); never less
            than ``worker_timeout``.

        capacity: the worker slots (``max_workers`` of an elastic cluster); default ``num_workers``.
        clock: seconds, never going back (``time.monotonic``, the clock every serving process
            of a host shares; a test's fake one).

    Raises:
        ValueError: ``chief_timeout`` is shorter than ``worker_timeout``, or ``capacity`` below ``num_workers``.
    """

    def __init__(
        self,
        num_workers: int,
        worker_timeout: float,
        last_seen: numpy.ndarray | None = None,
        chief_timeout: float | None = None,
        capacity: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if chief_timeout is None:
            chief_timeout = default_chief_timeout(worker_timeout)
        if not chief_timeout >= worker_timeout:
            raise ValueError(
                f"chief_timeout ({chief_timeout}) must be >= worker_timeout ({worker_timeout}): "
                f"the chief is waited for longer than any other worker"
            )
        capacity = num_workers if capacity is None else capacity
        if capacity < num_workers:
            raise ValueError(f"capacity ({capacity}) must be >= num_workers ({num_workers})")
        self.num_workers = num_workers
        self.capacity = capacity
        self.worker_timeout = worker_timeout
        self.chief_timeout = chief_timeout
        self._lock = threading.Lock()
        self._clock = clock
        self._started = clock()
        if last_seen is None:  # shared ones start at their creator's start
            last_seen = numpy.zeros(capacity)
            last_seen[:num_workers] = self._started
        self._last_seen = last_seen
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._finished: set[int] = set()
        self._changes: collections.deque[MembershipChange] = collections.deque(maxlen=MEMBERSHIP_KEPT)
        # Replaced (under the lock) whenever it is out of date; read without it.
        self._live_snapshot = _LiveSnapshot((), float("-inf"))

    @contextlib.contextmanager
    def call(self, worker: int, step: int = 0) -> Iterator[None]:
        """Mark a worker as alive for as long as one of its calls runs; one first heard
        from joins (``step``: the global step now, for the record)."""
        with self._lock:
            now = self._clock()
            if not self._last_seen[worker]:
                self._changes.append(MembershipChange(worker, Change.JOINED, step, now))
            if worker not in self._live_snapshot.workers and worker not in self._finished:
                self._forget_live()  # it joined, or came back: live now
            self._in_flight[worker] += 1
            self._last_seen[worker] = now
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[worker] -= 1
                self._last_seen[worker] = self._clock()

    def finish(self, worker: int, step: int = 0) -> bool:
        """Record that a worker finished (left, at ``step``); True the first time."""
        with self._lock:
            if worker in self._finished:
                return False
            self._finished.add(worker)
            self._forget_live()
            self._changes.append(MembershipChange(worker, Change.LEFT, step, self._clock()))
            return True

    def join(self, worker: int, step: int) -> bool:
        """A worker (re)starts and asks to take part: a member from now on, even if it had
        finished (elastic clusters). True if that made it a member."""
        with self._lock:
            if self._last_seen[worker] and worker not in self._finished:
                return False
            self._finished.discard(worker)
            self._forget_live()
            now = self._last_seen[worker] = self._clock()
            self._changes.append(MembershipChange(worker, Change.JOINED, step, now))
            return True

    def record(self, worker: int, change: Change, step: int) -> None:
        """Keep a change of membership the task found (a worker presumed dead, or back)."""
        with self._lock:
            self._changes.append(MembershipChange(worker, change, step, self._clock()))

    @property
    def changes(self) -> list[MembershipChange]:
        """The last :data:`MEMBERSHIP_KEPT` changes of membership, oldest first."""
        with self._lock:
            return list(self._changes)

    def members(self) -> list[int]:
        """The workers that take part, finished or not: the cluster's, and those that joined."""
        with self._lock:
            return self._members()

    def _members(self) -> list[int]:
        if self.capacity == self.num_workers:
            return list(range(self.num_workers))
        return [w for w in range(self.capacity) if w < self.num_workers or self._last_seen[w]]

    @property
    def finished(self) -> list[int]:
        with self._lock:
            return sorted(self._finished)

    @property
    def all_finished(self) -> bool:
        """Whether every member finished."""
        with self._lock:
            return all(w in self._finished for w in self._members())

    def presumed_dead(self) -> list[int] | None:
        """The unfinished workers, if some finished and every unfinished one is
        presumed dead (silent for ``worker_timeout``; the chief for ``chief_timeout``);
        else None (also when nobody is left unfinished)."""
        now = self._clock()
        with self._lock:
            if not self._finished:
                return None
            unfinished = [w for w in self._members() if w not in self._finished]
            dead = [w for w in unfinished if self._silent_for(w, now) > self._timeout_of(w)]
        return dead if unfinished and dead == unfinished else None

    def waiting_for_chief(self) -> float | None:
        """Seconds the chief has been silent, if it alone keeps training from being
        over (some workers finished, every other unfinished one presumed dead,
        the chief silent for longer than ``worker_timeout`` but not ``chief_timeout``); else None."""
        now = self._clock()
        with self._lock:
            if not self._finished or 0 in self._finished:
                return None
            others = [w for w in self._members() if w and w not in self._finished]
            if any(self._silent_for(w, now) <= self.worker_timeout for w in others):
                return None
            silent = self._silent_for(0, now)
        return silent if self.worker_timeout < silent <= self.chief_timeout else None

    def live(self) -> list[int]:
        """The workers neither finished nor silent for over ``worker_timeout`` (the chief too: for
        bounded staleness, a silent worker makes no progress to wait for)."""
        with self._lock:
            return list(self._live(self._clock()))

    def live_snapshot(self) -> tuple[int, ...]:
        """:meth:`live`, without taking the lock while nothing changed: for counting, not deciding.

        The snapshot is taken again once a worker of it may have gone silent past
        ``worker_timeout``, after :data:`LIVE_SNAPSHOT_MAX_AGE` seconds, and at once when a
        worker finishes, joins, or comes back with a call to this process. So it is
        exact but for one case: a silent worker heard from again only by another serving
        process of the task counts as live up to :data:`LIVE_SNAPSHOT_MAX_AGE` late.
        """
        snapshot = self._live_snapshot
        if self._clock() < snapshot.until:
            return snapshot.workers
        with self._lock:
            now = self._clock()
            workers = self._live(now)
            # A worker in a call now is live for worker_timeout at least; one not in a
            # call, until worker_timeout after its last word (unless it speaks again).
            quiet = [float(self._last_seen[w]) for w in workers if not self._in_flight[w]]
            soonest = now + min(LIVE_SNAPSHOT_MAX_AGE, self.worker_timeout)
            self._live_snapshot = _LiveSnapshot(
                workers, min([soonest, *(seen + self.worker_timeout for seen in quiet)])
            )
        return workers

    def _live(self, now: float) -> tuple[int, ...]:
        return tuple(
            w for w in self._members() if w not in self._finished and self._silent_for(w, now) <= self.worker_timeout
        )

    def _forget_live(self) -> None:
        """The live workers changed: the next :meth:`live_snapshot` takes a new one (hold the lock)."""
        self._live_snapshot = _LiveSnapshot((), float("-inf"))

    def silent_for(self, worker: int) -> float:
        """Seconds since ``worker`` was last heard from (0 while one of its calls runs)."""
        with self._lock:
            return self._silent_for(worker, self._clock())

    def _timeout_of(self, worker: int) -> float:
        return self.chief_timeout if worker == 0 else self.worker_timeout

    def _silent_for(self, worker: int, now: float) -> float:
        """Seconds since ``worker`` was last heard from (0 while one of its calls runs); hold the lock."""
        return 0.0 if self._in_flight[worker] else now - self._last_seen[worker]

    def seen(self) -> list[tuple[int, float, bool]]:
        """(worker, seconds since last heard from or -1 if never, finished) for each worker."""
        now = self._clock()
        with self._lock:
            return [
                (
                    w,
                    (0.0 if self._in_flight[w] else now - self._last_seen[w])
                    if self._last_seen[w] > self._started
                    else -1.0,
                    w in self._finished,
                )
                for w in self._members()
            ]

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
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator

import numpy


def default_chief_timeout(worker_timeout: float) -> float:
    """How long a ps task waits for a silent chief when not told: ten times ``worker_timeout``."""
    return 10.0 * worker_timeout


class WorkerRoster:
    """The workers of one ps task.

    Args:
        num_workers: the workers of the cluster.
        worker_timeout: once some workers finished, seconds of silence after
            which an unfinished worker other than the chief is presumed dead.
        last_seen: when each worker was last heard from (``time.monotonic()``,
            one float64 per worker), shared with the task's other serving
            processes (:mod:`psframe.ps.shared_store`); this roster's own by default.
        chief_timeout: seconds of silence after which the chief too is
            presumed dead (default: ten times ``worker_timeout``); never less
            than ``worker_timeout``.

    Raises:
        ValueError: ``chief_timeout`` is shorter than ``worker_timeout``.
    """

    def __init__(
        self,
        num_workers: int,
        worker_timeout: float,
        last_seen: numpy.ndarray | None = None,
        chief_timeout: float | None = None,
    ) -> None:
        if chief_timeout is None:
            chief_timeout = default_chief_timeout(worker_timeout)
        if not chief_timeout >= worker_timeout:
            raise ValueError(
                f"chief_timeout ({chief_timeout}) must be >= worker_timeout ({worker_timeout}): "
                f"the chief is waited for longer than any other worker"
            )
        self.num_workers = num_workers
        self.worker_timeout = worker_timeout
        self.chief_timeout = chief_timeout
        self._lock = threading.Lock()
        self._started = time.monotonic()
        if last_seen is None:  # shared ones start at their creator's start
            last_seen = numpy.full(num_workers, self._started)
        self._last_seen = last_seen
        self._in_flight: collections.Counter[int] = collections.Counter()
        self._finished: set[int] = set()

    @contextlib.contextmanager
    def call(self, worker: int) -> Iterator[None]:
        """Mark a worker as alive for as long as one of its calls runs."""
        with self._lock:
            self._in_flight[worker] += 1
            self._last_seen[worker] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[worker] -= 1
                self._last_seen[worker] = time.monotonic()

    def finish(self, worker: int) -> bool:
        """Record that a worker finished; True the first time."""
        with self._lock:
            if worker in self._finished:
                return False
            self._finished.add(worker)
            return True

    @property
    def finished(self) -> list[int]:
        with self._lock:
            return sorted(self._finished)

    @property
    def all_finished(self) -> bool:
        with self._lock:
            return len(self._finished) == self.num_workers

    def presumed_dead(self) -> list[int] | None:
        """The unfinished workers, if some finished and every unfinished one is
        presumed dead (silent for ``worker_timeout``; the chief for ``chief_timeout``);
        else None (also when nobody is left unfinished)."""
        now = time.monotonic()
        with self._lock:
            if not self._finished:
                return None
            unfinished = [w for w in range(self.num_workers) if w not in self._finished]
            dead = [w for w in unfinished if self._silent_for(w, now) > self._timeout_of(w)]
        return dead if unfinished and dead == unfinished else None

    def waiting_for_chief(self) -> float | None:
        """Seconds the chief has been silent, if it alone keeps training from being
        over (some workers finished, every other unfinished one presumed dead,
        the chief silent for longer than ``worker_timeout`` but not ``chief_timeout``); else None."""
        now = time.monotonic()
        with self._lock:
            if not self._finished or 0 in self._finished:
                return None
            others = [w for w in range(1, self.num_workers) if w not in self._finished]
            if any(self._silent_for(w, now) <= self.worker_timeout for w in others):
                return None
            silent = self._silent_for(0, now)
        return silent if self.worker_timeout < silent <= self.chief_timeout else None

    def live(self) -> list[int]:
        """The workers neither finished nor silent for over ``worker_timeout`` (the chief too: for
        bounded staleness, a silent worker makes no progress to wait for)."""
        now = time.monotonic()
        with self._lock:
            return [
                w
                for w in range(self.num_workers)
                if w not in self._finished and self._silent_for(w, now) <= self.worker_timeout
            ]

    def silent_for(self, worker: int) -> float:
        """Seconds since ``worker`` was last heard from (0 while one of its calls runs)."""
        with self._lock:
            return self._silent_for(worker, time.monotonic())

    def _timeout_of(self, worker: int) -> float:
        return self.chief_timeout if worker == 0 else self.worker_timeout

    def _silent_for(self, worker: int, now: float) -> float:
        """Seconds since ``worker`` was last heard from (0 while one of its calls runs); hold the lock."""
        return 0.0 if self._in_flight[worker] else now - self._last_seen[worker]

    def seen(self) -> list[tuple[int, float, bool]]:
        """(worker, seconds since last heard from or -1 if never, finished) for each worker."""
        now = time.monotonic()
        with self._lock:
            return [
                (
                    w,
                    (0.0 if self._in_flight[w] else now - self._last_seen[w])
                    if self._last_seen[w] > self._started
                    else -1.0,
                    w in self._finished,
                )
                for w in range(self.num_workers)
            ]

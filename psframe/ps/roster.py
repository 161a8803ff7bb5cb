"""Which workers a ps task has heard from, which are busy, which finished. No network.

A ps task exits once every worker finished; a worker killed for good never
finishes, so once some have, the others must show signs of life (a call in
progress, or one within ``worker_timeout`` seconds) to be waited for.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time

import numpy
from collections.abc import Iterator


class WorkerRoster:
    """The workers of one ps task.

    Args:
        num_workers: the workers of the cluster.
        worker_timeout: once some workers finished, seconds of silence after
            which an unfinished one is presumed dead.
        last_seen: when each worker was last heard from (``time.monotonic()``,
            one float64 per worker), shared with the task's other serving
            processes (:mod:`psframe.ps.shared`); this roster's own by default.
    """

    def __init__(self, num_workers: int, worker_timeout: float, last_seen: numpy.ndarray | None = None) -> None:
        self.num_workers = num_workers
        self.worker_timeout = worker_timeout
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
        """The unfinished workers, if some finished and all of those are silent; else None."""
        now = time.monotonic()
        with self._lock:
            if not self._finished:
                return None
            unfinished = [w for w in range(self.num_workers) if w not in self._finished]
            silent = [w for w in unfinished
                      if not self._in_flight[w] and now - self._last_seen[w] > self.worker_timeout]
        return silent if silent == unfinished else None

    def seen(self) -> list[tuple[int, float, bool]]:
        """(worker, seconds since last heard from or -1 if never, finished) for each worker."""
        now = time.monotonic()
        with self._lock:
            return [
                (w, (0.0 if self._in_flight[w] else now - self._last_seen[w]) if self._last_seen[w] > self._started
                 else -1.0,
                 w in self._finished)
                for w in range(self.num_workers)
            ]

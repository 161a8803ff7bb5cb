"""Which callers a ps task admits, which workers take part, and when training is over.

- Admission (:meth:`Membership.check_caller`): a caller of this task's
  cluster, of the job and a task index it expects; in an elastic cluster
  (``max_workers``), a worker of any cluster with the same ps tasks and a
  slot this task has; never a worker of a layout a re-layout left.
- Membership: workers join (GetInfo with ``joining``), finish (Finish), and,
  in an elastic cluster, are presumed dead when silent and taken back when
  heard from again; the synchronous rounds follow the live workers
  (:class:`Rounds`). The rules of who is waited for are the roster's
  (:mod:`psframe.ps.protocol.roster`).
- The end of training: :meth:`Membership.tick` (the server's loop, every tenth
  of a second) follows the workers and ends training once every worker
  finished or the others are presumed dead; :meth:`Membership.training_over`
  only says whether it is.
- Waits said: until training begins here (the model held and a worker heard
  from), :meth:`Membership.tick` says at WARNING whom the task waits for (the
  chief, for the model; or the workers), after a few seconds and then now and
  then, so that a task started with no logging set up (Python's default:
  WARNING and above on stderr) is never silent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError
from psframe.ps.elastic.relayout import Relayout
from psframe.ps.protocol.roster import Change, WorkerRoster
from psframe.ps.service.place import TaskPlace
from psframe.ps.store import VariableStore
from psframe.wire import messages
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)

# How often a ps task waiting for a silent chief says so.
CHIEF_LOG_EVERY_S = 5.0
# A ps task waiting for training to begin says so after WAIT_SAID_AFTER_S, then again after
# WAIT_SAID_EVERY_S, the gaps doubling up to WAIT_SAID_MAX_S.
WAIT_SAID_AFTER_S = 2.0
WAIT_SAID_EVERY_S = 5.0
WAIT_SAID_MAX_S = 60.0


class Rounds(Protocol):
    """What follows the workers: the synchronous rounds (:class:`~psframe.ps.service.served_model.ServedModel`)."""

    def follow(self, live: set[int]) -> None:
        """Wait for the ``live`` workers only (elastic clusters)."""

    def worker_finished(self, worker: int) -> None:
        """Wait no longer for ``worker``: it finished."""


class Membership:
    """The callers a ps task admits, its workers' comings and goings, and the end of training.

    Args:
        roster: the workers heard from, busy and finished.
        relayout: the re-layouts this task took (a worker of the layout before is refused).
        place: the task's cluster, as it is now.
        store: the variables (their global step marks each change of membership).
        all_finished: set once training is over.
        rounds: what follows the live and finished workers.
        task_name: the task.
        elastic: workers may join up to ``max_workers`` slots, and leave.
        max_workers: the worker slots.
        worker_timeout: seconds after which a silent worker is presumed dead.
    """

    def __init__(
        self,
        roster: WorkerRoster,
        relayout: Relayout,
        place: TaskPlace,
        store: VariableStore,
        all_finished: threading.Event,
        rounds: Rounds,
        *,
        task_name: str,
        elastic: bool,
        max_workers: int,
        worker_timeout: float,
    ) -> None:
        self._roster, self._relayout, self._place, self._store = roster, relayout, place, store
        self._all_finished, self._rounds = all_finished, rounds
        self._task_name, self._elastic, self._max_workers = task_name, elastic, max_workers
        self._worker_timeout = worker_timeout
        self._live: set[int] = set()  # elastic: the workers live when last looked (_follow)
        self._lock = threading.Lock()
        self._next_chief_log = 0.0
        self._began = False  # training began here: the model held, a worker heard from
        self._waiting_since = time.monotonic()
        self._next_wait_line, self._wait_gap = self._waiting_since + WAIT_SAID_AFTER_S, WAIT_SAID_EVERY_S

    # ---- admission

    def check_caller(self, caller: pb.Caller, job_name: str = "worker") -> None:
        """Admit a call from ``caller`` of ``job_name``, or refuse it.

        Raises:
            LayoutChangedError: a worker of a layout before a re-layout, with where to go.
            ClusterMismatchError: a caller of another cluster, job or task index.
        """
        self._relayout.check_caller(caller)  # a worker of the layout before: refused, with where to go
        if job_name == "worker" and self._joins(caller):
            return
        cluster = self._place.cluster
        if caller.cluster_fingerprint != cluster.fingerprint:
            raise ClusterMismatchError(
                f"{ClusterSpec.caller_name(caller.job_name, caller.task_index)} was started with a different "
                f"cluster (fingerprint {caller.cluster_fingerprint or 'none'}) than {self._task_name}, "
                f"whose cluster is {cluster.to_string()!r} (fingerprint {cluster.fingerprint}); "
                f"{messages.SAME_CLUSTER}"
            )
        if caller.job_name != job_name or not 0 <= caller.task_index < cluster.num_tasks(job_name):
            caller_name = ClusterSpec.caller_name(caller.job_name, caller.task_index)
            raise ClusterMismatchError(
                f"{self._task_name} expects this call from /job:{job_name}/task:0.."
                f"{cluster.num_tasks(job_name) - 1}, not {caller_name}"
            )

    def same_cluster(self, caller: pb.Caller) -> bool:
        """Whether the caller was given this task's cluster: the same, or (elastic) one with the
        same ps tasks, or the one before a re-layout (it asks where the ps tasks went)."""
        cluster = self._place.cluster
        return (
            caller.cluster_fingerprint == cluster.fingerprint
            or (self._elastic and caller.ps_fingerprint == cluster.ps_fingerprint)
            or (caller.cluster_fingerprint == self._relayout.before)
        )

    def _joins(self, caller: pb.Caller) -> bool:
        """Whether an elastic task takes this worker: the same ps tasks, a slot it has."""
        return (
            self._elastic
            and caller.job_name == "worker"
            and caller.ps_fingerprint == self._place.cluster.ps_fingerprint
            and 0 <= caller.task_index < self._max_workers
        )

    def _accepts_worker(self, caller: pb.Caller) -> bool:
        return caller.job_name == "worker" and (
            caller.cluster_fingerprint == self._place.cluster.fingerprint or self._joins(caller)
        )

    # ---- workers come and go

    def heard(self, request: pb.InfoRequest) -> None:
        """A GetInfo call: a worker that asks is alive, and one ``joining`` an elastic cluster joins."""
        caller = request.caller
        if not self._accepts_worker(caller):
            return
        worker = caller.task_index
        if request.joining and self._elastic and self._roster.join(worker, self._store.global_step):
            log.info("%s: worker %d joined at step %d", self._task_name, worker, self._store.global_step)
        with self._roster.call(worker, self._store.global_step):  # a worker waiting for us is alive
            pass
        if self._elastic:
            self._follow()

    def finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        """The Finish handler: a worker is done; training is over once every one is."""
        self.check_caller(request.caller)
        worker, roster = request.caller.task_index, self._roster
        if roster.finish(worker, self._store.global_step):
            log.info(
                "%s: worker %d finished (%d of %d)",
                self._task_name,
                worker,
                len(roster.finished),
                len(roster.members()),
            )
        done = len(roster.finished)
        self._left(worker)
        return pb.FinishResponse(finished_workers=done, num_workers=len(roster.members()))

    def take_finished(self, workers: Iterable[int]) -> None:
        """The workers that had finished before a re-layout have finished here too (and leave its rounds)."""
        for worker in sorted({*workers, *self._roster.finished}):
            self._roster.finish(worker, self._store.global_step)
            self._left(worker)

    def _left(self, worker: int) -> None:
        """A worker finished: the rounds no longer wait for it, and the task ends once every one has."""
        self._rounds.worker_finished(worker)
        if self._elastic:
            self._follow()
        if self._roster.all_finished:
            self._all_finished.set()

    # ---- the end of training

    def tick(self) -> None:
        """Follow the workers (the server calls this every tenth of a second): end training once
        every worker finished, or once some finished and the others are presumed dead (a worker
        killed for good must not keep the ps alive forever; the chief is waited for longer: see
        :mod:`psframe.ps.protocol.roster`), saying so now and then while the chief is waited for."""
        if self._all_finished.is_set():
            return
        if self._elastic:
            self._follow()
        self._say_waiting()
        roster = self._roster
        dead = roster.presumed_dead()
        if dead is None:
            self._log_waiting_for_chief()
            return
        log.warning(
            "%s: workers %s finished; %s presumed dead (silent for over %gs, the chief %gs); training is over",
            self._task_name,
            roster.finished,
            dead,
            self._worker_timeout,
            roster.chief_timeout,
        )
        self._all_finished.set()

    def training_over(self) -> bool:
        """Whether training is over (every worker finished, or the others are presumed dead)."""
        return self._all_finished.is_set()

    def _say_waiting(self) -> None:
        """Until training begins here, say whom the task waits for: the chief, to send the model (it
        creates it, or moves it here), or, the model held (restored), the workers, to connect."""
        if self._began:
            return
        ready = self._store.ready
        heard = [w for w, ago, _ in self._roster.seen() if ago >= 0]
        now = time.monotonic()
        self._began = ready and bool(heard)
        if self._began or now < self._next_wait_line or (not ready and self._roster.silent_for(0) == 0):
            return  # begun, said lately, or the chief's call runs (the model arriving)
        self._next_wait_line, self._wait_gap = now + self._wait_gap, min(2 * self._wait_gap, WAIT_SAID_MAX_S)
        cluster, waited = self._place.cluster, now - self._waiting_since

        def named(worker: int) -> str:
            name = ClusterSpec.task_name("worker", worker)
            return f"{name} at {cluster.task_address('worker', worker)}" if worker < cluster.num_workers else name

        if not ready:
            heard_from = ", ".join(map(named, heard)) or "none"
            line = f"waiting for {named(0)} (the chief) to send the model ({waited:.0f}s so far; "
            line += f"workers heard from: {heard_from})"
        else:
            workers = ", ".join(map(named, self._roster.members()))
            line = f"holds the model; waiting for {workers} to connect ({waited:.0f}s so far)"
        log.warning("%s: %s", self._task_name, line)

    def _log_waiting_for_chief(self) -> None:
        silent = self._roster.waiting_for_chief()
        now = time.monotonic()
        if silent is None or now < self._next_chief_log:
            return
        self._next_chief_log = now + CHIEF_LOG_EVERY_S
        log.warning(
            "%s: every other worker finished or is presumed dead; waiting for the chief (%s), "
            "silent for %.0fs, up to %gs (chief_timeout)",
            self._task_name,
            ClusterSpec.task_name("worker", 0),
            silent,
            self._roster.chief_timeout,
        )

    def _follow(self) -> None:
        """Elastic clusters: record the workers presumed dead and those back, and let the
        sync rounds follow the live workers."""
        with self._lock:
            self._follow_locked()

    def _follow_locked(self) -> None:
        roster = self._roster
        live = set(roster.live())
        self._rounds.follow(live)
        if live == self._live:
            return
        step = self._store.global_step
        finished = set(roster.finished)
        for worker in sorted(self._live - live - finished):
            roster.record(worker, Change.PRESUMED_DEAD, step)
            log.warning(
                "%s: worker %d silent for over %gs; presumed dead at step %d (taken back if it returns)",
                self._task_name,
                worker,
                self._worker_timeout,
                step,
            )
        for worker in sorted(live - self._live):
            if self._was_presumed_dead(worker):
                roster.record(worker, Change.RETURNED, step)
                log.info("%s: worker %d is back at step %d", self._task_name, worker, step)
        self._live = live

    def _was_presumed_dead(self, worker: int) -> bool:
        last = None
        for change in self._roster.changes:
            if change.worker == worker:
                last = change.change
        return last is Change.PRESUMED_DEAD

"""The synchronous barrier of one ps task (SyncReplicas): plain torch, no network.

Each push carries the global step the worker computed its gradients at.
For the ps's current step ``s`` a *round* gathers gradients:

- a push for a step older than ``s`` is stale: dropped, counted, and the
  worker gets the current values at once (so is one for a newer step, which
  happens after this ps rolled back to a checkpoint);
- a push for ``s`` joins the round; a worker's contribution is complete once
  it has sent a gradient for every variable this ps holds;
- the round's *members* are the first ``R`` workers to complete their
  contribution on ps 0, where ``R`` is ``replicas_to_aggregate`` (or the number
  of workers still training, if fewer remain; in an elastic cluster, what the
  ``required`` rule makes of the live workers: see :meth:`SyncAggregator.follow`). ps 0 decides; every other ps
  asks ps 0 (the ``decide`` callback) so that all shards average the same
  workers. A worker that is not a member is late: its gradients are dropped;
- once every member's contribution is in, the gradients are summed in
  task-index order, divided by the number of members
  (:mod:`psframe.ps.protocol.round_mean`: over whole messages where the
  members' messages are laid out alike), applied with the optimizer in one
  step, and the global step advances by one. Everyone
  waiting on the round is released with the new values. An embedding
  table's contribution is the rows a worker touched (maybe none): the
  members' rows are put together in task-index order, rows that repeat
  summed, divided by the number of members, and applied by the table
  optimizer, to those rows only.

A checkpoint takes every ps task's part at one round: the aggregator's cut
(:class:`psframe.ps.protocol.round_cut.RoundCut`, :attr:`SyncAggregator.cut`)
holds rounds back, reaches the latest round of any ps task, and releases them
(:class:`psframe.ps.protocol.cut.Cut`, the interface of both kinds of cut).

Every wait has a deadline; when it runs out the error names the step, the
workers that arrived and the ones missing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from psframe.cluster import ClusterSpec
from psframe.errors import BarrierTimeoutError, PsframeError, RemoteError
from psframe.ps.protocol.round_cut import RoundCut
from psframe.ps.protocol.round_mean import Contribution, GradientSpan, RoundMean, mean_rows
from psframe.ps.store import VariableStore
from psframe.ps.store.table_parts import RowPush

log = logging.getLogger(__name__)

# The longest a wait sleeps before it reads its clock again (a clock a test moves by hand too).
_WAIT_SLICE = 0.05

# How many past decisions ps 0 remembers for the other ps tasks to ask about.
DECISIONS_KEPT = 1024

Decide = Callable[[int, float], tuple[int, ...]]


@dataclass
class _Round:
    step: int
    contributions: dict[int, Contribution] = field(default_factory=dict)  # by worker
    completed: list[int] = field(default_factory=list)  # in order of completion
    members: tuple[int, ...] | None = None
    late: set[int] = field(default_factory=set)  # pushed after the members were chosen
    asking: bool = False  # a thread is asking ps 0 for the members
    failure: PsframeError | None = None  # asking ps 0 failed


class SyncAggregator:
    """Gathers the gradients of one step from several workers and applies their mean.

    Args:
        store: the ps task's variables; its lock guards the round too.
        num_workers: total_num_replicas, the workers that take part.
        replicas_to_aggregate: gradients per update.
        timeout: seconds any wait may last.
        decide: on ps tasks other than 0, asks ps 0 for the members of a step
            (``decide(step, timeout) -> workers``); None on ps 0, which decides.
        required: an elastic cluster's rule: the gradients a round averages, given
            how many workers are live (:meth:`psframe.SyncReplicas.required`); then
            ``replicas_to_aggregate`` is not checked against ``num_workers``, the
            workers live at the start.
        on_applied: called under the lock for each member whose push carried data
            progress, once its round is applied (``on_applied(worker, progress)``).
        async_parts: parts of embedding tables applied at once, outside the rounds
            (``SyncReplicas(async_tables=...)``): a contribution is complete without them.
        clock: what the deadlines are read from (seconds, monotonic).
    """

    def __init__(
        self,
        store: VariableStore,
        *,
        num_workers: int,
        replicas_to_aggregate: int,
        timeout: float,
        decide: Decide | None = None,
        required: Callable[[int], int] | None = None,
        on_applied: Callable[[int, Any], object] | None = None,
        async_parts: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if required is None and not 1 <= replicas_to_aggregate <= num_workers:
            raise ValueError(
                f"replicas_to_aggregate ({replicas_to_aggregate}) must be in 1..{num_workers} (total_num_replicas)"
            )
        self.store = store
        self.task_name = store.task_name
        self.num_workers = num_workers
        self.replicas_to_aggregate = replicas_to_aggregate
        self.timeout = timeout
        self._clock = clock  # the deadlines' (waits re-read it every _WAIT_SLICE of real time)
        self._decide = decide
        self._cond = threading.Condition(store.lock)
        self._round = _Round(store.global_step)
        self._decisions: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._live = set(range(num_workers))
        self._joining: set[int] = set()  # live from the next round on (joined, or resumed)
        self._paused: set[int] = set()  # no data for now (psframe.ps.protocol.data_ranges): not waited for
        self._left: set[int] = set()  # finished
        self._required_of = required or (lambda live: min(self.replicas_to_aggregate, live))
        self._on_applied = on_applied
        self.async_parts = frozenset(async_parts)
        self.dropped_gradients = 0
        # The cut of a checkpoint or a re-layout (psframe.ps.protocol.round_cut): rounds it holds wait.
        self.cut = RoundCut(self._cond, self.task_name, lambda: self._round.step, lambda: self._try_apply(self._round))
        self._abandoned: PsframeError | None = None  # a re-layout took its cut: every push gets this
        self._mean = RoundMean()  # the rounds' buffers of whole gradients' sums
        self._short: int | None = None  # the fewest gradients a round averaged since workers finished, as said

    # ---- what workers call

    def push(
        self,
        worker: int,
        step: int,
        grads: Mapping[str, torch.Tensor],
        *,
        count_drop: bool = True,
        wait: bool = True,
        rows: Sequence[RowPush] = (),
        progress: Any = None,
        span: GradientSpan | None = None,
    ) -> bool:
        """Add a worker's gradients for ``step`` and wait until that step is applied.

        A worker may send its gradients for one step in several pushes; each
        push returns once the step is over, or at once with ``wait=False``
        (the worker then waits on a later push of the same step).

        Args:
            worker: the worker's task index.
            step: the global step its gradients were computed at.
            grads: some or all of its gradients, by variable name.
            rows: gradients of embedding tables' rows, as ``(table, ids, rows)``.
            span: the span of the message ``grads`` lie in, where they all do (the round's
                sum then takes one operation for it: :mod:`psframe.ps.protocol.round_mean`).
            progress: how far into its range of data the step took the worker, recorded
                (``on_applied``) if the worker is a member of the round.
            count_drop: count this push if it is stale (once per worker step).
            wait: wait for the step to be applied.

        Returns:
            True if the gradients were dropped (stale or late), False if applied.

        Raises:
            BarrierTimeoutError: the step did not complete within the timeout.
            InvalidGradientError: a gradient does not fit (nothing was added).
        """
        ask = False
        started = self._clock()
        deadline = started + self.timeout
        with self._cond:
            if self._abandoned is not None:
                raise self._abandoned
            self.store.check_gradients(grads)
            self.store.check_rows(rows)
            current = self.store.global_step
            if step != current:
                # Older: stale. Newer: this ps rolled back to a checkpoint after
                # the worker pulled; its gradient fits no step here either way.
                if step > current:
                    log.warning(
                        "%s: worker %d pushed gradients for step %d, but this ps is at step %d "
                        "(restored from a checkpoint); dropped",
                        self.task_name,
                        worker,
                        step,
                        current,
                    )
                self.dropped_gradients += count_drop
                return True
            round_ = self._round
            if round_.members is not None and worker not in round_.members:
                round_.late.add(worker)
            else:
                mine = round_.contributions.setdefault(worker, Contribution())
                mine.add(grads, span)
                mine.rows.update((name, (ids, values)) for name, ids, values in rows)
                if progress is not None:
                    mine.progress = progress
                if len(mine) == self._parts_in_rounds() and worker not in round_.completed:
                    round_.completed.append(worker)
                    self._try_decide(round_)
                if wait and self._decide is not None and round_.members is None and not round_.asking:
                    round_.asking = ask = True
                    round_.failure = None
            if not ask:  # under the same hold of the lock: one hand-off fewer between the members' threads
                return self._settle(round_, worker, wait, started, deadline)
        self._ask_members(round_, deadline)
        with self._cond:
            return self._settle(round_, worker, wait, started, deadline)

    def worker_finished(self, worker: int) -> None:
        """A worker left: later steps need at most as many gradients as remain."""
        with self._cond:
            self._joining.discard(worker)
            self._left.add(worker)
            if worker not in self._live:
                return
            self._live.discard(worker)  # a round that then averages fewer than R says so (_say_short)
            self._try_decide(self._round)
            self._try_apply(self._round)
            self._cond.notify_all()

    def follow(self, live: set[int]) -> None:
        """An elastic cluster's live workers changed (joined, left, presumed dead, back).

        A worker gone leaves at once, so that the round no longer waits for it; one
        new takes part from the next round on (a step boundary, so that every
        round's count comes from the workers live at its start). ps 0 decides
        the members of each round, and every other ps task uses its decision.
        """
        with self._cond:
            live = live - self._paused
            gone = self._live - live
            self._live -= gone
            self._joining = live - self._live
            if gone:
                log.info(
                    "%s: workers %s left the sync rounds at step %d; each round now averages %d of %d",
                    self.task_name,
                    sorted(gone),
                    self._round.step,
                    self._required(),
                    len(self._live),
                )
                self._try_decide(self._round)
                self._try_apply(self._round)
                self._cond.notify_all()

    def pause(self, worker: int) -> None:
        """A worker has no data to train on for now (every range left is out with others):
        rounds stop waiting for it at once, until :meth:`resume`."""
        with self._cond:
            if worker in self._paused:
                return
            self._paused.add(worker)
            self._joining.discard(worker)
            if worker in self._live:
                self._live.discard(worker)
                self._try_decide(self._round)
                self._try_apply(self._round)
                self._cond.notify_all()

    def resume(self, worker: int) -> None:
        """A paused worker has data again: it takes part from the next round on."""
        with self._cond:
            if worker not in self._paused:
                return
            self._paused.discard(worker)
            if worker not in self._left:
                self._joining.add(worker)

    def was_member(self, worker: int, step: int) -> bool:
        """Whether ``worker``'s gradients were applied in the round of ``step`` (a past step
        of the last :data:`DECISIONS_KEPT`): a push of it sent again is no stale one."""
        with self._cond:
            return worker in self._decisions.get(step, ())

    # ---- a checkpoint's cut is :attr:`cut`'s (psframe.ps.protocol.round_cut), under this lock

    def abandon(self, error: PsframeError) -> None:
        """Give up the round under way (a re-layout took its cut): every push waiting in it raises
        ``error``, nothing of it applied. Call under the store's lock; the aggregator is not used again."""
        self._abandoned = self._round.failure = error
        self.cut.hold_for_good()  # never applied here
        self._cond.notify_all()

    # ---- what the other ps tasks ask ps 0

    def members_of(self, step: int, timeout: float | None = None) -> tuple[int, ...]:
        """The workers whose gradients make up ``step`` (ps 0 only); waits until decided.

        Raises:
            BarrierTimeoutError: not decided within the timeout.
            PsframeError: the step is too old to be remembered, or not ps 0.
        """
        if self._decide is not None:
            raise PsframeError(f"{self.task_name} does not decide the members of a step; ps 0 does")
        deadline = self._clock() + (self.timeout if timeout is None else timeout)
        with self._cond:
            while True:
                if step in self._decisions:
                    return self._decisions[step]
                if step < self._round.step:
                    raise PsframeError(f"{self.task_name} no longer remembers the members of step {step}")
                if step == self._round.step and self._round.members is not None:
                    return self._round.members
                if self._round.failure is not None:
                    raise self._round.failure
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._timeout_error(
                        self._round, step, deadline - (self.timeout if timeout is None else timeout)
                    )
                self._cond.wait(min(remaining, _WAIT_SLICE))

    # ---- the round, under the lock

    def _parts_in_rounds(self) -> int:
        """How many variables a worker's contribution holds once complete (the tables applied at
        once aside: ``async_parts`` are parts this task holds)."""
        return len(self.store.names) + len(self.store.dynamic_tables) - len(self.async_parts)

    def _required(self) -> int:
        return self._required_of(len(self._live))

    def _try_decide(self, round_: _Round) -> None:
        if self._decide is not None or round_.members is not None:
            return
        required = self._required()
        # Only a worker live at the round's start is a member: one that joins mid-round counts from the next.
        eligible = [w for w in round_.completed if w in self._live]
        if required and len(eligible) >= required:
            round_.members = tuple(sorted(eligible[:required]))
            self._cond.notify_all()

    def _ask_members(self, round_: _Round, deadline: float) -> None:
        decide = self._decide
        if decide is None:  # this is ps 0: it decides, nobody to ask
            return
        try:
            members = tuple(sorted(decide(round_.step, max(0.0, deadline - self._clock()))))
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the next push must ask again
            failure = (
                e
                if isinstance(e, PsframeError)
                else RemoteError(
                    f"{self.task_name} could not learn the members of step {round_.step} from /job:ps/task:0: {e!r}"
                )
            )
            with self._cond:
                round_.failure = self._abandoned or failure  # a re-layout's refusal says where to go
                round_.asking = False
                self._cond.notify_all()
            return
        with self._cond:
            round_.members = members
            self._cond.notify_all()

    def _try_apply(self, round_: _Round) -> None:
        if round_ is not self._round or round_.members is None or self.cut.held(round_.step):
            return
        if not all(w in round_.completed for w in round_.members):
            return
        members = round_.members
        tables = self.store.tables | self.store.dynamic_tables
        # Summed in task-index order: the result does not depend on arrival order.
        contributions = [round_.contributions[worker] for worker in members]
        dense = [name for name in self.store.names if name not in tables and name not in self.async_parts]
        rows = [
            mean_rows(name, [c.rows[name] for c in contributions])
            for name in [*self.store.names, *sorted(self.store.dynamic_tables)]
            if name in tables and name not in self.async_parts  # those applied at once, as each worker's rows came
        ]
        self.store.apply(self._mean.of(dense, contributions))
        self.store.apply_rows(rows)
        if self._on_applied is not None:
            for worker, contribution in zip(members, contributions):
                if contribution.progress is not None:
                    self._on_applied(worker, contribution.progress)
        new_step = self.store.advance_step()
        self._say_short(round_.step, len(members))
        late = (set(round_.contributions) | round_.late) - set(round_.members)
        self.dropped_gradients += len(late)
        self._decisions[round_.step] = round_.members
        while len(self._decisions) > DECISIONS_KEPT:
            self._decisions.popitem(last=False)
        self._round = _Round(new_step)
        if self._joining:
            self._live |= self._joining
            log.info(
                "%s: workers %s take part in the sync rounds from step %d; each round averages %d of %d",
                self.task_name,
                sorted(self._joining),
                new_step,
                self._required(),
                len(self._live),
            )
            self._joining = set()
        self._cond.notify_all()

    def _say_short(self, step: int, members: int) -> None:
        """Warn when a round averages fewer than ``replicas_to_aggregate`` gradients because workers
        finished while others still train (once, and again if fewer still): not at a clean end,
        where the workers finish together and no round follows."""
        if members >= self.replicas_to_aggregate or not self._left:
            self._short = None
        elif self._short is None or members < self._short:
            self._short = members
            log.warning(
                "%s: %d workers still training, fewer than replicas_to_aggregate=%d; "
                "from step %d each update averages the gradients of %d",
                self.task_name,
                len(self._live),
                self.replicas_to_aggregate,
                step,
                members,
            )

    def _settle(self, round_: _Round, worker: int, wait: bool, started: float, deadline: float) -> bool:
        """Apply the round if it is complete; with ``wait``, wait until it is applied and say whether
        ``worker``'s gradients were dropped (it was no member, known once the round was applied)."""
        self._try_apply(round_)
        if not wait:
            return False
        self._wait_until_applied(round_, started, deadline)
        return worker not in (round_.members or ())

    def _wait_until_applied(self, round_: _Round, started: float, deadline: float) -> None:
        while self._round is round_:
            if round_.failure is not None:
                raise round_.failure
            now = self._clock()
            remaining = deadline - now
            if remaining <= 0:
                # The round stays open: a worker that comes back can still complete it.
                raise self._timeout_error(round_, round_.step, started)
            if self.cut.held(round_.step):  # a checkpoint's hold: applied once it ends, at the latest
                remaining = min(remaining, self.cut.held_until - now)
            self._cond.wait(min(remaining, _WAIT_SLICE))
            self._try_apply(round_)

    def _timeout_error(self, round_: _Round, step: int, started: float) -> BarrierTimeoutError:
        arrived = sorted(round_.completed)
        if round_.members is not None:
            missing = [w for w in round_.members if w not in round_.completed]
            wanted = f"the {len(round_.members)} chosen workers {list(round_.members)}"
        else:
            missing = sorted(self._live - set(round_.completed))
            wanted = f"{self._required()} of {self.num_workers} workers"
            if self._decide is not None:
                wanted += " (ps 0 had not said which)"
        return BarrierTimeoutError(
            f"sync step {step} on {self.task_name}: waited {self._clock() - started:.1f}s for "
            f"{wanted}; arrived: {_workers(arrived)}; missing: {_workers(missing)}"
        )


def _workers(indices: list[int]) -> str:
    return ", ".join(ClusterSpec.task_name("worker", i) for i in indices) or "none"

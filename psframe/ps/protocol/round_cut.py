"""A checkpoint's cut of the synchronous rounds of one ps task: plain Python, no network.

A checkpoint takes every ps task's part at one round: :meth:`RoundCut.hold`
stops rounds from being applied here (pushes still join them) and says the
round this ps task is at; the ps tasks differ by at most one round, since a
worker computes a step only once every ps task answered the one before.
:meth:`RoundCut.reach` then applies rounds up to the latest of them, the
snapshot is taken there (:meth:`RoundCut.check` right before it, under the
store's lock), and :meth:`RoundCut.release` lets rounds go on. A hold ends by
itself after its seconds, so a chief lost between the two never stalls
training for long. A re-layout's cut holds the round under way for good
(:meth:`RoundCut.hold_for_good`): the rounds are not used again.

The rounds themselves are :class:`psframe.ps.protocol.sync.SyncAggregator`'s;
it holds one :class:`RoundCut` and asks it, under its lock, whether a round may
be applied (:meth:`RoundCut.held`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from psframe.errors import CheckpointCutError


class RoundCut:
    """The cut of a checkpoint (or of a re-layout) over the rounds of one aggregator: a
    :class:`~psframe.ps.protocol.cut.Cut` whose point is a global step.

    Args:
        cond: the aggregator's condition, over the store's lock: every round is applied under it.
        task_name: the task, for the errors.
        step: the step of the round under way (read under ``cond``).
        apply: apply the round under way if it is complete and not held (called under ``cond``).
    """

    def __init__(
        self, cond: threading.Condition, task_name: str, step: Callable[[], int], apply: Callable[[], None]
    ) -> None:
        self._cond = cond
        self._task_name = task_name
        self._step = step
        self._apply = apply
        # Rounds of step _held_from and later wait, until _held_until (monotonic).
        self._held_from: int | None = None
        self._held_until = 0.0
        self._reached: int | None = None  # the point of the last reach, which check holds it to

    @property
    def held_until(self) -> float:
        """When the hold ends by itself (monotonic); meaningful while :meth:`held`."""
        return self._held_until

    def held(self, step: int) -> bool:
        """Whether the round of ``step`` waits (a hold from it or an earlier step, not yet ended)."""
        return self._held_from is not None and step >= self._held_from and time.monotonic() < self._held_until

    def hold(self, seconds: float) -> int:
        """Stop applying rounds, for at most ``seconds``; the step of the round this ps task is at."""
        with self._cond:
            step = self._step()
            self._held_from = step
            self._held_until = time.monotonic() + seconds
            return step

    def reach(self, step: int) -> None:
        """Apply rounds until the global step is ``step``, then hold the rest (the caller snapshots
        then, under the store's lock, and calls :meth:`release`).

        Raises:
            CheckpointCutError: the hold ended first, or this ps task is past ``step`` already.
        """
        with self._cond:
            self._check_held()
            if self._step() > step:
                raise CheckpointCutError(
                    f"{self._task_name} is at sync step {self._step()}, past the checkpoint's cut at {step}"
                )
            self._held_from = self._reached = step
            self._apply()
            self._cond.notify_all()
            while self._step() < step:
                self._check_held()
                self._cond.wait(max(0.0, self._held_until - time.monotonic()))
                self._apply()

    def check(self) -> None:
        """Raise unless rounds are still held at the global step :meth:`reach` reached (under the
        store's lock, right before a snapshot).

        Raises:
            CheckpointCutError: the hold ended, or the step moved.
        """
        with self._cond:
            self._check_held()
            step = self._reached
            if step is None or self._step() != step:
                raise CheckpointCutError(f"{self._task_name} moved past the checkpoint's cut at sync step {step}")

    def release(self) -> None:
        """Let rounds be applied again (after the snapshot, or after a failed one)."""
        with self._cond:
            self._held_from = self._reached = None
            self._apply()
            self._cond.notify_all()

    def hold_for_good(self) -> None:
        """Hold the round under way and every later one, with no end (a re-layout took its cut:
        the rounds are not used again). Call under the store's lock."""
        self._held_from, self._held_until = self._step(), float("inf")

    def _check_held(self) -> None:
        if self._held_from is None or time.monotonic() >= self._held_until:
            raise CheckpointCutError(
                f"{self._task_name} could not take the checkpoint's cut: its hold on rounds ended before the save "
                f"(a hold lasts at most its seconds)"
            )

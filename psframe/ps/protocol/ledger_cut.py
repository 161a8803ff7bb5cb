"""A checkpoint's cut over the push ledger, in asynchronous training. No network.

Every ps task saves its part of a checkpoint at its own instant; the parts
fit together only if each holds the same steps of every worker. The chief
asks every task to hold pushes back (:meth:`LedgerCut.hold`: each says the
steps of each worker begun there), then to let each worker through to the
highest of those (:meth:`LedgerCut.reach`), and each task checks, under the
store's lock its snapshot is taken under, that nothing went past
(:meth:`LedgerCut.check`). The hold ends with the save (:meth:`LedgerCut.release`)
or by itself after :data:`MAX_HOLD_SECONDS`: a chief lost between hold and
save, or a worker lost mid-step, never stalls training longer. Pushes held
back wait their turn (:meth:`LedgerCut.wait_turn`).

:class:`PushesHeld` is what a checkpoint keeps of the pushes its values hold.
"""

from __future__ import annotations

import time
from typing import Any

from psframe import errors
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster

# The longest a checkpoint's cut holds pushes back: a chief lost between hold and save, or a
# worker lost mid-step, never stalls training longer.
MAX_HOLD_SECONDS = 10.0
# A worker whose begun step the cut waits for, silent here this long (no call of its in progress),
# is taken for lost (killed, cut off): the cut gives up at once rather than hold everyone to the deadline.
CUT_SILENCE_SECONDS = 1.0
_HOLD_POLL_SECONDS = 0.001


def hold_seconds(asked: float) -> float:
    """How long a hold asked for ``asked`` seconds lasts: a tenth of a second to :data:`MAX_HOLD_SECONDS`."""
    return min(max(asked, 0.1), MAX_HOLD_SECONDS)


class LedgerCut:
    """The cut of a checkpoint (or of a re-layout) over ``ledger``, whose pushes apply under
    ``lock`` (the store's): a :class:`~psframe.ps.protocol.cut.Cut` whose point is each worker's
    steps begun.

    Args:
        ledger: each worker's pushes applied here.
        lock: the store's lock (reentrant, of this process or shared), held while a push applies.
        roster: when each worker was last heard from here (a worker silent too long is lost).
        task_name: the task, for the errors.
    """

    def __init__(self, ledger: PushLedger, lock: Any, roster: WorkerRoster, task_name: str) -> None:
        self._ledger, self._lock, self._roster, self._task_name = ledger, lock, roster, task_name

    def hold(self, seconds: float) -> list[int]:
        """Hold every worker's pushes back for ``seconds`` at most (call under the store's lock);
        returns the steps of each worker begun here."""
        return self._ledger.hold(seconds)

    def reach(self, targets: list[int]) -> None:
        """Let each worker's pushes through until its ``targets`` steps are applied here (the
        pushes of steps another ps task had begun), then hold the rest; within the hold's deadline.

        Raises:
            CheckpointCutError: the hold ended first, or a worker the cut waits for is lost: the cut is lost.
        """
        with self._lock:
            self._check_held()
            self._ledger.set_targets(targets)
            while not self._ledger.reached():
                self._check_held()
                self._check_not_lost(targets)
                self._pause_lock()

    def check(self) -> None:
        """Raise unless the cut still holds: called under the store's lock, right before the snapshot.

        Raises:
            CheckpointCutError: the hold ended, or pushes went past the cut.
        """
        self._check_held()
        if not self._ledger.reached():
            raise errors.CheckpointCutError(f"{self._task_name}: pushes went past the checkpoint's cut; save again")

    def release(self) -> None:
        """End the hold: every push applies again."""
        with self._lock:
            self._ledger.release()

    def wait_turn(self, worker: int) -> None:
        """Wait (holding the store's lock again on return) until the cut lets ``worker``'s push
        apply: the hold ends by the cut's deadline at the latest."""
        while not self._ledger.admits(worker):
            self._pause_lock()

    def _pause_lock(self) -> None:
        """Let go of the store's lock (held once) for a moment, so that pushes can apply, and take it back."""
        lock = self._lock
        lock.release()
        try:
            time.sleep(_HOLD_POLL_SECONDS)
        finally:
            lock.acquire()

    def _check_not_lost(self, targets: list[int]) -> None:
        """Raise if a worker the cut waits for has been silent here too long to be on its way."""
        ledger = self._ledger
        for worker in range(min(ledger.num_workers, len(targets))):
            if ledger.applied_steps(worker) < targets[worker]:
                silent = self._roster.silent_for(worker)
                if silent > CUT_SILENCE_SECONDS:
                    raise errors.CheckpointCutError(
                        f"{self._task_name} could not take the checkpoint's cut: worker {worker} began a step on "
                        f"another ps task and has been silent here for {silent:.1f} s (lost, or cut off)"
                    )

    def _check_held(self) -> None:
        if not self._ledger.held():
            raise errors.CheckpointCutError(
                f"{self._task_name} could not take the checkpoint's cut: its hold ended (after at most "
                f"{MAX_HOLD_SECONDS:.0f} s) before the steps other ps tasks had begun arrived, or before the "
                f"save came; pushes went on, and the next save tries again"
            )


class PushesHeld:
    """What a checkpoint keeps of the pushes its values hold: the ledger's counts, and what they consumed of data."""

    def __init__(self, ledger: PushLedger, data: RangeQueue) -> None:
        self._ledger, self._data = ledger, data

    def state_dict(self) -> dict[str, list[int]]:
        return {**self._ledger.state_dict(), **self._data.state_dict()}

"""Which pushes of each worker a ps task has applied, so that each is applied once. No network.

A worker numbers its pushes to each ps task 1, 2, 3... in the order it sends
them (``PushPullHeader.push_id``). When its stream fails (the network cut,
a reply lost), the worker cannot know which of its unanswered pushes the
ps task applied; once it has reconnected it sends every one of them again,
in order, with the same numbers. The ps task keeps, per worker, the number
of the last push it applied:

- a push numbered above it is new: applied, and the number recorded;
- a push numbered at or below it is a duplicate: answered (with the values
  it pulls) but not applied again. Since a worker sends again from its
  first unanswered push, in order, everything up to the recorded number
  has been applied, and everything after has not;
- a push numbered 0 (a pull, or a caller that does not number) is always new.

Check and record happen under the store's lock, with the update, so two
copies of one push (the lost stream's and the new one's) never both apply.
The ledger lives in shared memory when the task serves from several
processes (:mod:`psframe.ps.serving.shared_store`: a worker's reconnected stream may
reach another process), and in checkpoints (a push whose effect a
checkpoint holds is a duplicate after a restore too).

In synchronous training a round applies a worker's gradient once whatever
it is sent (rounds are keyed by step and worker, :mod:`psframe.ps.protocol.sync`);
the ledger there only counts steps once.

The ledger also holds pushes back while the chief takes a checkpoint whose
parts are all of one cut (:meth:`PushLedger.hold`): each ps task stops
applying, says how many steps of each worker it has begun, and then applies
only the pushes of the steps some other ps task had begun, so that every
part holds the same steps of every worker.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy

LEDGER_ROWS = 5  # last push, steps applied, a step begun, the hold's target, its deadline (see PushLedger)
NOT_HELD = -1  # a worker's hold target: its pushes apply
HELD = -2  # its pushes wait, until a target says which


class PushLedger:
    """The last push applied, and the steps applied, for each worker of a ps task.

    Args:
        num_workers: the workers of the cluster.
        counts: int64 array of shape ``(4, num_workers)`` to keep them in
            (shared by a task's serving processes); this ledger's own by default.
            Row 0: the last push number applied; row 1: steps applied; row 2:
            1 while a step is begun (a push of it applied, not its last);
            row 3: the hold's target (:meth:`hold`); row 4, its first entry: when
            the hold ends by itself (``time.monotonic_ns``, one clock for every
            process of the host).
    """

    def __init__(self, num_workers: int, counts: numpy.ndarray | None = None) -> None:
        if counts is None:
            counts = numpy.zeros((LEDGER_ROWS, num_workers), dtype=numpy.int64)
            counts[3] = NOT_HELD
        if counts.shape != (LEDGER_ROWS, num_workers):
            raise ValueError(f"counts must have shape ({LEDGER_ROWS}, {num_workers}), got {counts.shape}")
        self.num_workers = num_workers
        self._last_push = counts[0]
        self._applied_steps = counts[1]
        self._in_step = counts[2]
        self._target = counts[3]
        self._deadline = counts[4][:1]

    def is_duplicate(self, worker: int, push_id: int) -> bool:
        """Whether push ``push_id`` of ``worker`` was applied already (hold the store's lock)."""
        return push_id != 0 and push_id <= self._last_push[worker]

    def record(self, worker: int, push_id: int, ends_step: bool, live: Sequence[int] = ()) -> int:
        """A push was applied (hold the store's lock since :meth:`is_duplicate`);
        ``ends_step``: it was the worker's last push of a step to this task.

        Returns:
            For a push that ends a step, how many steps ahead of the slowest of the
            ``live`` workers it found its worker (:meth:`steps_ahead`, before this
            step counts); else 0.
        """
        ahead = 0
        if push_id > self._last_push[worker]:
            self._last_push[worker] = push_id
        if ends_step:
            ahead = self.steps_ahead(worker, live)
            self._applied_steps[worker] += 1
        self._in_step[worker] = not ends_step
        return ahead

    def steps_ahead(self, worker: int, live: Sequence[int]) -> int:
        """How many steps ``worker`` has applied here beyond the slowest other of the ``live`` workers
        (0, also when every other is ahead: :mod:`psframe.ps.protocol.staleness`)."""
        steps = self._applied_steps.tolist()  # one read of them all, as Python ints
        slowest = mine = steps[worker]
        for other in live:  # a plain loop: this runs on every step-ending push
            if steps[other] < slowest:
                slowest = steps[other]
        return mine - slowest

    # ---- the hold of a checkpoint's cut (call under the store's lock)

    def hold(self, seconds: float) -> list[int]:
        """Hold every worker's pushes back, for ``seconds`` at most; returns the steps of each
        worker begun here (applied, plus one where a push of its next step was applied)."""
        self._deadline[0] = time.monotonic_ns() + int(seconds * 1e9)
        self._target[:] = HELD
        return (self._applied_steps + self._in_step).tolist()

    def set_targets(self, targets: list[int]) -> None:
        """Let each worker's pushes through until ``targets[worker]`` of its steps are applied here."""
        given = numpy.asarray(targets, dtype=numpy.int64)[: self.num_workers]
        self._target[:] = NOT_HELD  # a worker the targets do not name (a slot the chief's list lacks)
        self._target[: len(given)] = given

    def release(self) -> None:
        """End the hold: every push applies again."""
        self._target[:] = NOT_HELD

    def held(self) -> bool:
        """Whether pushes are held (a hold begun, neither ended nor past its deadline)."""
        return bool((self._target != NOT_HELD).all()) and time.monotonic_ns() < self._deadline[0]

    def admits(self, worker: int) -> bool:
        """Whether a push of ``worker`` may apply now (always, unless held)."""
        target = self._target[worker]
        if target == NOT_HELD or self._applied_steps[worker] < target:
            return True
        return time.monotonic_ns() >= self._deadline[0]  # a hold past its deadline holds nothing

    def reached(self) -> bool:
        """Whether every worker has as many steps applied here as its target (held with targets)."""
        return bool((self._applied_steps >= self._target).all())

    def last_push(self, worker: int) -> int:
        return int(self._last_push[worker])

    def applied_steps(self, worker: int) -> int:
        return int(self._applied_steps[worker])

    def state_dict(self) -> dict[str, list[int]]:
        """What a checkpoint keeps: both counts, by worker."""
        return {"last_push": self._last_push.tolist(), "applied_steps": self._applied_steps.tolist()}

    def load_state_dict(self, state: Mapping[str, list[int]]) -> None:
        """Take a checkpoint's counts (a checkpoint of more or fewer workers: those in both)."""
        for row, key in ((self._last_push, "last_push"), (self._applied_steps, "applied_steps")):
            values = list(state.get(key, ()))[: self.num_workers]
            row[:] = 0
            row[: len(values)] = values

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
processes (:mod:`psframe.ps.shared_store`: a worker's reconnected stream may
reach another process), and in checkpoints (a push whose effect a
checkpoint holds is a duplicate after a restore too).

In synchronous training a round applies a worker's gradient once whatever
it is sent (rounds are keyed by step and worker, :mod:`psframe.ps.sync`);
the ledger there only counts steps once.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy


class PushLedger:
    """The last push applied, and the steps applied, for each worker of a ps task.

    Args:
        num_workers: the workers of the cluster.
        counts: int64 array of shape ``(2, num_workers)`` to keep them in
            (shared by a task's serving processes); this ledger's own by default.
            Row 0: the last push number applied; row 1: steps applied.
    """

    def __init__(self, num_workers: int, counts: numpy.ndarray | None = None) -> None:
        if counts is None:
            counts = numpy.zeros((2, num_workers), dtype=numpy.int64)
        if counts.shape != (2, num_workers):
            raise ValueError(f"counts must have shape (2, {num_workers}), got {counts.shape}")
        self.num_workers = num_workers
        self._last_push = counts[0]
        self._applied_steps = counts[1]

    def is_duplicate(self, worker: int, push_id: int) -> bool:
        """Whether push ``push_id`` of ``worker`` was applied already (hold the store's lock)."""
        return push_id != 0 and push_id <= self._last_push[worker]

    def record(self, worker: int, push_id: int, ends_step: bool) -> None:
        """A push was applied (hold the store's lock since :meth:`is_duplicate`);
        ``ends_step``: it was the worker's last push of a step to this task."""
        if push_id > self._last_push[worker]:
            self._last_push[worker] = push_id
        if ends_step:
            self._applied_steps[worker] += 1

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

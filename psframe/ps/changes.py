"""What changed in a ps task's store since each of its recent snapshots: the ground of delta checkpoints.

A delta checkpoint holds only what changed since the checkpoint before it
(its parent). Rather than compare values, the store stamps what it changes
with the current *epoch*, a number that moves on at every snapshot: a
dense variable's stamp is kept by name, a fixed table part's row by row,
and a dynamic table part's slot by slot (with the ids it evicted:
:class:`psframe.dynamic_rows.DynamicRows`). A snapshot at step ``s``
records the epoch it closed; a later delta from parent ``s`` takes what was
stamped after it.

When the store's variables live in memory other processes update too (a ps
task served from several processes), updates made there are not stamped
here: every dense variable and fixed table counts as changed, and a delta
holds them whole (dynamic tables are updated in one process only).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

# How many snapshots a delta may name as its parent: the chief names the last one it committed.
KEEP_SNAPSHOTS = 8


class Changes:
    """Stamps of the dense variables and fixed tables' rows a store changed, and its snapshots' epochs.

    Args:
        complete: updates all go through this store, so stamps are complete;
            False where other processes update the same memory (then every
            dense variable and fixed table counts as changed).
    """

    def __init__(self, complete: bool = True) -> None:
        self.complete = complete
        self.epoch = 1  # what is changed now is stamped with this
        self._dense: dict[str, int] = {}
        self._rows: dict[str, torch.Tensor] = {}  # fixed table name -> int64 stamp per row
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # step -> the last epoch it holds

    def dense_changed(self, names: Iterable[str]) -> None:
        """Dense variables ``names`` changed (whole)."""
        for name in names:
            self._dense[name] = self.epoch

    def rows_changed(self, name: str, rows: torch.Tensor, num_rows: int) -> None:
        """Rows ``rows`` (int64 indices) of fixed table part ``name`` (of ``num_rows`` rows) changed."""
        stamps = self._rows.get(name)
        if stamps is None or stamps.numel() != num_rows:
            stamps = self._rows[name] = torch.zeros(num_rows, dtype=torch.int64)
        stamps.index_fill_(0, rows, self.epoch)

    def snapshot(self, step: int) -> int:
        """Close the current epoch for a snapshot of ``step``: what a delta from ``step`` leaves out.

        Returns:
            The epoch closed.
        """
        closed = self.epoch
        self._snapshots[step] = closed
        self._snapshots.move_to_end(step)
        while len(self._snapshots) > KEEP_SNAPSHOTS:
            self._snapshots.popitem(last=False)
        self.epoch += 1
        return closed

    def oldest(self) -> int:
        """The epoch of the oldest snapshot a delta may still name (the current epoch if none)."""
        return min(self._snapshots.values(), default=self.epoch)

    def epoch_of(self, step: int) -> int | None:
        """The last epoch snapshot ``step`` holds; None when this store took no such snapshot (or forgot it)."""
        return self._snapshots.get(step)

    def dense_since(self, epoch: int, names: Iterable[str]) -> list[str]:
        """Which of dense variables ``names`` changed after ``epoch``."""
        if not self.complete:
            return list(names)
        return [name for name in names if self._dense.get(name, 0) > epoch]

    def rows_since(self, epoch: int, name: str, num_rows: int) -> torch.Tensor:
        """The rows of fixed table part ``name`` changed after ``epoch`` (int64 indices, ascending)."""
        stamps = self._rows.get(name)
        if not self.complete:
            return torch.arange(num_rows, dtype=torch.int64)
        if stamps is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.nonzero(stamps > epoch).squeeze(1)

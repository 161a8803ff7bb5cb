"""What changed in a ps task's store since each of its recent snapshots: the ground of delta checkpoints.

A delta checkpoint holds only what changed since the checkpoint before it
(its parent). Rather than compare values, the store stamps what it changes
with the current *epoch*, a number that moves on at every snapshot: a
dense variable's stamp is kept by name, and a dynamic table part's slot by
slot (with the ids it evicted: :class:`psframe.tables.dynamic_rows.DynamicRows`).
A fixed table part's rows carry their versions instead
(:mod:`psframe.ps.store.row_versions`), the stamp workers' row caches read too:
a snapshot records their count, its *row mark*, beside the epoch it closed.
A later delta from parent ``s`` takes what was stamped after ``s``'s epoch,
and the rows whose version is past its row mark.

When the store's variables live in memory other processes update too (a ps
task served from several processes), dense updates made there are not
stamped here: every dense variable counts as changed, and a delta holds them
whole. The rows' versions are shared with those processes, and dynamic
tables are updated in one process only.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

# How many snapshots a delta may name as its parent: the chief names the last one it committed.
KEEP_SNAPSHOTS = 8


class Changes:
    """Stamps of the dense variables a store changed, and its snapshots' epochs and row marks.

    Args:
        complete: updates all go through this store, so stamps are complete;
            False where other processes update the same memory (then every
            dense variable counts as changed).
    """

    def __init__(self, complete: bool = True) -> None:
        self.complete = complete
        self.epoch = 1  # what is changed now is stamped with this
        self._dense: dict[str, int] = {}
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # step -> the last epoch it holds
        self._row_marks: dict[int, int] = {}  # epoch closed by a snapshot -> the rows' version count then

    def dense_changed(self, names: Iterable[str]) -> None:
        """Dense variables ``names`` changed (whole)."""
        for name in names:
            self._dense[name] = self.epoch

    def snapshot(self, step: int, row_mark: int) -> int:
        """Close the current epoch for a snapshot of ``step``: what a delta from ``step`` leaves out
        (``row_mark``: the count the fixed rows' versions were at, :meth:`RowVersions.mark`).

        Returns:
            The epoch closed.
        """
        closed = self.epoch
        self._snapshots[step] = closed
        self._snapshots.move_to_end(step)
        self._row_marks[closed] = row_mark
        while len(self._snapshots) > KEEP_SNAPSHOTS:
            _, epoch = self._snapshots.popitem(last=False)
            self._row_marks.pop(epoch, None)
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

    def row_mark(self, epoch: int) -> int:
        """The count the fixed rows' versions were at when ``epoch`` (a snapshot's) closed."""
        return self._row_marks[epoch]

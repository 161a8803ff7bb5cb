"""What changed in a ps task's store since each of its recent snapshots: the ground of delta checkpoints.

A delta checkpoint holds only what changed since the checkpoint before it
(its parent). Rather than compare values, the store stamps what it changes
with the current *epoch*, a number that moves on at every snapshot: a
dense variable's stamp is kept by name, and a dynamic table part's slot by
slot (with the ids it evicted: :mod:`psframe.tables.change_stamps`).
A fixed table part's rows carry their versions instead
(:mod:`psframe.ps.store.row_versions`), the stamp a re-layout's precopy reads too:
a snapshot records their count, its *row mark*, beside the epoch it closed.
A later delta from parent ``s`` takes what was stamped after ``s``'s epoch,
and the rows whose version is past its row mark.

:class:`ChangeLog` keeps these stamps for one model of a store (the store
makes a new log whenever it makes its variables anew: no snapshot holds
them): the store tells it what each step changed (:attr:`ChangeLog.dense_stamps`,
:meth:`ChangeLog.stepped_tables`, :meth:`ChangeLog.stepped_rows`), marks its
snapshots (:meth:`ChangeLog.mark`) and asks it for what changed since one (:meth:`ChangeLog.since`, a
:class:`StoreChanges`).

When the store's variables live in memory other processes update too (a ps
task served from several processes), dense updates made there are not
stamped here: every dense variable counts as changed, and a delta holds them
whole. The rows' versions are shared with those processes, and dynamic
tables are updated in one process only.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psframe.errors import CheckpointError
from psframe.ps.store.optimized_variables import OptimizedVariables
from psframe.ps.store.snapshots import copies, row_copies
from psframe.ps.store.store_model import StoreModel
from psframe.tables.rows import RowPush

# How many snapshots a delta may name as its parent: the chief names the last one it committed.
KEEP_SNAPSHOTS = 8


@dataclass(frozen=True)
class StoreChanges:
    """Copies of what changed in a store since a checkpoint (:meth:`ChangeLog.since`)."""

    global_step: int
    values: dict[str, torch.Tensor]  # dense variables changed, whole
    states: dict[str, dict[str, Any]]  # and their optimizer state
    rows: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]  # fixed table part -> (rows, values, state)
    dynamic: dict[str, dict[str, Any]]  # dynamic table part -> DynamicRows.export_changes


class ChangeLog:
    """What changed in ``model`` since each of the store's recent snapshots of it.

    Args:
        model: the store's model, whose changes it notes.
        complete: updates all go through this store, so stamps are complete;
            False where other processes update the same memory (then every
            dense variable counts as changed).
    """

    def __init__(self, model: StoreModel, complete: bool = True) -> None:
        self._model = model
        self.complete = complete
        self.epoch = 1  # what is changed now is stamped with this
        # Dense variable (the id of its tensor) -> the epoch it last changed in: what steps the dense
        # variables writes it (ModelUpdates, psframe.ps.store.optimized_variables), where `complete`.
        self.dense_stamps: dict[int, int] = {}
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # step -> the last epoch it holds
        self._row_marks: dict[int, int] = {}  # epoch closed by a snapshot -> the rows' version count then
        fixed = model.table_parts.fixed
        self._fixed_names = {id(fixed.get(name)): name for name in fixed}

    def stepped_tables(
        self,
        group: OptimizedVariables,
        tables: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        stateless: Sequence[torch.Tensor],
    ) -> None:
        """Note what a step of the fixed tables' ``group`` changed, for delta checkpoints:
        the rows of each sparse gradient (all of a table where the step made its optimizer state,
        ``stateless`` before), with a new version (:mod:`psframe.ps.store.row_versions`)."""
        names = self._fixed_names
        made_state = {id(t) for t in stateless if group.state_of(t)}
        versions = self._model.table_parts.versions
        for table, grad in zip(tables, grads):
            if id(table) in made_state:
                versions.touch_whole(names[id(table)])
            else:
                versions.touch(names[id(table)], grad.indices()[0])

    def stepped_rows(self, rows: Sequence[RowPush]) -> None:
        """Note that a step changed these pushed rows of fixed tables, ``(table, ids, gradient rows)``."""
        versions = self._model.table_parts.versions
        for name, ids, _ in rows:
            versions.touch(name, ids)

    def restored(self) -> None:
        """Every row changed (a restore): a delta from a snapshot before it holds them all."""
        self._model.table_parts.versions.touch_all()

    def mark(self, step: int) -> None:
        """The model as it is now is checkpoint ``step``'s (just saved, or restored): a delta from
        ``step`` holds what changes after this. Closes the current epoch."""
        closed = self.epoch
        self._snapshots[step] = closed
        self._snapshots.move_to_end(step)
        self._row_marks[closed] = self._model.table_parts.versions.mark()
        while len(self._snapshots) > KEEP_SNAPSHOTS:
            _, epoch = self._snapshots.popitem(last=False)
            self._row_marks.pop(epoch, None)
        self.epoch += 1
        oldest = min(self._snapshots.values(), default=self.epoch)  # the oldest snapshot a delta may name
        self._model.table_parts.close_epoch(self.epoch, oldest)

    def since(self, step: int, global_step: int) -> StoreChanges:
        """Copies of what changed since checkpoint ``step`` (see :meth:`mark`), at ``global_step``.

        Raises:
            CheckpointError: no snapshot of ``step`` is held (the variables were made
                anew or restarted since, or the step is too old): the delta needs a
                full checkpoint instead.
        """
        model = self._model
        epoch = self._snapshots.get(step)
        if epoch is None:
            raise CheckpointError(
                f"{model.task_name} has no snapshot of checkpoint step {step} to write a delta from "
                f"(its variables were made or restored since, or the step is too old); save a full checkpoint"
            )
        dense = list(model.dense)
        if self.complete:
            stamps, variable = self.dense_stamps, model.dense.get
            dense = [name for name in dense if stamps.get(id(variable(name)), 0) > epoch]
        values, states = copies(model, dense)
        rows = {}
        mark, versions = self._row_marks[epoch], model.table_parts.versions
        for name in sorted(model.table_parts.fixed_names):
            index = versions.changed_since(name, mark)
            rows[name] = (index, *row_copies(model, name, index))
        dynamic = model.table_parts.export_dynamic_changes(epoch)
        return StoreChanges(global_step, values, states, rows, dynamic)

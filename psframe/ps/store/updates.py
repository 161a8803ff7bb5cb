"""How a push changes a store's model: its optimizers' steps, noted and counted.

A push's dense gradients are one step of the dense variables' optimizer. Its
table rows are one step of the table optimizer: on the rows as they came,
where the optimizer's row kernel takes them (:func:`psframe.optim.kernels.step_rows`),
else with a sparse gradient of each table; and one step of each dynamic table
part's own optimizer. :class:`ModelUpdates` takes these steps on a model
whose gradients the store checked already, notes what each changed in the
store's :class:`~psframe.ps.store.changes.ChangeLog`, and counts it in the
store's :class:`~psframe.ps.store.counters.StoreCounts`: the variables'
version moves on even for a step that failed halfway (it may have changed
some), a push counts once it went through.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.memory import Memory
from psframe.ps.store.changes import ChangeLog
from psframe.ps.store.counters import StoreCounts
from psframe.ps.store.optimized_variables import OptimizedVariables
from psframe.ps.store.store_model import StoreModel
from psframe.tables.rows import RowPush


class ModelUpdates:
    """The steps of ``model``'s optimizers, state made in ``memory``, noted in ``changes``, counted in ``counts``."""

    def __init__(self, model: StoreModel, memory: Memory, changes: ChangeLog, counts: StoreCounts) -> None:
        self._model = model
        self._memory = memory
        self._changes = changes
        self._counts = counts

    def step(self, group: OptimizedVariables, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """One step of ``group``'s optimizer with these gradients; counts a push."""
        dense = group is self._model.dense
        stateless = [] if dense else [t for t in variables if not group.state_of(t)]
        try:
            group.step(variables, grads, self._memory)
        finally:
            self._counts.version += 1  # even a step that failed halfway may have changed some
            self._changes.stepped(group, variables, grads, stateless)
        self._counts.pushes += 1

    def rows(self, rows: Sequence[RowPush]) -> None:
        """One step of the table optimizer with the gradients of these rows, ``(table, ids, rows)``
        (checked, one at least); counts a push."""
        parts = self._model.table_parts
        dynamic_names = parts.dynamic_names
        dynamic = [row for row in rows if row[0] in dynamic_names]
        fixed = [row for row in rows if row[0] not in dynamic_names]
        if fixed and not self._step_rows(fixed):
            tables, grads = parts.sparse_gradients(fixed)
            self.step(parts.fixed, tables, grads)
        if dynamic:
            try:
                parts.apply_dynamic(dynamic)
            finally:
                self._counts.version += 1
            if not fixed:
                self._counts.pushes += 1

    def _step_rows(self, rows: Sequence[RowPush]) -> bool:
        """The fixed tables' step on their pushed rows as they came, where the table optimizer's
        row kernel takes it (no sparse gradient made); counts a push. False: nothing changed."""
        parts = self._model.table_parts
        work = [(parts.fixed.get(name), ids, values) for name, ids, values in rows]  # checked: fixed tables
        taken = True  # until it says otherwise: a step that failed halfway may have changed some rows
        try:
            taken = parts.fixed.step_rows(work)  # type: ignore[arg-type]
        finally:
            if taken:
                self._counts.version += 1
                self._changes.stepped_rows(rows)
        if taken:
            self._counts.pushes += 1
        return taken

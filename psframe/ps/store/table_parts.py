"""The parts of embedding tables a ps task holds, read and updated row by row, with their optimizer state.

A table is never moved whole: a pull names the rows it wants, a push
carries the ids of the rows a batch touched and their gradients, and the
table optimizer (one that takes sparse gradients, :mod:`psframe.optim.rows_kernels`)
updates only those rows and their state.

- A *fixed* table's part is a variable of the store, of as many rows as
  the chief placed here; its ids are row numbers.
- A *dynamic* table's part (:class:`~psframe.tables.dynamic_rows.DynamicRows`)
  takes any int64 id, makes the rows of ids it does not hold, and carries
  its own instance of the table optimizer, since its rows grow.

:class:`TableParts` checks and applies one row push at a time; the store
(:class:`~psframe.ps.store.VariableStore`) checks every push of a request
before any applies, and counts the update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from psframe.errors import DtypeMismatchError, RowIdError, ShapeMismatchError
from psframe.memory import Memory
from psframe.optim import OptimizerSpec
from psframe.optim.schedule_clock import ScheduleClock
from psframe.ps.store.optimized_variables import OptimizedVariables
from psframe.ps.store.row_versions import RowVersions
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.row_math import row_gradient
from psframe.tables.rows import RowPush
from psframe.tables.spec import DynamicTableSpec


@dataclass(frozen=True)
class DynamicPart:
    """A dynamic table's part as the chief defines it: initializer and eviction, row shape, dtype."""

    spec: DynamicTableSpec
    row_shape: tuple[int, ...]
    dtype: torch.dtype


class TableParts:
    """The fixed tables and dynamic tables' parts of one ps task, with the table optimizer's state.

    Args:
        task_name: the task name used in error messages, e.g. ``/job:ps/task:0``.
        fixed: the fixed tables' variables by name, used as they are.
        dynamic: the dynamic tables' parts by name; they start empty.
        optimizer: the table optimizer; None when there are no tables.
        memory: where the store makes tensors (the fixed rows' versions among them).
        version_count: the one-element count the rows' versions are stamped from
            (:class:`~psframe.ps.store.row_versions.RowVersions`); shared where the store's counters are.
        versions: the fixed rows' versions, made by another process (a serving process maps the owner's).
        previous: the fixed tables' group before, whose optimizer this one takes over (see
            :class:`~psframe.ps.store.optimized_variables.OptimizedVariables`).
        schedule: the table optimizer's learning-rate schedule (:mod:`psframe.ps.store.schedules`); None: none.
    """

    def __init__(
        self,
        task_name: str,
        fixed: Mapping[str, torch.Tensor] | None = None,
        dynamic: Mapping[str, DynamicPart] | None = None,
        optimizer: OptimizerSpec | None = None,
        memory: Memory | None = None,
        version_count: numpy.ndarray | None = None,
        versions: Mapping[str, torch.Tensor] | None = None,
        previous: OptimizedVariables | None = None,
        schedule: ScheduleClock | None = None,
        lock: Any = None,
    ) -> None:
        fixed, dynamic = fixed or {}, dynamic or {}
        self._lock = lock  # the store's: dynamic parts' disk tiers spill ahead under it
        self.task_name = task_name
        self._memory = memory if memory is not None else Memory()
        self.optimizer_spec = optimizer if fixed or dynamic else None
        self._schedule = schedule
        self._dynamic = {
            name: DynamicRows(
                name,
                part.row_shape,
                part.dtype,
                part.spec,
                optimizer,
                memory=self._memory,
                schedule=schedule,
                lock=lock,
            )
            for name, part in dynamic.items()
        }
        self.fixed = OptimizedVariables(fixed, optimizer, per_parameter=True, previous=previous, schedule=schedule)
        # The version of each fixed table row: for delta checkpoints and a re-layout's precopy.
        self.versions = RowVersions({name: t.shape[0] for name, t in fixed.items()}, version_count, memory, versions)

    def __contains__(self, name: object) -> bool:
        return name in self._dynamic or name in self.fixed

    @property
    def fixed_names(self) -> frozenset[str]:
        """The names of the fixed tables."""
        return frozenset(self.fixed)

    @property
    def dynamic_names(self) -> frozenset[str]:
        """The names of the dynamic tables' parts."""
        return frozenset(self._dynamic)

    def dynamic_parts(self) -> dict[str, DynamicPart]:
        """How each dynamic table's part was defined, by name."""
        return {name: DynamicPart(rows.spec, rows.row_shape, rows.dtype) for name, rows in self._dynamic.items()}

    def dynamic_rows(self, name: str) -> DynamicRows:
        """The rows of dynamic table part ``name``."""
        return self._dynamic[name]

    # ---- checks

    def layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int | None]:
        """A table's dtype, row shape and number of rows (None: a dynamic table, any id)."""
        dynamic = self._dynamic.get(name)
        if dynamic is not None:
            return dynamic.dtype, dynamic.row_shape, None
        table = self.fixed.get(name)
        if table is None:
            raise KeyError(f"{name!r} is no embedding table on {self.task_name}")
        return table.dtype, tuple(table.shape[1:]), table.shape[0]

    def check_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``ids`` are rows of table ``name``.

        Raises:
            RowIdError: not a 1-d int64 tensor, or an id outside a fixed table.
        """
        self._check_ids(name, ids, self.layout(name)[2])

    def _check_ids(self, name: str, ids: torch.Tensor, rows: int | None) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise RowIdError(
                f"row ids of table {name!r} must be a 1-d int64 tensor, got {ids.dtype} "
                f"of shape {tuple(ids.shape)}; nothing was applied"
            )
        if ids.numel() and rows is not None:
            low, high = (int(bound) for bound in torch.aminmax(ids))
            bad = low if low < 0 else high if high >= rows else None
            if bad is not None:
                raise RowIdError(
                    f"row id {bad} is outside table {name!r} on {self.task_name}, which holds "
                    f"rows 0..{rows - 1}; nothing was applied"
                )

    def check_push(self, name: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Raise unless the gradients ``values`` of rows ``ids`` fit table ``name``.

        Raises:
            RowIdError, DtypeMismatchError, ShapeMismatchError.
        """
        dtype, row_shape, rows = self.layout(name)
        self._check_ids(name, ids, rows)
        if values.dtype != dtype:
            raise DtypeMismatchError(
                f"rows pushed to table {name!r} have dtype {values.dtype} but the table on "
                f"{self.task_name} has dtype {dtype}; nothing was applied"
            )
        expected = (ids.shape[0], *row_shape)
        if tuple(values.shape) != expected:
            raise ShapeMismatchError(
                f"rows pushed to table {name!r} have shape {tuple(values.shape)}; "
                f"{ids.shape[0]} ids of a table of rows {row_shape} need "
                f"{expected}; nothing was applied"
            )

    # ---- updates and reads (of rows already checked)

    def sparse_gradients(self, rows: Sequence[RowPush]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fixed tables of ``rows`` and, for each, its sparse gradient (for :meth:`OptimizedVariables.step`)."""
        tables, grads = [], []
        for name, ids, values in rows:
            table = self.fixed.get(name)
            if table is None:
                raise KeyError(f"{name!r} is no fixed embedding table on {self.task_name}")
            tables.append(table)
            # Rows may repeat (two pushes' worth, or a worker's own duplicates):
            # coalescing sums them, as backward does for one process.
            # (The ids were checked: torch's own invariant check would only repeat it.)
            grads.append(row_gradient(ids, values, table.shape))
        return tables, grads

    def apply_dynamic(self, rows: Sequence[RowPush]) -> None:
        """One step of each dynamic table part's optimizer with the gradients of its rows."""
        for name, ids, values in rows:
            self._dynamic[name].apply(ids, values)

    def read(self, name: str, ids: torch.Tensor, create: bool = True) -> torch.Tensor:
        """A copy of rows ``ids`` of table ``name``; a dynamic table makes the rows
        of ids it does not hold, unless not ``create`` (see :meth:`DynamicRows.read`)."""
        dynamic = self._dynamic.get(name)
        if dynamic is not None:
            return dynamic.read(ids, create=create)
        table = self.fixed.get(name)
        if table is None:
            raise KeyError(f"{name!r} is no embedding table on {self.task_name}")
        return table.detach().index_select(0, ids)

    # ---- accounting and checkpoints

    def nbytes(self) -> int:
        """Bytes of the tables and their optimizer state."""
        return self.fixed.nbytes() + sum(rows.nbytes() for rows in self._dynamic.values())

    def dynamic_counts(self) -> dict[str, dict[str, int]]:
        """Each dynamic table part's rows held and ids admitted, filtered and evicted, by name."""
        return {
            name: {"rows": len(part), **part.counts(), "rows_on_disk": len(part.tier) if part.tier else 0}
            for name, part in self._dynamic.items()
        }

    def export_dynamic_changes(self, since: int) -> dict[str, dict[str, Any]]:
        """What a delta checkpoint keeps of each dynamic table part (:meth:`DynamicRows.export_changes`)."""
        return {name: part.export_changes(since) for name, part in self._dynamic.items()}

    def close_epoch(self, epoch: int, oldest: int) -> None:
        """Every dynamic table part moves on to ``epoch``, forgetting evictions no delta after ``oldest`` needs."""
        for part in self._dynamic.values():
            part.close_epoch(oldest)
            part.epoch = epoch

    def export_dynamic(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps of each dynamic table part (:meth:`DynamicRows.export`)."""
        return {name: part.export() for name, part in self._dynamic.items()}

    def load_dynamic(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Refill dynamic table parts from a checkpoint's exports (the parts start over empty)."""
        for name, export in saved.items():
            part = self._dynamic[name]
            self._dynamic[name] = DynamicRows(
                name,
                part.row_shape,
                part.dtype,
                part.spec,
                self.optimizer_spec,
                memory=self._memory,
                schedule=self._schedule,
                lock=self._lock,
            )
            self._dynamic[name].epoch = part.epoch
            self._dynamic[name].load(export)

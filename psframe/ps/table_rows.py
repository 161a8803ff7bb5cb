"""The row-by-row half of :class:`psframe.ps.store.VariableStore`: embedding tables.

A table is a variable of the store that workers never move whole: a pull
names the rows it wants (:meth:`TableRows.read_rows`), a push carries the
ids of the rows a batch touched and their gradients (:meth:`TableRows.apply_rows`),
and the store's table optimizer (one that takes sparse gradients,
:mod:`psframe.sparse_optim`) updates only those rows and their state.
Every id and row is checked before anything changes.

A dynamic table's part (:class:`~psframe.dynamic_rows.DynamicRows`) is no
variable: it takes any int64 id, makes the rows of ids it does not hold,
and carries its own instance of the table optimizer, since its rows grow.

These methods use the store's variables, lock, counters and table
optimizer; they live here to keep each file about one thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psframe.cluster.table_placement import DynamicTableSpec
from psframe.errors import (
    DtypeMismatchError,
    PsframeError,
    RowIdError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psframe.wire import codec, messages
from psframe.wire import psframe_pb2 as pb


@dataclass(frozen=True)
class DynamicPart:
    """A dynamic table's part as the chief defines it: initializer and eviction, row shape, dtype."""

    spec: DynamicTableSpec
    row_shape: tuple[int, ...]
    dtype: torch.dtype


def dynamic_parts(defs: Sequence[pb.VariableDef]) -> dict[str, DynamicPart]:
    """The dynamic table parts among variable definitions, by name."""
    return {
        d.name: DynamicPart(messages.dynamic_spec(d.dynamic), tuple(d.shape[1:]), codec.dtype_from_name(d.dtype))
        for d in defs
        if d.HasField("dynamic")
    }


class TableRows:
    """Row access to the embedding tables of a :class:`~psframe.ps.store.VariableStore` (its base class)."""

    @property
    def dynamic_tables(self) -> frozenset[str]:
        """The names of the dynamic tables' parts this store holds."""
        return frozenset(self._dynamic)

    def _row_table(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int | None]:
        """A table's dtype, row shape and number of rows (None: a dynamic table, any id)."""
        dynamic = self._dynamic.get(name)
        if dynamic is not None:
            return dynamic.dtype, dynamic.row_shape, None
        if name not in self._tables:
            self._variable(name)  # names what this store holds
            raise UnknownVariableError(
                f"{name!r} on {self.owner} is not an embedding table; its rows cannot be pulled or pushed one by one"
            )
        table = self._variables[name]
        return table.dtype, tuple(table.shape[1:]), table.shape[0]

    def _check_ids(self, name: str, ids: torch.Tensor, rows: int | None) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise RowIdError(
                f"row ids of table {name!r} must be a 1-d int64 tensor, got {ids.dtype} "
                f"of shape {tuple(ids.shape)}; nothing was applied"
            )
        if ids.numel() and rows is not None:
            low, high = int(ids.min()), int(ids.max())
            bad = low if low < 0 else high if high >= rows else None
            if bad is not None:
                raise RowIdError(
                    f"row id {bad} is outside table {name!r} on {self.owner}, which holds "
                    f"rows 0..{rows - 1}; nothing was applied"
                )

    def check_rows(self, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Raise unless every ``(table, ids, gradient rows)`` fits its table; changes
        nothing but the count of rejected pushes."""
        with self.lock:
            try:
                self._require_ready()
                for name, ids, values in rows:
                    dtype, row_shape, count = self._row_table(name)
                    self._check_ids(name, ids, count)
                    if values.dtype != dtype:
                        raise DtypeMismatchError(
                            f"rows pushed to table {name!r} have dtype {values.dtype} but the table on "
                            f"{self.owner} has dtype {dtype}; nothing was applied"
                        )
                    expected = (ids.shape[0], *row_shape)
                    if tuple(values.shape) != expected:
                        raise ShapeMismatchError(
                            f"rows pushed to table {name!r} have shape {tuple(values.shape)}; "
                            f"{ids.shape[0]} ids of a table of rows {row_shape} need "
                            f"{expected}; nothing was applied"
                        )
            except PsframeError:
                self.rejected_pushes += 1
                raise

    def apply_rows(self, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """One step of the table optimizer with the gradients of these rows,
        given as ``(table, ids, rows)``: only those rows (and their optimizer
        state) change. A table may appear with no rows: its optimizer still
        counts a step (as one process's would, for a batch that used the table).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError, ShapeMismatchError,
            DtypeMismatchError: nothing was applied.
        """
        with self.lock:
            self.check_rows(rows)
            tables, grads, dynamic = [], [], []
            for name, ids, values in rows:
                if name in self._dynamic:
                    dynamic.append((self._dynamic[name], ids, values))
                    continue
                table = self._variables[name]
                tables.append(table)
                # Rows may repeat (two pushes' worth, or a worker's own duplicates):
                # coalescing sums them, as backward does for one process.
                # (The ids were checked above: torch's own invariant check would only repeat it.)
                grads.append(
                    torch.sparse_coo_tensor(ids.unsqueeze(0), values, table.shape, check_invariants=False).coalesce()
                )
            if tables:
                self._step(tables, grads, self._table_optimizer)
            if dynamic:
                try:
                    for part, ids, values in dynamic:
                        part.apply(ids, values)
                    self._stepped = True
                finally:
                    self.version += 1
                if not tables:
                    self.pushes += 1

    def check_row_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``name`` is a table of this store and ``ids`` are rows of it."""
        with self.lock:
            self._require_ready()
            self._check_ids(name, ids, self._row_table(name)[2])

    def read_rows(self, name: str, ids: torch.Tensor, create: bool = True) -> torch.Tensor:
        """A copy of rows ``ids`` of table ``name``. A dynamic table makes the
        rows of ids it does not hold, unless not ``create`` (then it gives
        their initial values and keeps nothing).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError.
        """
        with self.lock:
            self.check_row_ids(name, ids)
            dynamic = self._dynamic.get(name)
            if dynamic is not None:
                return dynamic.read(ids, create=create)
            return self._variables[name].detach().index_select(0, ids)

    # ---- dynamic tables in checkpoints

    def export_dynamic(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps of each dynamic table part (:meth:`DynamicRows.export`)."""
        with self.lock:
            return {name: part.export() for name, part in self._dynamic.items()}

    def load_dynamic(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Refill dynamic table parts from a checkpoint's exports (the parts start over empty)."""
        with self.lock:
            for name, export in saved.items():
                part = self._dynamic[name]
                self._dynamic[name] = type(part)(
                    name, part.row_shape, part.dtype, part.spec, self._table_optimizer_spec
                )
                self._dynamic[name].load(export)
            self.version += 1

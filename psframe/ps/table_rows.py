"""The row-by-row half of :class:`psframe.ps.store.VariableStore`: embedding tables.

A table is a variable of the store that workers never move whole: a pull
names the rows it wants (:meth:`TableRows.read_rows`), a push carries the
ids of the rows a batch touched and their gradients (:meth:`TableRows.apply_rows`),
and the store's table optimizer (one that takes sparse gradients,
:mod:`psframe.sparse_optim`) updates only those rows and their state.
Every id and row is checked before anything changes.

These methods use the store's variables, lock, counters and table
optimizer; they live here to keep each file about one thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.errors import (
    DtypeMismatchError,
    PsframeError,
    RowIdError,
    ShapeMismatchError,
    UnknownVariableError,
)


class TableRows:
    """Row access to the embedding tables of a :class:`~psframe.ps.store.VariableStore` (its base class)."""

    def _table(self, name: str) -> torch.Tensor:
        if name not in self._tables:
            self._variable(name)  # names what this store holds
            raise UnknownVariableError(f"{name!r} on {self.owner} is not an embedding table; its rows "
                                       f"cannot be pulled or pushed one by one")
        return self._variables[name]

    def _check_ids(self, name: str, table: torch.Tensor, ids: torch.Tensor) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise RowIdError(f"row ids of table {name!r} must be a 1-d int64 tensor, got {ids.dtype} "
                             f"of shape {tuple(ids.shape)}; nothing was applied")
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            bad = low if low < 0 else high if high >= table.shape[0] else None
            if bad is not None:
                raise RowIdError(f"row id {bad} is outside table {name!r} on {self.owner}, which holds "
                                 f"rows 0..{table.shape[0] - 1}; nothing was applied")

    def check_rows(self, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Raise unless every ``(table, ids, gradient rows)`` fits its table; changes
        nothing but the count of rejected pushes."""
        with self.lock:
            try:
                self._require_ready()
                for name, ids, values in rows:
                    table = self._table(name)
                    self._check_ids(name, table, ids)
                    if values.dtype != table.dtype:
                        raise DtypeMismatchError(
                            f"rows pushed to table {name!r} have dtype {values.dtype} but the table on "
                            f"{self.owner} has dtype {table.dtype}; nothing was applied")
                    expected = (ids.shape[0], *table.shape[1:])
                    if tuple(values.shape) != expected:
                        raise ShapeMismatchError(
                            f"rows pushed to table {name!r} have shape {tuple(values.shape)}; "
                            f"{ids.shape[0]} ids of a table of rows {tuple(table.shape[1:])} need "
                            f"{expected}; nothing was applied")
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
            if not rows:
                return
            tables, grads = [], []
            for name, ids, values in rows:
                table = self._variables[name]
                tables.append(table)
                # Rows may repeat (two pushes' worth, or a worker's own duplicates):
                # coalescing sums them, as backward does for one process.
                # (The ids were checked above: torch's own invariant check would only repeat it.)
                grads.append(torch.sparse_coo_tensor(ids.unsqueeze(0), values, table.shape,
                                                     check_invariants=False).coalesce())
            self._step(tables, grads, self._table_optimizer)

    def check_row_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``name`` is a table of this store and ``ids`` are rows of it."""
        with self.lock:
            self._require_ready()
            self._check_ids(name, self._table(name), ids)

    def read_rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """A copy of rows ``ids`` of table ``name``.

        Raises:
            NotReadyError, UnknownVariableError, RowIdError.
        """
        with self.lock:
            self._require_ready()
            table = self._table(name)
            self._check_ids(name, table, ids)
            return table.detach().index_select(0, ids)

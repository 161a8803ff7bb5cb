"""Int8 rows for serving: :func:`quantized` gives a snapshot or update whose dynamic tables' rows
are int8 with one float32 scale per row (a quarter of float32's bytes, plus four per row).

Each row is scaled on its own, symmetrically (its largest magnitude maps to
127; :func:`psframe.tables.compact.quantize_int8`), so a row of small values
keeps its precision beside rows of large ones. A server reads
:meth:`~psframe.export.TableRows.values` (int8 times scale). Dense
parameters (fixed tables among them) are left as they are.
"""

from __future__ import annotations

from typing import TypeVar

from psframe.errors import SnapshotError
from psframe.export.snapshot import Snapshot, SnapshotUpdate, TableRows, TableUpdate
from psframe.tables.compact import quantize_int8

Exported = TypeVar("Exported", Snapshot, SnapshotUpdate)


def quantized(exported: Exported) -> Exported:
    """``exported`` (a :class:`Snapshot` or :class:`SnapshotUpdate`) with its dynamic tables' rows
    in int8 with per-row scales; rows already so are kept as they are.

    Raises:
        SnapshotError: a table's rows are not floating point (nothing to scale).
    """
    if isinstance(exported, Snapshot):
        tables = {name: _int8(name, rows) for name, rows in exported.tables.items()}
        return Snapshot(exported.step, dict(exported.dense), tables)
    if isinstance(exported, SnapshotUpdate):
        changes = {name: TableUpdate(_int8(name, c.upsert), c.delete) for name, c in exported.tables.items()}
        return SnapshotUpdate(exported.base_step, exported.step, dict(exported.dense), changes)
    raise SnapshotError(f"quantized takes a Snapshot or SnapshotUpdate, got {type(exported).__name__}")


def _int8(name: str, table: TableRows) -> TableRows:
    if table.scales is not None:
        return table
    if not table.rows.is_floating_point():
        raise SnapshotError(f"table {name!r} has rows of {table.rows.dtype}: only floating point rows go to int8")
    return TableRows(table.ids, *quantize_int8(table.rows))

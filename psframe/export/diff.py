"""Updates between snapshots: :func:`diff_snapshots` makes the update from one snapshot to a later
one, and :func:`apply_update` applies an update to the snapshot of its base step.

Both compare tensors bit for bit (NaNs and -0.0 as their bits) and refuse,
changing nothing, an update or snapshot whose parameters or rows have
another shape or dtype than those they replace.
"""

from __future__ import annotations

import torch

from psframe.errors import SnapshotError
from psframe.export.snapshot import Snapshot, SnapshotUpdate, TableRows, TableUpdate


def apply_update(snapshot: Snapshot, update: SnapshotUpdate) -> Snapshot:
    """The snapshot ``update`` makes of ``snapshot``; ``snapshot`` itself is left as it is.

    In each table, the update's deletes apply first, then its upserts, and
    ids stay sorted. Deleting an id the table does not hold changes nothing
    (a row made and evicted between the two steps). A table the snapshot
    lacks is added, holding the upsert's rows. Tensors that did not change
    are shared with ``snapshot``, not copied.

    Args:
        snapshot: the snapshot of ``update.base_step``.
        update: what changed since.

    Returns:
        A new snapshot, of ``update.step``.

    Raises:
        SnapshotError: the update's base step is not the snapshot's step; it
            replaces a parameter the snapshot lacks, or with another shape or
            dtype; or its rows have another shape or dtype than the table's.
            Nothing is applied.
    """
    if update.base_step != snapshot.step:
        raise SnapshotError(
            f"the update goes from step {update.base_step} to step {update.step}, but the snapshot is of step "
            f"{snapshot.step}: apply updates in order, each to the snapshot of its base step"
        )
    for name, value in update.dense.items():
        held = snapshot.dense.get(name)
        if held is None:
            raise SnapshotError(
                f"the update replaces dense variable {name!r}, which the snapshot of step {snapshot.step} does not "
                f"hold; an update cannot add a parameter: make a new snapshot"
            )
        _check_like(f"dense variable {name!r}", value, held)
    for name, change in update.tables.items():
        if name in snapshot.tables:
            _check_rows_like(name, change.upsert, snapshot.tables[name])
    tables = dict(snapshot.tables)
    for name, change in update.tables.items():
        tables[name] = _merged(snapshot.tables.get(name), change)
    return Snapshot(update.step, {**snapshot.dense, **update.dense}, tables)


def diff_snapshots(old: Snapshot, new: Snapshot) -> SnapshotUpdate:
    """The update that takes ``old`` to ``new``: ``apply_update(old, diff_snapshots(old, new))`` equals ``new``.

    Rows and parameters are compared bit for bit: upserts are the ids that
    are new or whose row changed, deletes the ids gone, ``dense`` the
    parameters that changed. Tables that did not change are left out.

    Raises:
        SnapshotError: ``new`` is of an earlier step, holds other parameters
            than ``old`` (or of another shape or dtype), lacks a table of
            ``old``, or has rows of another shape or dtype in a table: a
            model that changed needs a new snapshot.
    """
    if new.step < old.step:
        raise SnapshotError(f"the newer snapshot (step {new.step}) is of an earlier step than the older ({old.step})")
    if set(old.dense) != set(new.dense):
        raise SnapshotError(
            f"the snapshots hold other parameters: only in step {old.step}: {sorted(set(old.dense) - set(new.dense))}, "
            f"only in step {new.step}: {sorted(set(new.dense) - set(old.dense))}; make a new snapshot"
        )
    gone = sorted(set(old.tables) - set(new.tables))
    if gone:
        raise SnapshotError(f"tables {gone} of step {old.step} are not in step {new.step}; make a new snapshot")
    dense = {}
    for name, value in new.dense.items():
        _check_like(f"dense variable {name!r}", value, old.dense[name])
        if not _same_bits(value, old.dense[name]):
            dense[name] = value
    tables = {}
    for name, now in new.tables.items():
        before = old.tables.get(name)
        if before is None:
            tables[name] = TableUpdate(now, _no_ids())
            continue
        _check_rows_like(name, now, before)
        change = _table_diff(before, now)
        if len(change.upsert) or change.delete.numel():
            tables[name] = change
    return SnapshotUpdate(old.step, new.step, dense, tables)


def _merged(held: TableRows | None, change: TableUpdate) -> TableRows:
    if held is None:
        return change.upsert
    if not len(change.upsert) and not change.delete.numel():
        return held
    keep = ~(torch.isin(held.ids, change.delete) | torch.isin(held.ids, change.upsert.ids))
    ids, order = torch.sort(torch.cat([held.ids[keep], change.upsert.ids]))
    rows, scales = held.take(keep)
    new = change.upsert
    if scales is None or new.scales is None:
        return TableRows(ids, torch.cat([rows, new.rows])[order])
    return TableRows(ids, torch.cat([rows, new.rows])[order], torch.cat([scales, new.scales])[order])


def _table_diff(before: TableRows, now: TableRows) -> TableUpdate:
    changed = torch.ones(len(now), dtype=torch.bool)
    if len(before) and len(now):
        at = torch.searchsorted(before.ids, now.ids).clamp_(max=len(before) - 1)
        found = before.ids[at] == now.ids
        changed[found] = _rows_differ(before.rows[at[found]], now.rows[found])
        if before.scales is not None and now.scales is not None:
            changed[found] |= _rows_differ(before.scales[at[found], None], now.scales[found, None])
    delete = before.ids[~torch.isin(before.ids, now.ids)]
    return TableUpdate(TableRows(now.ids[changed], *now.take(changed)), delete)


# ---- shapes and bits


def _check_like(what: str, value: torch.Tensor, held: torch.Tensor) -> None:
    if value.shape != held.shape or value.dtype != held.dtype:
        raise SnapshotError(
            f"{what} is {_describe(held)} in the snapshot; the update's is {_describe(value)}; nothing was applied"
        )


def _check_rows_like(table: str, new: TableRows, old: TableRows) -> None:
    rows, held = new.rows, old.rows
    if rows.shape[1:] != held.shape[1:] or rows.dtype != held.dtype or (new.scales is None) != (old.scales is None):
        raise SnapshotError(
            f"table {table!r} has rows of {_rows_kind(old)} {list(held.shape[1:])}; the update's are "
            f"{_rows_kind(new)} {list(rows.shape[1:])}; nothing was applied"
        )


def _rows_kind(table: TableRows) -> str:
    return _dtype_name(table.rows) + (" with scales" if table.scales is not None else "")


def _describe(t: torch.Tensor) -> str:
    return f"{_dtype_name(t)} {list(t.shape)}"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes_of(a.flatten()), _bytes_of(b.flatten()))


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether the bits of ``a`` and ``b`` differ anywhere (NaNs and -0.0 compared as bits)."""
    return (_bytes_of(a.flatten(1)) != _bytes_of(b.flatten(1))).any(dim=1)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _no_ids() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)

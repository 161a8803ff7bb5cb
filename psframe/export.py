"""A feed for serving: snapshots of a model without its optimizer state, and updates between them.

A recommendation model trains for weeks while it serves. Serving takes a
:class:`Snapshot` of a checkpoint once (every parameter whole, and the rows of
each dynamic embedding table; never optimizer state), then a stream of
:class:`SnapshotUpdate` records, each taking the snapshot of one step to a
later one::

    from psframe import export

    base = export.export_checkpoint("ckpt/")                 # the latest valid checkpoint
    export.write_snapshot(base, "s3://feed/base.safetensors")
    ...                                                      # training goes on; a newer checkpoint
    newer = export.export_checkpoint("ckpt/")
    export.write_update(export.diff_snapshots(base, newer), "s3://feed/update-1.safetensors")

    # the serving side
    model = export.read_snapshot("s3://feed/base.safetensors")
    model = export.apply_update(model, export.read_update("s3://feed/update-1.safetensors"))

:func:`apply_update` does not care how an update was made: from two
snapshots (:func:`diff_snapshots`), or from anything else that knows the
rows made, changed and evicted since the base step.

Files are safetensors (an open format that readers in many languages load
without running code), written atomically (a temporary name, then moved into
place) and through fsspec, so paths may be any fsspec URL. The tensors'
names::

    snapshot                         update
    dense/<name>                     dense/<name>           a parameter (an update: its new value)
    table/<name>/ids                 upsert/<name>/ids      int64 ids, sorted: a table's rows / rows made or changed
    table/<name>/rows                upsert/<name>/rows     their rows, row i of ids[i]
                                     delete/<name>/ids      int64 ids, sorted: rows gone (tombstones)

and the header's metadata (safetensors' string to string map): ``format``
(``"psframe-snapshot"`` or ``"psframe-update"``), ``format_version``
(``"1"``), ``step``, ``base_step`` (an update's) and ``sha256`` (of the bytes
after the header, checked on reading).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from psframe import checkpoint
from psframe.checkpoint.dynamic import dynamic_parts_of, gather
from psframe.checkpoint.slices import assemble
from psframe.checkpoint.tensor_file import read_tensors, write_tensors
from psframe.errors import CheckpointError, SnapshotError

__all__ = [
    "FORMAT_VERSION",
    "Snapshot",
    "SnapshotUpdate",
    "TableRows",
    "TableUpdate",
    "apply_update",
    "diff_snapshots",
    "export_checkpoint",
    "export_delta",
    "read_snapshot",
    "read_update",
    "write_snapshot",
    "write_update",
]

SNAPSHOT_FORMAT = "psframe-snapshot"
UPDATE_FORMAT = "psframe-update"
FORMAT_VERSION = 1
"""The version of the file format written; every version in ``READABLE_VERSIONS`` is read."""
READABLE_VERSIONS = (1,)


# ---- what serving holds


@dataclass(frozen=True, eq=False)
class TableRows:
    """The rows of a dynamic embedding table: ``rows[i]`` is the row of ``ids[i]``.

    Args:
        ids: int64, 1-d, sorted, each id once.
        rows: one row per id (2-d or more: ``[len(ids), *row_shape]``).

    Raises:
        SnapshotError: the ids are not so, or the rows do not match them.
    """

    ids: torch.Tensor
    rows: torch.Tensor

    def __post_init__(self) -> None:
        _check_ids(self.ids, "ids")
        if not isinstance(self.rows, torch.Tensor) or self.rows.dim() < 2 or self.rows.shape[0] != self.ids.numel():
            got = list(self.rows.shape) if isinstance(self.rows, torch.Tensor) else type(self.rows).__name__
            raise SnapshotError(f"rows must be a tensor of shape [{self.ids.numel()}, ...] (one per id), got {got}")

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass(frozen=True, eq=False)
class Snapshot:
    """What serving needs of a model at one step: its parameters and its dynamic tables' rows.

    Attributes:
        step: the global step of the checkpoint it was made from.
        dense: every parameter whole, by name, as :func:`psframe.checkpoint.load`
            gives it (partitioned variables put back together, fixed
            embedding tables included).
        tables: the rows of each dynamic embedding table
            (:class:`psframe.DynamicEmbedding`), by parameter name.

    Optimizer state is never in it. ``==`` compares identity (tensors have
    no one truth value): two snapshots hold the same bits when
    :func:`diff_snapshots` finds no change between them.

    Raises:
        SnapshotError: a field is not of its type.
    """

    step: int
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    tables: dict[str, TableRows] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_step(self.step, "step")
        _check_tensors(self.dense, "dense")
        _check_named(self.tables, TableRows, "tables")


@dataclass(frozen=True, eq=False)
class TableUpdate:
    """What changed in one dynamic table: rows made or changed, and ids gone.

    Args:
        upsert: rows made or changed (ids sorted, each once).
        delete: ids gone (tombstones): int64, 1-d, sorted, each once.
            Deletes apply before upserts, so an id in both comes back with
            its row from ``upsert``.

    Raises:
        SnapshotError: the ids are not so.
    """

    upsert: TableRows
    delete: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.upsert, TableRows):
            raise SnapshotError(f"upsert must be a TableRows, got {type(self.upsert).__name__}")
        _check_ids(self.delete, "delete")


@dataclass(frozen=True, eq=False)
class SnapshotUpdate:
    """What changed between the snapshot of ``base_step`` and that of ``step``.

    Attributes:
        base_step: the step of the snapshot it applies to.
        step: the step of the snapshot it makes.
        dense: parameters that changed, their new values whole.
        tables: by table, the rows made or changed and the ids gone
            (:class:`TableUpdate`); a table not named did not change. A
            table the snapshot lacks is added, with the upsert's rows.

    Raises:
        SnapshotError: a field is not of its type, or ``step`` is before ``base_step``.
    """

    base_step: int
    step: int
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    tables: dict[str, TableUpdate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_step(self.base_step, "base_step")
        _check_step(self.step, "step")
        if self.step < self.base_step:
            raise SnapshotError(
                f"an update goes forward: its step ({self.step}) is before its base_step ({self.base_step})"
            )
        _check_tensors(self.dense, "dense")
        _check_named(self.tables, TableUpdate, "tables")


# ---- updates


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
            _check_rows_like(name, change.upsert.rows, snapshot.tables[name].rows)
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
        _check_rows_like(name, now.rows, before.rows)
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
    return TableRows(ids, torch.cat([held.rows[keep], change.upsert.rows])[order])


def _table_diff(before: TableRows, now: TableRows) -> TableUpdate:
    changed = torch.ones(len(now), dtype=torch.bool)
    if len(before) and len(now):
        at = torch.searchsorted(before.ids, now.ids).clamp_(max=len(before) - 1)
        found = before.ids[at] == now.ids
        changed[found] = _rows_differ(before.rows[at[found]], now.rows[found])
    delete = before.ids[~torch.isin(before.ids, now.ids)]
    return TableUpdate(TableRows(now.ids[changed], now.rows[changed]), delete)


# ---- from a checkpoint


def export_checkpoint(
    checkpoint_dir: str,
    step: int | None = None,
    *,
    min_row_norm: float | None = None,
    max_row_age_seconds: float | None = None,
    now: float | None = None,
) -> Snapshot:
    """The snapshot of a committed checkpoint: its parameters and dynamic tables' rows, no optimizer state.

    The thresholds evict more strictly for serving than training does: a
    row either leaves out is not in the snapshot, and stays in the
    checkpoint (they choose what serves, not what trains).

    Args:
        checkpoint_dir: the folder or fsspec URL given to the trainer.
        step: which checkpoint; None takes the latest valid one (a corrupted
            newer one is reported and skipped), as :func:`psframe.checkpoint.load` does.
        min_row_norm: leave out rows whose L2 norm is below this.
        max_row_age_seconds: leave out rows not looked up or updated for
            more than this many seconds before ``now`` (the times the
            checkpoint saved with each row).
        now: the wall-clock time (seconds since the epoch) ages count to;
            default: the current time.

    Returns:
        The snapshot, of the checkpoint's step.

    Raises:
        CheckpointError: there is no such (valid) checkpoint.
        SnapshotError: a threshold is not a number >= 0 (or ``now`` not a number), or
            ``max_row_age_seconds`` is given for a checkpoint whose tables
            have no times saved (one written before psframe timed rows).
    """
    for value, name in ((min_row_norm, "min_row_norm"), (max_row_age_seconds, "max_row_age_seconds")):
        if value is not None and not _is_number(value, minimum=0.0):
            raise SnapshotError(f"{name} ({value!r}) must be a number >= 0")
    if now is not None and not _is_number(now, minimum=-math.inf):
        raise SnapshotError(f"now ({now!r}) must be a number of seconds since the epoch")
    now = time.time() if now is None else now
    chain = checkpoint.read(checkpoint_dir, step)  # a full checkpoint and the deltas after it
    manifest = chain.last
    shards = chain.read_shards()
    plain = [replace(s, variables=tuple(v for v in s.variables if v.dynamic is None)) for s in shards]
    tables = {}
    for name, parts in sorted(dynamic_parts_of(shards).items()):
        held = gather(parts)
        keep = torch.ones(held["ids"].numel(), dtype=torch.bool)
        if min_row_norm is not None:
            keep &= _row_norms(held["rows"]) >= min_row_norm
        if max_row_age_seconds is not None:
            if "seen" not in held:
                raise SnapshotError(
                    f"table {name!r} of checkpoint {manifest.folder} has no times its rows were last used (it was "
                    f"saved before psframe kept them): max_row_age_seconds cannot apply; export without it"
                )
            keep &= now - held["seen"] <= max_row_age_seconds
        tables[name] = TableRows(held["ids"][keep], held["rows"][keep])
    return Snapshot(manifest.step, assemble(plain), tables)


def export_delta(
    checkpoint_dir: str,
    step: int | None = None,
    *,
    min_row_norm: float | None = None,
    max_row_age_seconds: float | None = None,
    now: float | None = None,
) -> SnapshotUpdate:
    """The update a delta checkpoint makes to the serving snapshot: from the export of its
    parent to the export of its own step (:func:`export_checkpoint`, with the same thresholds).

    Its upserts are the rows the delta made or changed (and that pass the
    thresholds), its deletes the ids evicted since the parent (tombstones)
    and those the thresholds now leave out, its dense values the parameters
    that changed.

    Args:
        checkpoint_dir: the folder or fsspec URL of the checkpoints.
        step: the delta's step; None takes the last delta of the latest valid chain.

    Raises:
        CheckpointError: there is no such valid delta (``step`` names a full
            checkpoint, or the chain to it is broken).
        SnapshotError: a threshold is out of range (as for :func:`export_checkpoint`).
    """
    chain = checkpoint.read(checkpoint_dir, step)
    delta = chain.last
    if delta.parent is None:
        raise CheckpointError(
            f"checkpoint step {delta.step} in {checkpoint_dir} is a full checkpoint, not a delta: "
            f"export it whole with export_checkpoint"
        )
    now = time.time() if now is None else now
    thresholds = {"min_row_norm": min_row_norm, "max_row_age_seconds": max_row_age_seconds, "now": now}
    before = export_checkpoint(checkpoint_dir, delta.parent, **thresholds)
    return diff_snapshots(before, export_checkpoint(checkpoint_dir, delta.step, **thresholds))


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    return rows.flatten(1).to(torch.float64).norm(dim=1)


# ---- files


def write_snapshot(snapshot: Snapshot, path: str) -> None:
    """Write ``snapshot`` to ``path`` (a file or fsspec URL) as safetensors, whole or not at all.

    Raises:
        SnapshotError: ``snapshot`` is not a :class:`Snapshot`, or holds a tensor
            safetensors cannot (sparse, or of a dtype it has no code for);
            nothing is written.
    """
    if not isinstance(snapshot, Snapshot):
        raise SnapshotError(f"write_snapshot needs a Snapshot, got {type(snapshot).__name__}")
    tensors = {f"dense/{name}": value for name, value in snapshot.dense.items()}
    for name, table in snapshot.tables.items():
        tensors[f"table/{name}/ids"], tensors[f"table/{name}/rows"] = table.ids, table.rows
    write_tensors(
        path, tensors, {"format": SNAPSHOT_FORMAT, "format_version": str(FORMAT_VERSION), "step": str(snapshot.step)}
    )


def read_snapshot(path: str) -> Snapshot:
    """The snapshot :func:`write_snapshot` wrote to ``path``.

    Raises:
        SnapshotError: no such file, not a psframe snapshot (another
            safetensors file, an update, another format version), or corrupt.
    """
    metadata, groups = _read(path, SNAPSHOT_FORMAT)
    try:
        return Snapshot(
            _step_of(metadata, "step"),
            {name: t["value"] for name, t in groups["dense"].items()},
            {name: TableRows(t["ids"], t["rows"]) for name, t in groups["table"].items()},
        )
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from e


def write_update(update: SnapshotUpdate, path: str) -> None:
    """Write ``update`` to ``path`` (a file or fsspec URL) as safetensors, whole or not at all.

    Raises:
        SnapshotError: ``update`` is not a :class:`SnapshotUpdate`, or holds a tensor
            safetensors cannot (sparse, or of a dtype it has no code for);
            nothing is written.
    """
    if not isinstance(update, SnapshotUpdate):
        raise SnapshotError(f"write_update needs a SnapshotUpdate, got {type(update).__name__}")
    tensors = {f"dense/{name}": value for name, value in update.dense.items()}
    for name, change in update.tables.items():
        tensors[f"upsert/{name}/ids"], tensors[f"upsert/{name}/rows"] = change.upsert.ids, change.upsert.rows
        tensors[f"delete/{name}/ids"] = change.delete
    steps = {"base_step": str(update.base_step), "step": str(update.step)}
    write_tensors(path, tensors, {"format": UPDATE_FORMAT, "format_version": str(FORMAT_VERSION), **steps})


def read_update(path: str) -> SnapshotUpdate:
    """The update :func:`write_update` wrote to ``path``.

    Raises:
        SnapshotError: no such file, not a psframe update (another
            safetensors file, a snapshot, another format version), or corrupt.
    """
    metadata, groups = _read(path, UPDATE_FORMAT)
    try:
        return SnapshotUpdate(
            _step_of(metadata, "base_step"),
            _step_of(metadata, "step"),
            {name: t["value"] for name, t in groups["dense"].items()},
            {
                name: TableUpdate(TableRows(t["ids"], t["rows"]), groups["delete"][name]["ids"])
                for name, t in groups["upsert"].items()
            },
        )
    except SnapshotError as e:
        raise SnapshotError(f"{path}: {e}") from e


# What each format holds: tensor groups and, for each, the parts every name has.
_LAYOUT = {
    SNAPSHOT_FORMAT: {"dense": ("value",), "table": ("ids", "rows")},
    UPDATE_FORMAT: {"dense": ("value",), "upsert": ("ids", "rows"), "delete": ("ids",)},
}
_KEYS = {
    SNAPSHOT_FORMAT: "dense/<name>, table/<name>/ids and table/<name>/rows",
    UPDATE_FORMAT: "dense/<name>, upsert/<name>/ids, upsert/<name>/rows and delete/<name>/ids",
}


def _read(path: str, kind: str) -> tuple[dict[str, str], dict[str, dict[str, dict[str, torch.Tensor]]]]:
    """The metadata and tensors of a file of format ``kind``, by group, name and part, checked."""
    metadata, tensors = read_tensors(path, kind, READABLE_VERSIONS)
    return metadata, _grouped(path, kind, tensors)


def _grouped(path: str, kind: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``{"dense": {name: {"value": t}}, "table": {name: {"ids": t, "rows": t}}, ...}``, each name with its parts."""
    layout = _LAYOUT[kind]
    groups: dict[str, dict[str, dict[str, torch.Tensor]]] = {group: {} for group in layout}
    for key, tensor in tensors.items():
        group, _, rest = key.partition("/")
        name, part = (rest, "value") if layout.get(group) == ("value",) else rest.rpartition("/")[::2]
        if group not in layout or part not in layout[group] or not name:
            raise SnapshotError(f"{path} holds a tensor {key!r}; a {kind} file holds {_KEYS[kind]} only")
        groups[group].setdefault(name, {})[part] = tensor
    for group, parts in layout.items():
        for name, held in groups[group].items():
            missing = [f"{group}/{name}/{p}" for p in parts if p not in held]
            if missing:
                raise SnapshotError(f"{path} lacks {missing}")
    if kind == UPDATE_FORMAT and set(groups["upsert"]) != set(groups["delete"]):
        raise SnapshotError(
            f"{path} names tables {sorted(set(groups['upsert']) ^ set(groups['delete']))} in upsert/ or in delete/ "
            f"but not in both"
        )
    return groups


def _step_of(metadata: Mapping[str, str], key: str) -> int:
    try:
        return int(metadata[key])
    except (KeyError, ValueError) as e:
        raise SnapshotError(f"its metadata has no {key} as an int (found {metadata.get(key)!r})") from e


# ---- checks


def _check_step(step: Any, name: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SnapshotError(f"{name} ({step!r}) must be an int >= 0")


def _check_ids(ids: Any, name: str) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        got = f"{ids.dtype} of shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise SnapshotError(f"{name} must be a 1-d int64 tensor, got {got}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        at = int(torch.nonzero(ids[1:] <= ids[:-1])[0])
        raise SnapshotError(f"{name} must be sorted, each once; {int(ids[at])} comes before {int(ids[at + 1])}")


def _check_tensors(tensors: Any, name: str) -> None:
    _check_named(tensors, torch.Tensor, name)


def _check_named(values: Any, cls: type, name: str) -> None:
    if not isinstance(values, dict):
        raise SnapshotError(f"{name} must be a dict of name to {cls.__name__}, got {type(values).__name__}")
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise SnapshotError(f"{name} names must be non-empty strings, got {key!r}")
        if not isinstance(value, cls):
            raise SnapshotError(f"{name}[{key!r}] must be a {cls.__name__}, got {type(value).__name__}")


def _check_like(what: str, value: torch.Tensor, held: torch.Tensor) -> None:
    if value.shape != held.shape or value.dtype != held.dtype:
        raise SnapshotError(
            f"{what} is {_describe(held)} in the snapshot; the update's is {_describe(value)}; nothing was applied"
        )


def _check_rows_like(table: str, rows: torch.Tensor, held: torch.Tensor) -> None:
    if rows.shape[1:] != held.shape[1:] or rows.dtype != held.dtype:
        raise SnapshotError(
            f"table {table!r} has rows of {_dtype_name(held)} {list(held.shape[1:])}; the update's are "
            f"{_dtype_name(rows)} {list(rows.shape[1:])}; nothing was applied"
        )


def _describe(t: torch.Tensor) -> str:
    return f"{_dtype_name(t)} {list(t.shape)}"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _is_number(value: Any, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bytes_of(a.flatten()), _bytes_of(b.flatten()))


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether the bits of ``a`` and ``b`` differ anywhere (NaNs and -0.0 compared as bits)."""
    return (_bytes_of(a.flatten(1)) != _bytes_of(b.flatten(1))).any(dim=1)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _no_ids() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)

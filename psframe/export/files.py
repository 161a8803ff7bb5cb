"""Snapshot and update files: :func:`write_snapshot`, :func:`read_snapshot`, :func:`write_update`
and :func:`read_update`.

A file is safetensors, written whole or not at all through fsspec
(:mod:`psframe.checkpoint.tensor_file`); the tensors' names and the
header's metadata are those :mod:`psframe.export` describes. Reading checks
the format, its version and the checksum, then that every tensor name fits
the layout of its format before any snapshot or update is made of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from psframe.checkpoint.tensor_file import read_tensors, write_tensors
from psframe.errors import SnapshotError
from psframe.export.snapshot import Snapshot, SnapshotUpdate, TableRows, TableUpdate

SNAPSHOT_FORMAT = "psframe-snapshot"
UPDATE_FORMAT = "psframe-update"
FORMAT_VERSION = 1
"""The version of the file format written, but for files holding int8 rows (:data:`INT8_VERSION`);
every version in ``READABLE_VERSIONS`` is read."""
INT8_VERSION = 2
"""The version of files whose tables hold int8 rows with their scales (``<group>/<name>/scales``)."""
READABLE_VERSIONS = (1, 2)


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
        tensors.update(_table_tensors("table", name, table))
    version = _version_of(snapshot.tables.values())
    write_tensors(path, tensors, {"format": SNAPSHOT_FORMAT, "format_version": version, "step": str(snapshot.step)})


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
            {name: TableRows(t["ids"], t["rows"], t.get("scales")) for name, t in groups["table"].items()},
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
        tensors.update(_table_tensors("upsert", name, change.upsert))
        tensors[f"delete/{name}/ids"] = change.delete
    steps = {"base_step": str(update.base_step), "step": str(update.step)}
    version = _version_of(change.upsert for change in update.tables.values())
    write_tensors(path, tensors, {"format": UPDATE_FORMAT, "format_version": version, **steps})


def _table_tensors(group: str, name: str, table: TableRows) -> dict[str, torch.Tensor]:
    tensors = {f"{group}/{name}/ids": table.ids, f"{group}/{name}/rows": table.rows}
    if table.scales is not None:
        tensors[f"{group}/{name}/scales"] = table.scales
    return tensors


def _version_of(tables: Iterable[TableRows]) -> str:
    """The oldest version that holds ``tables``: readers of version 1 know no scales."""
    return str(INT8_VERSION if any(t.scales is not None for t in tables) else FORMAT_VERSION)


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
                name: TableUpdate(TableRows(t["ids"], t["rows"], t.get("scales")), groups["delete"][name]["ids"])
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
_OPTIONAL = {"table": ("scales",), "upsert": ("scales",)}  # parts a name may have (int8 rows' scales)
_KEYS = {
    SNAPSHOT_FORMAT: "dense/<name>, table/<name>/ids, table/<name>/rows (and /scales)",
    UPDATE_FORMAT: "dense/<name>, upsert/<name>/ids, upsert/<name>/rows (and /scales) and delete/<name>/ids",
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
        if group not in layout or part not in layout[group] + _OPTIONAL.get(group, ()) or not name:
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

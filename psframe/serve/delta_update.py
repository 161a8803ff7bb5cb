"""A delta checkpoint as an update of the served snapshot, read from the delta's own shards only.

:func:`psframe.export.export_delta` makes the same update by exporting the delta's parent and
the delta whole and comparing them: it reads the full checkpoint and every delta of the chain
twice. ``psframe serve`` holds the snapshot of the parent already, so it reads just the
delta's shards (:func:`psframe.checkpoint.deltas.read_delta`, size and sha256 checked) and
turns what they hold into a :class:`psframe.export.SnapshotUpdate`:

- a dense variable part saved whole in the delta is put at its rows of the parameter;
- a fixed table part's changed rows go to their rows of the table (``row_start + index * stride``);
- a dynamic table part's changed rows are upserts, its evicted ids deletes (tombstones).

Where each stored part lies in the model is the :class:`PartLayout` of the chain's full
checkpoint (a delta follows its parent's layout; a re-layout takes a full checkpoint). The
result, applied with :func:`psframe.export.apply_update`, holds the bits of
:func:`psframe.export.export_checkpoint` at the delta's step (``tests/unit/test_serve_follower.py``).
No thresholds (``min_row_norm``, ``max_row_age_seconds``): an age threshold needs every row's
time, not only the changed ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe.checkpoint import Manifest
from psframe.checkpoint.deltas import DeltaShard, read_delta
from psframe.checkpoint.shard import ShardData
from psframe.errors import CheckpointError
from psframe.export import Snapshot, SnapshotUpdate, TableRows, TableUpdate


@dataclass(frozen=True)
class PartPlace:
    """Where one stored part of a parameter lies: rows ``row_start``, ``row_start + row_stride``, ...
    (``rows`` of them) of ``variable``, whose whole shape is ``full_shape``."""

    variable: str
    row_start: int
    row_stride: int
    rows: int
    full_shape: tuple[int, ...]
    dynamic: bool

    def global_rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of the whole parameter that the part's rows ``index`` (None: all of them) are."""
        local = torch.arange(self.rows, dtype=torch.int64) if index is None else index.to(torch.int64)
        return self.row_start + local * self.row_stride

    def is_whole(self) -> bool:
        """Whether the part is its parameter whole (one part, or a 0-d parameter)."""
        return not self.full_shape or (self.row_start == 0 and self.rows == self.full_shape[0])


@dataclass(frozen=True)
class PartLayout:
    """Where each stored part of a checkpoint chain lies in the model, by stored name."""

    num_shards: int
    parts: Mapping[str, PartPlace]

    @classmethod
    def of_shards(cls, shards: Sequence[ShardData]) -> PartLayout:
        """The layout of a full checkpoint's shards (every ps task's)."""
        parts = {
            var.name: PartPlace(
                var.variable,
                var.row_start,
                max(1, var.row_stride),
                var.shape[0] if var.shape else 1,
                tuple(var.full_shape),
                var.dynamic is not None,
            )
            for shard in shards
            for var in shard.variables
        }
        return cls(len(shards), parts)

    def place(self, name: str, ps_task: int) -> PartPlace:
        """The place of stored part ``name``.

        Raises:
            CheckpointError: the chain's full checkpoint holds no such part.
        """
        place = self.parts.get(name)
        if place is None:
            raise CheckpointError(
                f"the delta of ps task {ps_task} changes {name!r}, which the full checkpoint of its chain does not hold"
            )
        return place


def read_delta_update(manifest: Manifest, layout: PartLayout, served: Snapshot) -> SnapshotUpdate:
    """The update delta checkpoint ``manifest`` makes of ``served`` (the snapshot of its parent).

    Raises:
        CheckpointCorruptError: a shard is missing, truncated or fails its sha256.
        CheckpointError: the delta does not follow ``served`` (its parent is another step), it was
            written by another number of ps tasks than the chain's, a shard is malformed, or it
            changes a part the chain's full checkpoint does not hold.
    """
    if manifest.parent != served.step:
        raise CheckpointError(
            f"the delta of step {manifest.step} follows step {manifest.parent}; "
            f"the served version is of step {served.step}"
        )
    if manifest.num_shards != layout.num_shards:
        raise CheckpointError(
            f"the delta of step {manifest.step} has {manifest.num_shards} shards, its chain's full checkpoint "
            f"{layout.num_shards} (a re-layout takes a full checkpoint)"
        )
    deltas = [read_delta(manifest, k) for k in range(manifest.num_shards)]
    return update_of_deltas(deltas, layout, served, manifest.step)


def update_of_deltas(deltas: Sequence[DeltaShard], layout: PartLayout, served: Snapshot, step: int) -> SnapshotUpdate:
    """The update every ps task's delta shard of step ``step`` makes of ``served``; ``served`` is left as it is."""
    dense_parts: dict[str, list[tuple[PartPlace, torch.Tensor | None, torch.Tensor]]] = {}
    table_parts: dict[str, list[Mapping]] = {}
    for delta in deltas:
        for name, (value, _state) in delta.variables.items():
            place = layout.place(name, delta.ps_task)
            dense_parts.setdefault(place.variable, []).append((place, None, value))
        for name, changes in delta.rows.items():
            place = layout.place(name, delta.ps_task)
            dense_parts.setdefault(place.variable, []).append((place, changes.index, changes.value))
        for name, part in delta.dynamic.items():
            place = layout.place(name, delta.ps_task)
            table_parts.setdefault(place.variable, []).append(part)
    dense = {variable: _dense_value(served, variable, parts) for variable, parts in dense_parts.items()}
    tables = {variable: _table_update(served, variable, parts) for variable, parts in table_parts.items()}
    return SnapshotUpdate(served.step, step, dense, tables)


def _dense_value(
    served: Snapshot, variable: str, parts: list[tuple[PartPlace, torch.Tensor | None, torch.Tensor]]
) -> torch.Tensor:
    """The new value of a parameter: its changed parts (whole) or rows put into a copy of the served one."""
    held = served.dense.get(variable)
    if held is None:
        raise CheckpointError(f"the delta changes parameter {variable!r}, which the served version does not hold")
    if len(parts) == 1 and parts[0][1] is None and parts[0][0].is_whole():
        return parts[0][2].to(held.dtype).reshape(held.shape)  # the part is the parameter: nothing to copy
    value = held.clone()  # never in place: a request may be reading the served one
    for place, index, rows in parts:
        value.index_copy_(0, place.global_rows(index), rows.to(held.dtype))
    return value


def _table_update(served: Snapshot, variable: str, parts: list[Mapping]) -> TableUpdate:
    """A dynamic table's upserts (changed rows of every part, sorted by id) and deletes (evicted ids)."""
    ids = torch.cat([part["ids"] for part in parts])
    rows = torch.cat([part["rows"] for part in parts])
    held = served.tables.get(variable)
    if held is not None:
        rows = rows.to(held.rows.dtype)
    ids, order = torch.sort(ids)
    deleted = torch.unique(torch.cat([part["deleted"] for part in parts]))  # sorted, each once
    return TableUpdate(TableRows(ids, rows[order]), deleted)


__all__ = ["PartLayout", "PartPlace", "read_delta_update", "update_of_deltas"]

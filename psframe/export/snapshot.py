"""What serving holds: the :class:`Snapshot` of a model at one step and the :class:`SnapshotUpdate` between two.

Plain frozen dataclasses of tensors (:class:`TableRows`, :class:`TableUpdate`
for one dynamic table), each checking its fields when made, so that a
snapshot or update that exists is well formed: steps are ints >= 0, ids
int64, 1-d, sorted and each once, one row per id. They know nothing of
checkpoints or files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from psframe.errors import SnapshotError


@dataclass(frozen=True, eq=False)
class TableRows:
    """The rows of a dynamic embedding table: ``rows[i]`` is the row of ``ids[i]``.

    Args:
        ids: int64, 1-d, sorted, each id once.
        rows: one row per id (2-d or more: ``[len(ids), *row_shape]``).
        scales: for int8 rows (:func:`psframe.export.quantize_int8`), one float32 scale per
            row: the row is ``rows[i] * scales[i]``; None for rows stored as they are.

    Raises:
        SnapshotError: the ids are not so, or the rows or scales do not match them.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_ids(self.ids, "ids")
        if not isinstance(self.rows, torch.Tensor) or self.rows.dim() < 2 or self.rows.shape[0] != self.ids.numel():
            got = list(self.rows.shape) if isinstance(self.rows, torch.Tensor) else type(self.rows).__name__
            raise SnapshotError(f"rows must be a tensor of shape [{self.ids.numel()}, ...] (one per id), got {got}")
        if self.scales is not None:
            scales = self.scales
            if (
                not isinstance(scales, torch.Tensor)
                or scales.dtype != torch.float32
                or tuple(scales.shape) != (self.ids.numel(),)
                or self.rows.dtype != torch.int8
            ):
                kind = f"{scales.dtype} {list(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales)
                raise SnapshotError(
                    f"scales go with int8 rows, one float32 per row ([{self.ids.numel()}]); got {kind} "
                    f"for {str(self.rows.dtype).removeprefix('torch.')} rows"
                )

    def __len__(self) -> int:
        return self.ids.numel()

    def values(self) -> torch.Tensor:
        """The rows as values: int8 rows times their scales (float32), other rows as they are."""
        if self.scales is None:
            return self.rows
        return self.rows.float() * self.scales.reshape([-1] + [1] * (self.rows.dim() - 1))

    def take(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows and scales (None without) at ``keep`` (a mask or indices)."""
        return self.rows[keep], None if self.scales is None else self.scales[keep]


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
    :func:`psframe.export.diff_snapshots` finds no change between them.

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


# ---- checks of the fields


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

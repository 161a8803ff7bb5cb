"""Re-partitioning a checkpoint: whole variables, or the rows a ps task now holds.

Rebuilds variables from the shards of a checkpoint (the :class:`ShardData`
records :func:`psframe.checkpoint.files.read_shard` returns), for reading one
with no cluster running or for restoring onto a different number of ps tasks
than saved it. :func:`assemble` returns the full variables; :func:`slice_rows`
returns any range of rows of one variable together with its optimizer state,
taken from whichever parts hold them.

An embedding table shared out by id modulo its parts has parts of strided
rows (``row_stride`` > 1: rows ``row_start``, ``row_start + row_stride``,
...); such a variable is rebuilt whole first (:func:`strided_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import torch

from psframe.checkpoint.dynamic import gather
from psframe.checkpoint.shard import ShardData, VariableData
from psframe.errors import CheckpointError
from psframe.optim.row_state import is_row_state


def assemble(shards: Sequence[ShardData]) -> dict[str, torch.Tensor]:
    """The full variables held by ``shards``, by model-parameter name.

    Parts are concatenated along dim 0 in ``row_start`` order.

    Args:
        shards: shards of one checkpoint, in any order (all of them, for
            every variable to be whole).

    Returns:
        Every variable of the shards, by its ``variable`` name; a dynamic
        table ``name`` as ``name.ids`` (sorted) and ``name.rows``.

    Raises:
        CheckpointError: parts of a variable disagree on its shape or dtype,
            overlap, or leave rows uncovered.
    """
    result = {}
    for variable, parts in _parts_by_variable(shards).items():
        if parts[0].dynamic is not None:  # any ids: the ids held and their rows
            held = gather(parts)
            result[f"{variable}.ids"], result[f"{variable}.rows"] = held["ids"], held["rows"]
            continue
        full_shape = parts[0].full_shape
        if any(_stride(p) > 1 for p in parts):
            result[variable] = _whole(variable, parts)[0]
            continue
        if not full_shape:
            result[variable] = _single(variable, parts).value
            continue
        _check_cover(variable, parts, 0, full_shape[0])
        result[variable] = torch.cat([p.value for p in parts])
    return result


def slice_rows(shards: Sequence[ShardData], variable: str, row_start: int, row_end: int) -> tuple[torch.Tensor, dict]:
    """Rows ``[row_start, row_end)`` of ``variable`` and their optimizer state.

    For restoring onto a different partitioning: the rows are taken from
    whichever parts hold them. Element-wise state is sliced and concatenated
    like the value; scalar state (e.g. Adam's ``step``) is taken from the
    first part that overlaps the rows. A 0-d variable has the one row
    ``[0, 1)``. The results are new tensors.

    Args:
        shards: the shards of one checkpoint, in any order.
        variable: the model parameter's name.
        row_start: the first row wanted.
        row_end: one past the last row wanted.

    Returns:
        The rows, and their optimizer state by key.

    Raises:
        CheckpointError: the variable is unknown, the range is out of bounds,
            or some rows are held by no part.
    """
    parts = _parts_by_variable(shards).get(variable)
    if parts is None:
        raise CheckpointError(f"the checkpoint holds no variable {variable!r}")
    full_shape = parts[0].full_shape
    rows = full_shape[0] if full_shape else 1
    if not 0 <= row_start < row_end <= rows:
        raise CheckpointError(f"rows [{row_start}, {row_end}) of {variable!r} are out of range; it has {rows} rows")
    if not full_shape:
        part = _single(variable, parts)
        return part.value.clone(), _copy_state(part.state)
    pieces: list[tuple[VariableData, int, int]] = []
    cursor = row_start
    for part in parts:
        start, end = part.row_start, part.row_start + part.shape[0]
        if end <= row_start or start >= row_end:
            continue
        if start > cursor:
            raise CheckpointError(f"rows [{cursor}, {start}) of {variable!r} are in no part")
        if pieces and start < cursor:
            raise CheckpointError(
                f"parts of {variable!r} overlap on rows [{start}, {cursor}): {pieces[-1][0].name!r} and {part.name!r}"
            )
        lo, hi = max(start, row_start) - start, min(end, row_end) - start
        pieces.append((part, lo, hi))
        cursor = min(end, row_end)
    if cursor < row_end:
        raise CheckpointError(f"rows [{cursor}, {row_end}) of {variable!r} are in no part")

    value = torch.cat([p.value[lo:hi] for p, lo, hi in pieces])
    first = pieces[0][0]
    state = {}
    for key, x in first.state.items():
        if not _elementwise(x, first):
            state[key] = x.clone() if isinstance(x, torch.Tensor) else x
            continue
        chunks = []
        for part, lo, hi in pieces:
            y = part.state.get(key)
            if not _elementwise(y, part):
                raise CheckpointError(
                    f"parts of {variable!r} disagree on optimizer state {key!r}: "
                    f"{first.name!r} holds it per row, {part.name!r} does not"
                )
            chunks.append(y[lo:hi])
        state[key] = torch.cat(chunks)
    for part, _, _ in pieces[1:]:
        if set(part.state) != set(first.state):
            raise CheckpointError(
                f"parts of {variable!r} disagree on optimizer state: {first.name!r} "
                f"has {sorted(first.state)}, {part.name!r} has {sorted(part.state)}"
            )
    return value, state


def strided_rows(
    shards: Sequence[ShardData], variable: str, row_start: int, count: int, row_stride: int
) -> tuple[torch.Tensor, dict]:
    """Rows ``row_start``, ``row_start + row_stride``, ... (``count`` of them) of
    ``variable`` and their optimizer state, as :func:`slice_rows` gives a range.

    The variable is rebuilt whole from its parts first (strided or not), then
    the rows are taken: memory for the whole variable and its state, once.

    Raises:
        CheckpointError: the variable is unknown, the rows are out of bounds,
            or some rows are held by no part (or by two).
    """
    parts = _parts_by_variable(shards).get(variable)
    if parts is None:
        raise CheckpointError(f"the checkpoint holds no variable {variable!r}")
    rows = parts[0].full_shape[0] if parts[0].full_shape else 1
    if count < 1 or row_stride < 1 or not 0 <= row_start or row_start + (count - 1) * row_stride >= rows:
        raise CheckpointError(
            f"{count} rows of {variable!r} from {row_start} every {row_stride} are out of range; it has {rows} rows"
        )
    value, state = _whole(variable, parts)
    ids = torch.arange(row_start, row_start + count * row_stride, row_stride)
    return value[ids], {k: x[ids] if is_row_state(x, value.shape) else x for k, x in state.items()}


# ---- helpers


def _stride(part: VariableData) -> int:
    return max(1, part.row_stride)


def _whole(variable: str, parts: list[VariableData]) -> tuple[torch.Tensor, dict]:
    """The whole variable and its optimizer state (element-wise state whole,
    scalar state from the first part), from parts of contiguous or strided rows."""
    first = parts[0]
    if not first.full_shape:
        part = _single(variable, parts)
        return part.value.clone(), _copy_state(part.state)
    value = torch.empty(tuple(first.full_shape), dtype=first.value.dtype)
    held = torch.zeros(first.full_shape[0], dtype=torch.int64)
    state: dict[str, Any] = {}
    for part in parts:
        ids = torch.arange(part.row_start, part.row_start + part.shape[0] * _stride(part), _stride(part))
        if ids.numel() and int(ids[-1]) >= held.numel():
            raise CheckpointError(f"part {part.name!r} of {variable!r} holds rows past its {held.numel()}")
        value[ids] = part.value
        held[ids] += 1
        if set(part.state) != set(first.state):
            raise CheckpointError(
                f"parts of {variable!r} disagree on optimizer state: {first.name!r} "
                f"has {sorted(first.state)}, {part.name!r} has {sorted(part.state)}"
            )
        for key, x in part.state.items():
            if _elementwise(x, part):
                whole_shape = (first.full_shape[0], *x.shape[1:])
                whole = state.setdefault(key, torch.empty(whole_shape, dtype=x.dtype))
                if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != whole_shape:
                    raise CheckpointError(f"parts of {variable!r} disagree on optimizer state {key!r}")
                whole[ids] = x
            else:
                state.setdefault(key, x.clone() if isinstance(x, torch.Tensor) else x)
    if not bool((held == 1).all()):
        row = int(torch.nonzero(held != 1)[0])
        raise CheckpointError(f"row {row} of {variable!r} is held by {int(held[row])} parts; expected one")
    return value, state


def _parts_by_variable(shards: Sequence[ShardData]) -> dict[str, list[VariableData]]:
    """Parts of every variable, sorted by row_start, checked to agree on shape and dtype."""
    parts: dict[str, list[VariableData]] = {}
    for shard in shards:
        for var in shard.variables:
            parts.setdefault(var.variable, []).append(var)
    for variable, group in parts.items():
        group.sort(key=lambda p: (p.row_start, p.part_index))
        first = group[0]
        for part in group[1:]:
            if list(part.full_shape) != list(first.full_shape) or part.dtype != first.dtype:
                raise CheckpointError(
                    f"parts of {variable!r} disagree: {first.name!r} is {first.dtype} "
                    f"{list(first.full_shape)}, {part.name!r} is {part.dtype} "
                    f"{list(part.full_shape)}"
                )
    return parts


def _check_cover(variable: str, parts: list[VariableData], start: int, end: int) -> None:
    """Parts (sorted by row_start) cover rows [start, end) exactly once."""
    cursor = start
    for part in parts:
        if part.row_start > cursor:
            raise CheckpointError(f"rows [{cursor}, {part.row_start}) of {variable!r} are in no part")
        if part.row_start < cursor:
            raise CheckpointError(
                f"parts of {variable!r} overlap on rows [{part.row_start}, {cursor}) "
                f"({part.name!r} starts inside an earlier part)"
            )
        cursor = part.row_start + part.shape[0]
    if cursor != end:
        raise CheckpointError(f"rows [{cursor}, {end}) of {variable!r} are in no part")


def _single(variable: str, parts: list[VariableData]) -> VariableData:
    if len(parts) != 1:
        raise CheckpointError(f"0-d variable {variable!r} is stored {len(parts)} times; expected once")
    return parts[0]


def _elementwise(x: Any, part: VariableData) -> TypeGuard[torch.Tensor]:
    """Whether ``x`` is per-row state of ``part`` (:func:`psframe.optim.row_state.is_row_state`)."""
    return is_row_state(x, part.value.shape)


def _copy_state(state: Mapping) -> dict:
    return {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in state.items()}

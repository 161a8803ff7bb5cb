"""Functions of ids and rows that a dynamic table's parts and their readers share: which part
holds an id (:func:`part_of`), the row an id starts with (:func:`initial_rows`), and the sparse
gradient of pushed rows (:func:`row_gradient`). Plain torch and numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy
import torch

from psframe.optim.row_state import is_row_state
from psframe.optim.rows_kernels import strictly_increasing
from psframe.tables.spec import ID_MIX, RowInitializer

_MASK = 0xFFFFFFFFFFFFFFFF
_SEED_MIX = 0xD1B54A32D192ED03


def part_of(ids: torch.Tensor, num_parts: int) -> torch.Tensor:
    """The part of a dynamic table holding each id (int64 in, int64 out):
    :func:`psframe.tables.spec.dynamic_part`, for a tensor of ids."""
    if num_parts == 1:
        return torch.zeros_like(ids)
    mixed = (ids.numpy().view(numpy.uint64) * numpy.uint64(ID_MIX)) >> numpy.uint64(32)  # wraps modulo 2^64
    return torch.from_numpy((mixed % numpy.uint64(num_parts)).astype(numpy.int64))


def row_gradient(rows: torch.Tensor, values: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The sparse gradient of a table of ``shape`` whose rows ``rows`` (int64, any order, maybe
    repeated) have gradients ``values``: coalesced, repeats summed, as backward makes them.

    Rows that are distinct (a worker's push: each id once) are only sorted, which costs a tenth
    of coalescing and gives the same tensor."""
    if rows.numel() > 1:
        ordered, ordered_values = rows, values
        distinct = strictly_increasing(rows)  # and sorted already
        if not distinct:
            order = torch.argsort(rows)
            ordered, ordered_values = rows.index_select(0, order), values.index_select(0, order)
            distinct = strictly_increasing(ordered)  # else repeats, summed below
        if distinct:
            return torch.sparse_coo_tensor(
                ordered.unsqueeze(0), ordered_values, tuple(shape), check_invariants=False, is_coalesced=True
            )
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, tuple(shape), check_invariants=False).coalesce()


def summed_by_id(ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each id of ``ids`` once (sorted) and its ``values`` summed: as they are where the ids are
    sorted and distinct already (a worker's push). Repeats are summed in an order of the ids alone,
    so that where rows sit in memory never changes the sums' bits."""
    if ids.numel() < 2 or strictly_increasing(ids):
        return ids, values
    distinct, position = torch.unique(ids, return_inverse=True)
    shape = (distinct.numel(), *values.shape[1:])
    total = torch.sparse_coo_tensor(position.unsqueeze(0), values, shape, check_invariants=False).coalesce()
    return distinct[total.indices()[0]], total.values()


def initial_rows(
    initializer: RowInitializer, ids: torch.Tensor, row_shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The rows ``initializer`` gives ``ids`` (int64, any values): one torch
    generator per id, seeded from the id and the initializer's seed, so a
    row never depends on which other ids come with it."""
    rows = torch.empty((ids.numel(), *row_shape), dtype=torch.float32)
    if initializer.distribution == "constant":
        rows.fill_(initializer.value)
        return rows.to(dtype)
    generator = torch.Generator()
    seed_bits = (initializer.seed * _SEED_MIX) & _MASK
    for i, table_id in enumerate(ids.tolist()):
        generator.manual_seed(((table_id ^ seed_bits) * ID_MIX) & _MASK)
        if initializer.distribution == "normal":
            rows[i].normal_(initializer.mean, initializer.std, generator=generator)
        else:
            rows[i].uniform_(initializer.low, initializer.high, generator=generator)
    return rows.to(dtype)


def rows_between(saved: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    """``saved`` (as :meth:`~psframe.tables.dynamic_rows.DynamicRows.export` gives it) with its
    per-row entries cut to rows ``start:end``."""
    shape = tuple(saved["rows"].shape)
    if start == 0 and end >= shape[0]:
        return dict(saved)
    cut = {key: value[start:end] if is_row_state(value, shape[:1]) else value for key, value in saved.items()}
    cut["rows"] = saved["rows"][start:end]
    cut["state"] = {k: v[start:end] if is_row_state(v, shape) else v for k, v in saved["state"].items()}
    return cut


__all__ = ["initial_rows", "part_of", "row_gradient", "rows_between", "summed_by_id"]

"""Functions of ids and rows that a dynamic table's parts and their readers share: which part
holds an id (:func:`part_of`), the row an id starts with (:func:`initial_rows`), and the sparse
gradient of pushed rows (:func:`row_gradient`). Plain torch and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

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


__all__ = ["initial_rows", "part_of", "row_gradient"]

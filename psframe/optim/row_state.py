"""The per-row optimizer state of embedding tables: which state is per row, and where a new row's starts.

A table optimizer keeps state of two kinds beside a table: per row, a tensor
whose first dimension runs over the table's rows, and whole (a step count).
Per-row state is cut, gathered and moved with the rows it belongs to (a
checkpoint's slices and deltas, a re-layout's parts, a dynamic table's new and
evicted rows); whole state goes as it is. Per-row state is either element-wise
(shaped like the table: Adagrad's ``sum``, FTRL's ``accum`` and ``linear``) or
one value per row (shaped ``(rows,)``: row-wise Adagrad's ``sum``):
:func:`is_row_state` tells it from whole state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard

import torch

from psframe.optim.kernels import OWN_OPTIMIZERS


def is_row_state(value: Any, shape: Sequence[int]) -> TypeGuard[torch.Tensor]:
    """Whether optimizer state ``value`` of a variable of ``shape`` is per row: a tensor shaped
    like the variable, or holding one value per row (shaped ``(shape[0],)``)."""
    if not isinstance(value, torch.Tensor):
        return False
    held = tuple(value.shape)
    return held == tuple(shape) or (len(shape) > 1 and held == tuple(shape[:1]))


def fresh_row_state(name: str, kwargs: dict) -> dict[str, float]:
    """The value a new row's per-row state starts at, per state key, for
    table optimizer ``name`` (a key not listed starts at 0): what the
    optimizer itself gives every row of a new table. A dynamic table gives
    it to each row it creates (:mod:`psframe.tables.dynamic_rows`).
    """
    if name == "Adagrad":
        return {"sum": float(kwargs.get("initial_accumulator_value", 0.0))}
    fresh = getattr(OWN_OPTIMIZERS.get(name), "fresh_row_state", None)
    return fresh(kwargs) if fresh is not None else {}

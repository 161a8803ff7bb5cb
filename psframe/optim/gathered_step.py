"""A table optimizer's step taken on float32 copies of the rows it touches, not on the table.

A table stored in another form than the one the optimizer works in (compact
rows, :mod:`psframe.tables.compact`) cannot be stepped in place: the update
must be worked out in float32 and stored back by the table's own rounding.
:func:`step_gathered` gathers the touched rows and their per-row optimizer
state into a float32 working table of those rows only, takes the optimizer's
own step on it (any table optimizer: torch's ``Adagrad``, ``SparseAdam``,
``SGD``, psframe's ``SparseSGD``, ``Ftrl``, ``RowWiseAdagrad``), scatters
the state back, and returns the updated rows for the caller to store.

The working table's step is the optimizer's ordinary sparse step over rows
``0..k-1``: the same arithmetic per row as on the whole table, so in float32
the rows come back with the bits an in-place step gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from psframe.optim import kernels
from psframe.optim.row_state import is_row_state

FullState = Callable[[tuple[int, ...], float, torch.dtype], torch.Tensor]
"""Makes a full per-row state tensor (shape, fill value, dtype): where a table's state lives."""


def step_gathered(
    optimizer: torch.optim.Optimizer,
    table: torch.Tensor,
    rows: torch.Tensor,
    gradient_rows: torch.Tensor,
    fresh: Mapping[str, float],
    full: FullState,
) -> torch.Tensor:
    """One step of ``optimizer`` (built over ``table``, its only parameter in its group) on the
    rows ``rows`` of ``table`` (int64, distinct) with ``gradient_rows`` (one per row), in float32.

    The table's per-row state (``optimizer.state[table]``) is read and written at ``rows``
    only; state the step makes for the first time is made for the whole table by ``full``,
    filled with ``fresh``'s value for its key (0 where none). The table itself is not changed.

    Returns:
        The updated rows, float32, one per id of ``rows``.
    """
    group = next(g for g in optimizer.param_groups if any(p is table for p in g["params"]))
    state = optimizer.state[table]
    shape = tuple(table.shape)
    work = table.detach().index_select(0, rows).float().requires_grad_(True)
    work_state = {
        key: (value.index_select(0, rows) if is_row_state(value, shape) else value) for key, value in state.items()
    }
    count = rows.numel()
    work.grad = torch.sparse_coo_tensor(
        torch.arange(count).unsqueeze(0),
        gradient_rows.float(),
        tuple(work.shape),
        check_invariants=False,
        is_coalesced=True,
    )
    params = group["params"]
    group["params"] = [work]
    optimizer.state[work] = work_state
    try:
        kernels.step(optimizer, rows=True)
    finally:
        group["params"] = params
        stepped = optimizer.state.pop(work, work_state)
    work_shape = tuple(work.shape)
    for key, value in stepped.items():
        if is_row_state(value, work_shape):
            held = state.get(key)
            if not is_row_state(held, shape):
                held = state[key] = full((shape[0], *value.shape[1:]), fresh.get(key, 0.0), value.dtype)
            held.index_copy_(0, rows, value.to(held.dtype))
        else:
            state[key] = value
    return work.detach()


def widen_row_state(optimizer: torch.optim.Optimizer, table: torch.Tensor, full: FullState) -> None:
    """Make the per-row state ``optimizer`` made for ``table`` float32 where the table is not (an
    optimizer builds its state in the table's dtype; a compact table keeps float32 state)."""
    state = optimizer.state.get(table, {})
    for key, value in list(state.items()):
        if is_row_state(value, tuple(table.shape)) and value.dtype != torch.float32:
            state[key] = full(tuple(value.shape), 0.0, torch.float32).copy_(value)


__all__ = ["FullState", "step_gathered", "widen_row_state"]

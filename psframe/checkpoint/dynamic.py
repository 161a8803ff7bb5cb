"""Dynamic tables in checkpoints: the rows each part held, gathered and shared out again.

A dynamic table's part is saved as the ids it held, their rows, their
optimizer state and ages (:mod:`psframe.checkpoint.shard`). Restoring onto
as many ps tasks gives each part back its own; onto another number, every
id goes to the part that holds it now
(:func:`psframe.tables.dynamic_rows.part_of`), with its row, state and ages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psframe.checkpoint.shard import ShardData, VariableData
from psframe.errors import CheckpointError
from psframe.optim.row_state import is_row_state
from psframe.tables.row_math import part_of


def dynamic_parts_of(shards: Sequence[ShardData]) -> dict[str, list[VariableData]]:
    """The saved parts of every dynamic table, by table name."""
    parts: dict[str, list[VariableData]] = {}
    for shard in shards:
        for var in shard.variables:
            if var.dynamic is not None:
                parts.setdefault(var.variable, []).append(var)
    return parts


def gather(parts: Sequence[VariableData], part_index: int = 0, num_parts: int = 1) -> dict[str, Any]:
    """The rows of one table that part ``part_index`` of ``num_parts`` holds, from
    its saved parts, as :meth:`psframe.tables.dynamic_rows.DynamicRows.export` gives them
    (ids sorted). Per-row state keys saved by every part are kept; other state
    (a step count) is the largest saved, and so is the clock.

    The counts of ids admitted, filtered and evicted stay each part's where the
    parts are cut alike (as many); otherwise they add up, in part 0 (the table's
    totals stay right whatever the parts); admission counters take
    their largest value over the parts (an id's count is never underestimated)."""
    tables = [_table_of(p) for p in parts]
    ids = torch.cat([t["ids"] for t in tables])
    keep = part_of(ids, num_parts) == part_index
    order = torch.argsort(ids[keep])

    def rows_of(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors)[keep][order]

    state: dict[str, Any] = {}
    for key in parts[0].state:
        values: list[Any] = [p.state.get(key) for p in parts]
        if all(is_row_state(v, p.value.shape) and v.dim() for v, p in zip(values, parts)):
            state[key] = rows_of(values)
        elif all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
            state[key] = max(values, key=float).clone()
        elif all(isinstance(v, (int, float)) for v in values):
            state[key] = max(values)
    gathered = {
        "ids": ids[keep][order],
        "rows": rows_of([p.value for p in parts]),
        "state": state,
        "updated": rows_of([t["updated"] for t in tables]),
        "updates": rows_of([t["updates"] for t in tables]),
        "clock": max(int(t["clock"]) for t in tables),
    }
    if all(t.get("seen") is not None for t in tables):  # absent where a part was saved before rows were timed
        gathered["seen"] = rows_of([t["seen"] for t in tables])
    counts = [t.get("counts") or {} for t in tables]
    keys = sorted({k for c in counts for k in c})
    if all(p.num_parts == num_parts for p in parts):  # cut alike: each part keeps its own counts
        counts = [c for c, p in zip(counts, parts) if p.part_index == part_index]
        gathered["counts"] = {k: sum(int(c.get(k, 0)) for c in counts) for k in keys}
    else:  # cut otherwise: the totals, in part 0
        gathered["counts"] = {k: sum(int(c.get(k, 0)) for c in counts) if part_index == 0 else 0 for k in keys}
    gathered["admission"] = _admission_of([t.get("admission") or {} for t in tables], part_index)
    return gathered


def _admission_of(saved: Sequence[Mapping[str, Any]], part_index: int) -> dict[str, Any]:
    """One part's admission state from the saved parts' (see :func:`gather`)."""
    state: dict[str, Any] = {}
    counts = [s["counts"] for s in saved if isinstance(s.get("counts"), torch.Tensor)]
    if counts and all(c.shape == counts[0].shape for c in counts):
        state["counts"] = torch.stack(counts).amax(0)
    randoms = [s["random"] for s in saved if isinstance(s.get("random"), torch.Tensor)]
    if randoms:
        state["random"] = randoms[min(part_index, len(randoms) - 1)].clone()
    return state


def _table_of(part: VariableData) -> Mapping[str, Any]:
    """A dynamic table's saved part: its ids, update times and counts, clock."""
    if part.dynamic is None:
        raise CheckpointError(f"{part.name!r} is saved as a plain variable, not a part of a dynamic table")
    return part.dynamic

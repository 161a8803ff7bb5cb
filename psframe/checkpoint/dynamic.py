"""Dynamic tables in checkpoints: the rows each part held, gathered and shared out again.

A dynamic table's part is saved as the ids it held, their rows, their
optimizer state and ages (:mod:`psframe.checkpoint.shard`). Restoring onto
as many ps tasks gives each part back its own; onto another number, every
id goes to the part that holds it now
(:func:`psframe.dynamic_rows.part_of`), with its row, state and ages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from psframe.checkpoint.shard import ShardData, VariableData
from psframe.dynamic_rows import part_of


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
    its saved parts, as :meth:`psframe.dynamic_rows.DynamicRows.export` gives them
    (ids sorted). Per-row state keys saved by every part are kept; other state
    (a step count) is the largest saved, and so is the clock."""
    ids = torch.cat([p.dynamic["ids"] for p in parts])
    keep = part_of(ids, num_parts) == part_index
    order = torch.argsort(ids[keep])

    def rows_of(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(tensors)[keep][order]

    state: dict[str, Any] = {}
    for key in parts[0].state:
        values = [p.state.get(key) for p in parts]
        if all(
            isinstance(v, torch.Tensor)
            and v.dim()
            and v.shape[0] == p.value.shape[0]
            and v.shape[1:] == p.value.shape[1:]
            for v, p in zip(values, parts)
        ):
            state[key] = rows_of(values)
        elif all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
            state[key] = max(values, key=float).clone()
        elif all(isinstance(v, (int, float)) for v in values):
            state[key] = max(values)
    return {
        "ids": ids[keep][order],
        "rows": rows_of([p.value for p in parts]),
        "state": state,
        "updated": rows_of([p.dynamic["updated"] for p in parts]),
        "updates": rows_of([p.dynamic["updates"] for p in parts]),
        "clock": max(int(p.dynamic["clock"]) for p in parts),
    }

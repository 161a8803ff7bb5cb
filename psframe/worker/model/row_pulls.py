"""Pulling an embedding table's rows from the ps parts that hold them.

A lookup's distinct ids are cut by part (``(slot, positions among the ids,
ids as the part knows them)`` per part, from the table's ``split``);
:func:`plan_parts` says what to ask each ps task for them and where each
part's rows go, :func:`assemble_parts` puts the answers back in the ids'
order, and :func:`pull_parts` does both around one :data:`Pull`.

:mod:`psframe.worker.model.prefetch` plans and assembles the same way, with
its requests sent behind a step's messages instead of by a :data:`Pull`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from psframe.tables.rows import RowPull
from psframe.worker.plan.step_plan import Slot

# pull(wanted, create) -> rows: per ps task, (part, ids) pairs in, their rows out
# (PsClient.pull_rows); `create`: dynamic tables make the rows of ids they lack.
Pull = Callable[[Mapping[int, Sequence[RowPull]], bool], Mapping[int, Sequence[torch.Tensor]]]

Placed = list[tuple[int, torch.Tensor]]  # per part asked: its ps task, and where its rows go among the ids


def pull_parts(
    pull: Pull,
    parts: Sequence[tuple[Slot, torch.Tensor, torch.Tensor]],
    count: int,
    like: torch.Tensor,
    *,
    create: bool,
) -> torch.Tensor:
    """The rows of ``count`` ids, pulled from the parts that hold them, in the ids' order.

    Args:
        parts: ``(slot, positions among the ids, ids as the part knows them)`` per part.
        like: a tensor of the table's row shape (beyond dim 0) and dtype.
        create: dynamic tables make the rows of ids they lack.
    """
    wanted, placed = plan_parts(parts)
    pulled = pull(wanted, create) if placed else {}
    return assemble_parts(pulled, placed, count, like)


def plan_parts(parts: Sequence[tuple[Slot, torch.Tensor, torch.Tensor]]) -> tuple[dict[int, list[RowPull]], Placed]:
    """What to ask each ps task for the rows of ``parts`` (see :func:`pull_parts`), and where their rows go."""
    wanted: dict[int, list[RowPull]] = {}
    placed = []
    for slot, positions, part_ids in parts:
        if part_ids.numel():
            wanted.setdefault(slot.shard.ps_task, []).append((slot.name, part_ids))
            placed.append((slot.shard.ps_task, positions))
    return wanted, placed


def assemble_parts(
    pulled: Mapping[int, Sequence[torch.Tensor]], placed: Placed, count: int, like: torch.Tensor
) -> torch.Tensor:
    """The rows of ``count`` ids from what each ps task answered to :func:`plan_parts`'s requests."""
    if not placed:
        return torch.empty((count, *like.shape[1:]), dtype=like.dtype)
    if len(placed) == 1:  # one part holds every id (in order): its rows as they arrived, not copied
        return pulled[placed[0][0]][0]
    remaining = {ps_task: list(values) for ps_task, values in pulled.items()}
    rows = torch.empty((count, *like.shape[1:]), dtype=like.dtype)
    for ps_task, positions in placed:
        rows[positions] = remaining[ps_task].pop(0)
    return rows

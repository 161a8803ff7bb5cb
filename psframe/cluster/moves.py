"""A live re-layout in stages: the parts that move, a few at a time.

Going from the placement of a model on P ps tasks to its placement on Q tasks
(:func:`psframe.cluster.placement.place`, with the same options) moves some of
its parts. :func:`stages` orders those moves and groups them into stages of at
most ``max_stage_bytes`` each (at least one move per stage), and gives the
placement the model has after each stage: training pauses once per stage, for
the transfer of that stage's parts alone, and goes on between two stages.

What one move is:

- a part whose rows stay the same (its variable is cut alike on P and Q tasks:
  a variable below the partitioning threshold, or one cut into parts of
  ``max_shard_bytes`` either way) and whose ps task changes moves alone;
- a variable cut otherwise on Q tasks than on P (an embedding table, one part
  per task; a variable partitioned into one part per task) moves whole, all its
  parts in one stage.

A fixed embedding table's part that moves alone (``Placement(table_parts=N)``)
is copied ahead of its stage's cut while training goes on, and only its rows
written since cross at the cut (:mod:`psframe.ps.elastic.precopy`): such parts count
against a budget of their own, :data:`COPY_AHEAD_FACTOR` times
``max_stage_bytes``, so a stage takes several.

The stages are a function of the two placements: every worker computes the
same ones, and only the stage number travels (:class:`MoveStage`). Placement
works on sizes only and never imports torch::

    for placement in stages(place(infos, 2), place(infos, 3), max_stage_bytes=4 * MiB):
        print(placement.describe())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psframe.cluster.placement import Shard, ShardPlacement
from psframe.errors import PlacementError


@dataclass(frozen=True)
class MoveStage:
    """Where a staged re-layout stands: stage ``stage`` of ``stages`` (1-based) of the move from
    ``origin`` to ``target`` (cluster specs as :meth:`ClusterSpec.to_string` writes them)."""

    origin: str
    target: str
    stage: int
    stages: int

    @property
    def done(self) -> bool:
        """Whether this is the move's last stage: the layout is then the target's own placement."""
        return self.stage >= self.stages


def _by_variable(placement: ShardPlacement) -> dict[str, list[Shard]]:
    parts: dict[str, list[Shard]] = {}
    for shard in placement.shards:
        parts.setdefault(shard.variable, []).append(shard)
    return parts


def _cut(parts: Sequence[Shard]) -> list[tuple]:
    """How a variable is cut: its parts' names and rows, whoever holds them."""
    return [(s.name, s.row_start, s.row_end, s.row_stride, s.shape, s.table, s.dynamic) for s in parts]


# A stage copies ahead at most this many times ``max_stage_bytes`` of fixed table parts (while
# training goes on, each part under its holder's lock on its own): what crosses at its cut is
# their rows written meanwhile, which grows with how long the copies take.
COPY_AHEAD_FACTOR = 8


def copied_ahead(shard: Shard) -> bool:
    """Whether a part that moves alone is copied ahead of its stage's cut (a fixed table's part:
    :mod:`psframe.ps.elastic.precopy`), so that only its rows written since cross at the cut."""
    return shard.table and shard.dynamic is None


def stages(before: ShardPlacement, after: ShardPlacement, max_stage_bytes: int) -> list[ShardPlacement]:
    """The placements a staged re-layout from ``before`` to ``after`` goes through, one per stage.

    Moves are taken in the order of ``after``'s shards, those that bring a part to ps task 0
    first; a stage holds the moves that fit in ``max_stage_bytes`` together (one at least),
    counting a part copied ahead of the cut (:func:`copied_ahead`) against a budget of its own,
    :data:`COPY_AHEAD_FACTOR` times larger: its bytes cross before the cut, while training goes on.
    The last placement is ``after`` itself; the ones before it are on ``max(before.num_ps,
    after.num_ps)`` tasks: a task drained still holds the parts not yet moved. Nothing to
    move: one stage, ``after``.

    Raises:
        PlacementError: the two placements are not of the same variables, or ``max_stage_bytes`` < 1.
    """
    if max_stage_bytes < 1:
        raise PlacementError(f"max_stage_bytes must be >= 1, got {max_stage_bytes}")
    old, new = _by_variable(before), _by_variable(after)
    if set(old) != set(new):
        raise PlacementError(
            f"a re-layout keeps the model's variables: {sorted(set(old) ^ set(new))[:4]} are placed on one side only"
        )
    # One move: (variable, the part that moves, or None for the whole variable, bytes at the cut,
    # bytes copied ahead, whether it brings a part to ps task 0).
    moves: list[tuple[str, str | None, int, int, bool]] = []
    for variable, parts in new.items():
        if _cut(old[variable]) != _cut(parts):
            moves.append((variable, None, sum(s.nbytes for s in parts), 0, any(s.ps_task == 0 for s in parts)))
            continue
        moves.extend(
            (variable, a.name, 0, a.nbytes, a.ps_task == 0)
            if copied_ahead(a)
            else (variable, a.name, a.nbytes, 0, a.ps_task == 0)
            for b, a in zip(old[variable], parts)
            if a.ps_task != b.ps_task
        )
    # The parts ps 0 gains come first: it never holds nothing in between (a step counts the
    # global step there, and reports its data progress there).
    moves.sort(key=lambda move: not move[4])
    groups: list[list[tuple[str, str | None, int, int, bool]]] = []
    at_cut = ahead = 0
    for move in moves:
        if not groups or at_cut + move[2] > max_stage_bytes or ahead + move[3] > COPY_AHEAD_FACTOR * max_stage_bytes:
            groups.append([])
            at_cut = ahead = 0
        groups[-1].append(move)
        at_cut, ahead = at_cut + move[2], ahead + move[3]
    num_ps = max(before.num_ps, after.num_ps)
    placements: list[ShardPlacement] = []
    whole: set[str] = set()
    moved: set[str] = set()
    for group in groups[:-1]:
        for variable, part, *_ in group:
            (whole.add(variable) if part is None else moved.add(part))
        shards: list[Shard] = []
        for variable, parts in new.items():
            if variable in whole:
                shards.extend(parts)
            elif _cut(old[variable]) != _cut(parts):
                shards.extend(old[variable])
            else:
                shards.extend(a if a.name in moved else b for b, a in zip(old[variable], parts))
        placements.append(ShardPlacement(num_ps, tuple(shards)))
    placements.append(after)
    return placements


def parts_copied_ahead(before: ShardPlacement, after: ShardPlacement) -> list[str]:
    """The parts of ``after`` a stage from ``before`` copies ahead of its cut: fixed table parts
    that move alone (their variable cut alike) to another ps task."""
    old = _by_variable(before)
    names = []
    for variable, parts in _by_variable(after).items():
        if variable in old and _cut(old[variable]) == _cut(parts):
            names += [a.name for b, a in zip(old[variable], parts) if a.ps_task != b.ps_task and copied_ahead(a)]
    return names


def moved_parts(before: ShardPlacement, after: ShardPlacement) -> int:
    """How many parts of ``after`` a stage from ``before`` moves: those that ``before`` has on
    another ps task, or not at all (their variable cut otherwise)."""
    held = {(*_cut([s])[0], s.ps_task) for s in before.shards}
    return sum((*_cut([s])[0], s.ps_task) not in held for s in after.shards)


def sources(before: ShardPlacement, after: ShardPlacement) -> list[list[int]]:
    """For each ps task of ``after``, the tasks of ``before`` a stage's move reads its parts from:
    those that hold rows of them, and itself where it was a task before (it reads its own parts in
    place). A task asks no other."""
    held = _by_variable(before)
    result: list[list[int]] = []
    for k in range(after.num_ps):
        tasks = {k} if k < before.num_ps else set()
        for wanted in (s for s in after.shards if s.ps_task == k):
            tasks.update(b.ps_task for b in held.get(wanted.variable, ()) if _shares_rows(b, wanted))
        result.append(sorted(tasks))
    return result


def _shares_rows(a: Shard, b: Shard) -> bool:
    """Whether two parts of a variable may hold a row in common (a part cut otherwise may)."""
    if a.dynamic is not None or b.dynamic is not None:  # a dynamic table's part: by its index among as many
        return a.num_parts != b.num_parts or a.part_index == b.part_index
    if a.row_stride > 1 or b.row_stride > 1:  # every n-th row: the part of the same first row
        return a.row_stride != b.row_stride or a.row_start == b.row_start
    return a.row_start < b.row_end and b.row_start < a.row_end


__all__ = ["COPY_AHEAD_FACTOR", "MoveStage", "copied_ahead", "moved_parts", "parts_copied_ahead", "sources", "stages"]

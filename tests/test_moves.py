"""The stages of a live re-layout (psframe.cluster.moves): which parts move, and in what groups."""

from __future__ import annotations

import pytest

from psframe.cluster.moves import MoveStage, stages
from psframe.cluster.placement import Shard, ShardPlacement, VariableInfo, place
from psframe.cluster.table_placement import place_tables
from psframe.errors import PlacementError

# w: 3 parts of 512 bytes on any number of ps tasks (cut by size); b: 32 bytes, whole.
MODEL = [VariableInfo("w", (48, 8), 4), VariableInfo("b", (8,), 4)]


def placed(num_ps: int, **options) -> ShardPlacement:
    return place(MODEL, num_ps, min_partition_bytes=None, max_shard_bytes=512, **options)


def owners(placement: ShardPlacement) -> dict[str, int]:
    return {s.name: s.ps_task for s in placement.shards}


def test_a_part_cut_alike_on_both_sides_moves_alone_and_only_if_its_task_changes():
    before, after = placed(2), placed(3)
    assert owners(before) == {"w/part_0": 0, "w/part_1": 1, "w/part_2": 0, "b": 1}
    assert owners(after) == {"w/part_0": 0, "w/part_1": 1, "w/part_2": 2, "b": 0}
    plan = stages(before, after, max_stage_bytes=512)
    # b comes to ps 0 first (32 bytes); w/part_2 (512 bytes) does not fit beside it: the next stage.
    # w/part_0 and w/part_1 never move.
    assert [owners(p) for p in plan] == [
        {"w/part_0": 0, "w/part_1": 1, "w/part_2": 0, "b": 0},
        owners(after),
    ]
    assert plan[-1] is after and all(p.num_ps == 3 for p in plan)
    assert len(stages(before, after, max_stage_bytes=544)) == 1  # both fit in one stage


def test_while_draining_the_task_drained_keeps_the_parts_not_yet_moved():
    before, after = placed(3), placed(2)
    assert owners(before) == {"w/part_0": 0, "w/part_1": 1, "w/part_2": 2, "b": 0}
    plan = stages(before, after, max_stage_bytes=1)  # one move a stage, whatever its size
    assert len(plan) == 2
    # w/part_2 comes to ps 0 first; b, which leaves ps 0, not yet moved.
    assert plan[0].num_ps == 3 and owners(plan[0]) == {"w/part_0": 0, "w/part_1": 1, "w/part_2": 0, "b": 0}
    assert plan[1] is after and plan[1].num_ps == 2


def test_ps_0_gains_its_parts_before_it_gives_any_so_it_is_never_empty():
    before = ShardPlacement(2, (Shard("x", "x", 0, 0, 1, (1,), 4), Shard("y", "y", 1, 0, 1, (1,), 4)))
    after = ShardPlacement(2, (Shard("x", "x", 1, 0, 1, (1,), 4), Shard("y", "y", 0, 0, 1, (1,), 4)))
    first, last = stages(before, after, max_stage_bytes=1)
    assert owners(first) == {"x": 0, "y": 0} and last is after


def test_a_variable_cut_otherwise_moves_whole_in_one_stage():
    # A table is cut into one part per ps task: 2 parts before, 3 after; it moves in one stage.
    table = [VariableInfo("emb", (30, 4), 4)]
    before = ShardPlacement(2, tuple(placed(2).shards) + tuple(place_tables(table, 2)))
    after = ShardPlacement(3, tuple(placed(3).shards) + tuple(place_tables(table, 3)))
    # Moves: those bringing a part to ps 0 first, b (32 bytes) and emb whole (480), then w/part_2 (512).
    plan = stages(before, after, max_stage_bytes=512)
    emb = [[s for s in p.shards if s.variable == "emb"] for p in plan]
    assert [len(parts) for parts in emb] == [3, 3]  # b and emb fit in the first stage together
    plan = stages(before, after, max_stage_bytes=1)
    emb = [[s for s in p.shards if s.variable == "emb"] for p in plan]
    assert [len(parts) for parts in emb] == [2, 3, 3]  # one move a stage: emb's is the second
    for parts in emb:  # never a mix of two cuts
        assert len({s.num_parts for s in parts}) == 1
        assert sorted(s.ps_task for s in parts) == list(range(len(parts)))


def test_nothing_to_move_is_one_stage_the_placement_after():
    lone = [VariableInfo("b", (8,), 4)]
    before, after = place(lone, 1), place(lone, 2)  # b stays on task 0
    assert stages(before, after, max_stage_bytes=512) == [after]


def test_placements_of_other_variables_or_a_stage_of_no_bytes_are_refused():
    other = ShardPlacement(2, (Shard("v", "v", 0, 0, 1, (1,), 4),))
    with pytest.raises(PlacementError, match="keeps the model's variables"):
        stages(placed(2), other, max_stage_bytes=512)
    with pytest.raises(PlacementError, match="max_stage_bytes must be >= 1"):
        stages(placed(2), placed(3), max_stage_bytes=0)


def test_a_stage_says_whether_it_ends_the_move():
    assert not MoveStage("a", "b", 1, 2).done
    assert MoveStage("a", "b", 2, 2).done


def test_a_table_cut_into_a_fixed_number_of_parts_moves_part_by_part():
    table = [VariableInfo("emb", (60, 4), 4)]
    before = ShardPlacement(2, tuple(place_tables(table, 2, num_parts=6)))
    after = ShardPlacement(3, tuple(place_tables(table, 3, num_parts=6)))
    assert [s.ps_task for s in before.shards] == [0, 1, 0, 1, 0, 1]  # part k on task k % P
    assert [s.ps_task for s in after.shards] == [0, 1, 2, 0, 1, 2]
    plan = stages(before, after, max_stage_bytes=1)
    assert len(plan) == 4  # parts 2..5 change task, one a stage; parts 0 and 1 stay
    assert owners(plan[0])["emb/part_3"] == 0  # the part coming to ps 0 first
    assert all({s.num_parts for s in p.shards} == {6} for p in plan)  # never cut anew


def test_a_number_of_table_parts_below_one_is_refused():
    import psframe

    with pytest.raises(ValueError, match="table_parts"):
        psframe.Placement(table_parts=0)

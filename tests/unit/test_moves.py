"""The stages of a live re-layout (psframe.cluster.moves): which parts move, and in what groups."""

from __future__ import annotations

import pytest

from psframe.cluster.moves import COPY_AHEAD_FACTOR, MoveStage, moved_parts, parts_copied_ahead, sources, stages
from psframe.cluster.placement import Shard, ShardPlacement, VariableInfo, place
from psframe.errors import PlacementError
from psframe.tables.spec import part_owners, place_tables

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
    assert [s.ps_task for s in before.shards] == [0, 0, 0, 1, 1, 1]
    assert [s.ps_task for s in after.shards] == [0, 0, 2, 1, 1, 2]  # the new task takes its share only
    plan = stages(before, after, max_stage_bytes=1)
    assert len(plan) == 2  # parts 2 and 5 change task, one a stage; the others stay
    assert [moved_parts(a, b) for a, b in zip([before, *plan], plan)] == [1, 1]
    assert all({s.num_parts for s in p.shards} == {6} for p in plan)  # never cut anew
    assert stages(after, before, max_stage_bytes=1)[-1] == before  # drained: the same two come back


@pytest.mark.parametrize("num_parts", [1, 2, 5, 12, 48])
def test_table_parts_are_dealt_evenly_and_a_task_added_takes_only_its_share(num_parts):
    for num_ps in range(1, 9):
        owners_before, owners_after = part_owners(num_parts, num_ps), part_owners(num_parts, num_ps + 1)
        counts = [owners_after.count(t) for t in range(num_ps + 1)]
        assert max(counts) - min(counts) <= 1 and sum(counts) == num_parts
        moved = [k for k in range(num_parts) if owners_before[k] != owners_after[k]]
        assert all(owners_after[k] == num_ps for k in moved)  # only to the task added
        assert len(moved) == num_parts // (num_ps + 1)  # its share, no more


def test_each_task_reads_from_the_tasks_that_hold_rows_of_its_parts():
    # w: 3 parts by size on either side, cut alike; b whole on ps 0. A task added reads from
    # the tasks its parts come from, no other; a task kept reads from itself too.
    before, after = placed(2), placed(3)
    moved = {s.name: (b.ps_task, s.ps_task) for b, s in zip(before.shards, after.shards) if b.ps_task != s.ps_task}
    got = sources(before, after)
    for task, tasks in enumerate(got):
        gained = {frm for frm, to in moved.values() if to == task}
        assert set(tasks) == gained | ({task} if task < 2 else set()) and tasks == sorted(tasks)
    table = [VariableInfo("emb", (30, 4), 4)]  # cut anew: 2 parts -> 3, each new part overlaps old ones
    assert sources(ShardPlacement(2, tuple(place_tables(table, 2))), ShardPlacement(3, tuple(place_tables(table, 3))))[
        2
    ] == [0, 1]  # strided rows, cut otherwise: any part may hold some


def test_dense_parts_are_fixed_whatever_the_ps_tasks_and_a_re_layout_moves_them_whole():
    # A 48-row weight partitioned for balance: one part per task by default (cut anew when the
    # tasks change), six parts with dense_parts whatever the tasks, dealt so that a task added
    # takes only its share; the small bias goes where the load is least.
    infos = [VariableInfo("w", (48, 4), 4), VariableInfo("b", (4,), 4)]

    def dense(num_ps, **options):
        return place(infos, num_ps, min_partition_bytes=64, **options)

    assert [s.num_parts for s in dense(2).shards if s.variable == "w"] == [2, 2]
    assert [s.num_parts for s in dense(3).shards if s.variable == "w"] == [3, 3, 3]
    before, after = dense(2, dense_parts=6), dense(3, dense_parts=6)
    cut = [(s.name, s.row_start, s.row_end) for s in before.shards if s.variable == "w"]
    assert cut == [(s.name, s.row_start, s.row_end) for s in after.shards if s.variable == "w"]
    assert [s.ps_task for s in after.shards if s.variable == "w"] == list(part_owners(6, 3)) == [0, 0, 2, 1, 1, 2]
    assert after.bytes_per_ps() == [2 * 128 + 16, 2 * 128, 2 * 128]  # the parts' loads count: b on the least
    plan = stages(before, after, max_stage_bytes=8 * 4 * 4)  # one part (8 rows of 4 floats) a stage
    assert len(plan) == 2 and [moved_parts(a, b) for a, b in zip([before, *plan], plan)] == [1, 1]
    assert all({s.num_parts for s in p.shards if s.variable == "w"} == {6} for p in plan)  # never cut anew
    assert stages(after, before, max_stage_bytes=8 * 4 * 4)[-1] == before  # drained: the same two come back
    with pytest.raises(PlacementError, match="dense_parts"):
        dense(2, dense_parts=0)


def test_a_number_of_table_parts_below_one_is_refused():
    import psframe

    with pytest.raises(ValueError, match="table_parts"):
        psframe.Placement(table_parts=0)
    with pytest.raises(ValueError, match="dense_parts"):
        psframe.Placement(dense_parts=0)


def test_table_parts_copied_ahead_count_against_a_budget_of_their_own():
    table = [VariableInfo("emb", (60, 4), 4)]  # six parts of 160 bytes
    before = ShardPlacement(2, tuple(placed(2).shards) + tuple(place_tables(table, 2, num_parts=6)))
    after = ShardPlacement(3, tuple(placed(3).shards) + tuple(place_tables(table, 3, num_parts=6)))
    moving = [a.name for b, a in zip(before.shards, after.shards) if a.variable == "emb" and a.ps_task != b.ps_task]
    assert parts_copied_ahead(before, after) == moving and len(moving) == 2  # not w/part_2 nor b: dense
    # b to ps 0 first (32 bytes at the cut), then w/part_2 (512 at the cut: a stage of its own), then
    # both table parts together: 320 bytes copied ahead, against COPY_AHEAD_FACTOR x 160.
    plan = stages(before, after, max_stage_bytes=160)
    assert [moved_parts(a, b) for a, b in zip([before, *plan], plan)] == [1, 1, 2]
    assert COPY_AHEAD_FACTOR * 160 >= 320
    # Against a budget of COPY_AHEAD_FACTOR x 20 bytes, one table part a stage.
    plan = stages(before, after, max_stage_bytes=20)
    assert [moved_parts(a, b) for a, b in zip([before, *plan], plan)] == [1, 1, 1, 1]
    # A table cut anew moves whole, at its cut: nothing of it is copied ahead.
    anew = ShardPlacement(3, tuple(placed(3).shards) + tuple(place_tables(table, 3)))
    assert parts_copied_ahead(ShardPlacement(2, tuple(placed(2).shards) + tuple(place_tables(table, 2))), anew) == []

"""psframe.worker.plan.step_plan: which message of a step carries which shard (pure, no network)."""

from __future__ import annotations

import torch

from psframe.cluster.placement import Shard, VariableInfo, place
from psframe.worker.plan.step_plan import Slot, StepPlan, batches


def slots_of(sizes: list[tuple[str, int, int]]) -> list[Slot]:
    """Whole float32 variables ``(name, numel, ps_task)``."""
    return [Slot(Shard(name, name, ps, 0, numel, (numel,), 4 * numel), torch.zeros(numel)) for name, numel, ps in sizes]


def names(group) -> list[str]:
    return [s.name for s in group]


def test_batches_fill_messages_in_order_per_ps_task():
    slots = slots_of([("a", 10, 0), ("b", 10, 1), ("c", 10, 0), ("d", 30, 0), ("e", 1, 1)])
    grouped = batches(slots, num_ps=2, max_bytes=80)
    assert [(ps, names(batch)) for ps, batch in grouped] == [(0, ["a", "c"]), (0, ["d"]), (1, ["b", "e"])]


def test_a_slot_larger_than_a_message_gets_a_message_of_its_own():
    grouped = batches(slots_of([("big", 100, 0), ("small", 1, 0)]), num_ps=1, max_bytes=40)
    assert [names(batch) for _, batch in grouped] == [["big"], ["small"]]


def test_a_ps_task_that_holds_nothing_gets_no_message():
    assert [ps for ps, _ in batches(slots_of([("a", 1, 1)]), num_ps=3, max_bytes=64)] == [1]


def test_async_plan_pushes_and_pulls_each_batch_and_ends_each_ps_tasks_step_once():
    slots = slots_of([("a", 10, 0), ("b", 10, 0), ("c", 10, 1)])
    plan = StepPlan.make(slots, num_ps=2, max_bytes=40, sync=False)
    assert [(r.ps_task, names(r.push), names(r.pull), r.end_of_step) for r in plan.step] == [
        (0, ["a"], ["a"], False),
        (0, ["b"], ["b"], True),
        (1, ["c"], ["c"], True),
    ]
    assert [(r.ps_task, names(r.push), names(r.pull)) for r in plan.pull] == [
        (0, [], ["a"]),
        (0, [], ["b"]),
        (1, [], ["c"]),
    ]


def test_sync_plan_with_several_messages_pushes_first_then_waits_then_pulls_the_rest():
    slots = slots_of([("a", 10, 0), ("b", 10, 0), ("c", 10, 0), ("d", 10, 1)])
    plan = StepPlan.make(slots, num_ps=2, max_bytes=40, sync=True)
    assert [(r.ps_task, names(r.push), names(r.pull), r.end_of_step) for r in plan.step] == [
        (0, ["a"], [], False),
        (0, ["b"], [], False),
        (0, ["c"], ["c"], True),
        (0, [], ["a"], False),
        (0, [], ["b"], False),
        (1, ["d"], ["d"], True),
    ]


def test_every_shard_of_a_partitioned_variable_is_pushed_and_pulled_exactly_once():
    param = torch.nn.Parameter(torch.arange(40.0).reshape(10, 4))
    placement = place([VariableInfo("emb", (10, 4), 4)], 3, min_partition_bytes=16, max_shard_bytes=48)
    slots = [Slot(shard, param) for shard in placement.shards]
    for sync in (False, True):
        plan = StepPlan.make(slots, num_ps=3, max_bytes=48, sync=sync)
        pushed = sorted(s.name for r in plan.step for s in r.push)
        pulled = sorted(s.name for r in plan.step for s in r.pull)
        assert pushed == pulled == sorted(s.name for s in slots)
    rows = torch.cat([slot.rows(param.detach()) for slot in slots])
    assert torch.equal(rows, param.detach())  # the slots' rows tile the parameter, in order


def test_requests_are_their_own_identity():
    plan = StepPlan.make(slots_of([("a", 1, 0)]), num_ps=1, max_bytes=64, sync=False)
    same = StepPlan.make(slots_of([("a", 1, 0)]), num_ps=1, max_bytes=64, sync=False)
    assert plan.step[0] != same.step[0] and len({plan.step[0], plan.step[0]}) == 1

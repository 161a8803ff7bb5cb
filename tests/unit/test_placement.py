"""Unit tests for psframe.cluster.placement: exact oracles, no network, no torch."""

from __future__ import annotations

import logging
import math

import pytest

from psframe.cluster.placement import (
    DEFAULT_MAX_SHARD_BYTES,
    HARD_MAX_SHARD_BYTES,
    MiB,
    Shard,
    ShardPlacement,
    VariableInfo,
    place,
)
from psframe.errors import ClusterSpecError, PlacementError


def v(name: str, nbytes: int, device: str | None = None) -> VariableInfo:
    """A 1-d uint8 variable of exactly ``nbytes`` bytes."""
    return VariableInfo(name, (nbytes,), 1, device)


def tasks(p: ShardPlacement) -> dict[str, int]:
    return {s.name: s.ps_task for s in p.shards}


def assert_covers(p: ShardPlacement, var: VariableInfo) -> None:
    """The shards of ``var`` tile its rows exactly once, in order, with right sizes."""
    shards = p.shards_of(var.name)
    assert [s.part_index for s in shards] == list(range(len(shards)))
    assert all(s.num_parts == len(shards) for s in shards)
    assert shards[0].row_start == 0 and shards[-1].row_end == var.rows
    for a, b in zip(shards, shards[1:]):
        assert a.row_end == b.row_start
    for s in shards:
        assert s.shape == (s.row_end - s.row_start, *var.shape[1:])
        assert s.nbytes == (s.row_end - s.row_start) * var.row_bytes
    assert sum(s.nbytes for s in shards) == var.nbytes


# -- VariableInfo --------------------------------------------------------------


def test_variable_info_sizes_and_shape_coercion():
    var = VariableInfo("w", [10, 3, 2], 4)
    assert var.shape == (10, 3, 2)
    assert var.nbytes == 240
    assert var.rows == 10
    assert var.row_bytes == 24
    scalar = VariableInfo("s", (), 8)
    assert (scalar.nbytes, scalar.rows) == (8, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="", shape=(1,), itemsize=4), "non-empty"),
        (dict(name="w", shape=(3, -1), itemsize=4), r"dimensions must be >= 0.*\(3, -1\)"),
        (dict(name="w", shape=(2.5,), itemsize=4), "sequence of ints"),
        (dict(name="w", shape=(1,), itemsize=0), "itemsize must be a positive int, got 0"),
    ],
)
def test_variable_info_rejects_bad_fields(kwargs, match):
    with pytest.raises(PlacementError, match=match):
        VariableInfo(**kwargs)


# -- strategies ----------------------------------------------------------------


def test_greedy_balances_by_bytes_largest_first():
    # a(100)->0; b(60)->1; c(50)->1 (60 < 100); d(40)->0 (100 < 110).
    p = place([v("a", 100), v("b", 60), v("c", 50), v("d", 40)], 2)
    assert tasks(p) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert p.bytes_per_ps() == [140, 110]
    assert [s.name for s in p.shards] == ["a", "b", "c", "d"]  # input order kept
    assert [s.name for s in p.shards_on(0)] == ["a", "d"]


def test_greedy_ties_keep_input_order_and_lowest_task():
    # q(30)->0; then p and r (10 each) in input order: p->1, r->2; s(5): tasks
    # 1 and 2 tie at 10, lowest index wins.
    p = place([v("p", 10), v("q", 30), v("r", 10), v("s", 5)], 3)
    assert tasks(p) == {"p": 1, "q": 0, "r": 2, "s": 1}


def test_round_robin_ignores_sizes():
    p = place([v("a", 100), v("b", 60), v("c", 50), v("d", 40), v("e", 1)], 2, strategy="round_robin")
    assert tasks(p) == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    assert p.bytes_per_ps() == [151, 100]


def test_greedy_spreads_parts_of_a_partitioned_variable():
    big = VariableInfo("emb", (8, 4), 4)  # 128 bytes > 64 -> 4 parts of 32
    p = place([v("bias", 20), big], 4, min_partition_bytes=64)
    parts = p.shards_of("emb")
    assert [s.name for s in parts] == [f"emb/part_{i}" for i in range(4)]
    assert [s.ps_task for s in parts] == [0, 1, 2, 3]
    assert p.shards_of("bias")[0].ps_task == 0  # smallest goes last, task 0 ties lowest
    assert [s.name for s in p.shards] == ["bias", "emb/part_0", "emb/part_1", "emb/part_2", "emb/part_3"]


def test_round_robin_continues_across_parts():
    big = VariableInfo("w", (3, 1), 8)
    p = place([v("a", 1), big, v("b", 1)], 2, strategy="round_robin", min_partition_bytes=8)
    assert [(s.name, s.ps_task) for s in p.shards] == [("a", 0), ("w/part_0", 1), ("w/part_1", 0), ("b", 1)]


# -- explicit devices ----------------------------------------------------------


def test_explicit_device_wins_and_counts_toward_load():
    # Without the device, greedy would put x on task 0. Its 100 bytes on task 1
    # count first, so a(60) goes to task 0 and b(50) too (60 < 100).
    p = place([v("a", 60), v("x", 100, "/job:ps/task:1"), v("b", 50)], 2)
    assert tasks(p) == {"a": 0, "x": 1, "b": 0}
    assert p.bytes_per_ps() == [110, 100]


def test_explicit_device_with_replica_and_device_parts_and_no_job():
    p = place([v("a", 10, "/job:ps/replica:0/task:2/device:CPU:0"), v("b", 10, "/task:1")], 3)
    assert tasks(p) == {"a": 2, "b": 1}


def test_explicit_device_holds_all_parts_and_round_robin_skips_it():
    big = VariableInfo("w", (4, 2), 4, "/job:ps/task:0")
    p = place(
        [big, v("x", 1, "/job:ps/task:1"), v("a", 1), v("b", 1), v("c", 1)],
        2,
        strategy="round_robin",
        min_partition_bytes=8,
    )
    assert [(s.name, s.ps_task) for s in p.shards_of("w")] == [("w/part_0", 0), ("w/part_1", 0)]
    # the automatic shards count 0, 1, 0 from their own start
    assert [tasks(p)[n] for n in ("x", "a", "b", "c")] == [1, 0, 1, 0]


@pytest.mark.parametrize(
    "device, problem",
    [
        ("/job:ps/task:2", "task 2 does not exist"),
        ("/job:worker/task:0", "job 'worker' is not 'ps'"),
        ("/job:ps", "no task is given"),
    ],
)
def test_explicit_device_that_names_no_ps_task_errors(device, problem):
    with pytest.raises(PlacementError) as info:
        place([v("a", 1), v("w", 10, device)], 2)
    msg = str(info.value)
    assert "'w'" in msg and repr(device) in msg and problem in msg
    assert "0..1" in msg


def test_soft_placement_falls_back_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="psframe.cluster.placement")
    with pytest.warns(UserWarning, match=r"'w'.*/job:ps/task:5.*0\.\.1"):
        p = place([v("a", 100), v("w", 10, "/job:ps/task:5")], 2, soft_placement=True)
    assert tasks(p) == {"a": 0, "w": 1}  # placed greedily like any other
    assert any("/job:ps/task:5" in r.getMessage() for r in caplog.records)


def test_malformed_device_string_is_a_placement_error_even_with_soft_placement():
    with pytest.raises(PlacementError, match=r"'w'.*'/job:ps/task:abc'") as info:
        place([v("w", 10, "/job:ps/task:abc")], 2, soft_placement=True)
    assert isinstance(info.value.__cause__, ClusterSpecError)


# -- partitioning --------------------------------------------------------------


def test_partition_rows_first_parts_take_the_extra_row():
    var = VariableInfo("w", (10, 2), 4)  # 80 bytes, 8 per row
    p = place([var], 3, min_partition_bytes=40)
    parts = p.shards_of("w")
    assert [s.name for s in parts] == ["w/part_0", "w/part_1", "w/part_2"]
    assert [(s.row_start, s.row_end) for s in parts] == [(0, 4), (4, 7), (7, 10)]
    assert [s.shape for s in parts] == [(4, 2), (3, 2), (3, 2)]
    assert [s.nbytes for s in parts] == [32, 24, 24]
    assert all(s.partitioned and s.num_parts == 3 for s in parts)
    assert [s.part_index for s in parts] == [0, 1, 2]
    assert_covers(p, var)


def test_small_variable_is_not_partitioned():
    var = VariableInfo("w", (10, 2), 4)
    for p in (place([var], 3, min_partition_bytes=80), place([var], 3, min_partition_bytes=None)):
        (s,) = p.shards
        assert (s.name, s.row_start, s.row_end, s.shape, s.nbytes) == ("w", 0, 10, (10, 2), 80)
        assert not s.partitioned


def test_parts_capped_at_rows():
    p = place([VariableInfo("w", (2, 100), 1)], 4, min_partition_bytes=10)
    assert [s.shape for s in p.shards] == [(1, 100), (1, 100)]


def test_large_variable_on_one_ps_is_split_under_max_shard_bytes():
    var = VariableInfo("emb", (75_000, 1000), 4)  # 300 MB
    p = place([var], 1)
    parts = p.shards_of("emb")
    assert len(parts) == math.ceil(300e6 / DEFAULT_MAX_SHARD_BYTES)
    assert all(s.nbytes <= DEFAULT_MAX_SHARD_BYTES for s in parts)
    assert all(s.ps_task == 0 for s in parts)
    assert_covers(p, var)


def test_every_part_fits_even_when_rows_do_not_divide_evenly():
    # ceil(180 / 100) = 2 parts would need 2 rows (120 bytes) in part 0; whole
    # rows per part is 1, so 3 parts are needed.
    var = VariableInfo("w", (3, 60), 1)
    p = place([var], 1, max_shard_bytes=100)
    assert [s.nbytes for s in p.shards] == [60, 60, 60]
    assert_covers(p, var)


def test_row_larger_than_max_shard_bytes_but_under_hard_limit_is_allowed():
    var = VariableInfo("w", (3, 100), 1)
    p = place([var], 2, max_shard_bytes=50, min_partition_bytes=None)
    assert [s.nbytes for s in p.shards] == [100, 100, 100]
    assert_covers(p, var)


def test_row_larger_than_hard_limit_errors():
    var = VariableInfo("huge", (2, 2**29), 8)  # one row is 4 GiB
    with pytest.raises(PlacementError, match=rf"'huge'.*{2**32} bytes.*{HARD_MAX_SHARD_BYTES}"):
        place([var], 4)


def test_max_shard_bytes_may_not_exceed_hard_limit():
    with pytest.raises(PlacementError, match="max_shard_bytes"):
        place([v("a", 1)], 1, max_shard_bytes=HARD_MAX_SHARD_BYTES + 1)


def test_scalar_and_empty_tensors():
    scalar = VariableInfo("step", (), 8)
    empty = VariableInfo("e", (0, 4), 4)
    zero_cols = VariableInfo("z", (5, 0), 4)
    p = place([scalar, empty, zero_cols], 2, min_partition_bytes=0, max_shard_bytes=1)
    s, e, z = p.shards
    assert (s.name, s.row_start, s.row_end, s.shape, s.nbytes, s.num_parts) == ("step", 0, 1, (), 8, 1)
    assert (e.name, e.row_start, e.row_end, e.shape, e.nbytes, e.num_parts) == ("e", 0, 0, (0, 4), 0, 1)
    assert (z.name, z.row_start, z.row_end, z.shape, z.nbytes, z.num_parts) == ("z", 0, 5, (5, 0), 0, 1)
    assert p.bytes_per_ps() == [8, 0]


# -- reporting -----------------------------------------------------------------


def test_bytes_per_ps_sums_to_total():
    vars_ = [VariableInfo(f"w{i}", (i + 1, 7), 4) for i in range(9)]
    for strategy in ("greedy", "round_robin"):
        p = place(vars_, 3, strategy=strategy, min_partition_bytes=100)
        assert sum(p.bytes_per_ps()) == sum(x.nbytes for x in vars_)
        assert any(s.partitioned for s in p.shards)
        for x in vars_:
            assert_covers(p, x)


def test_describe_mentions_every_shard_and_task():
    p = place([VariableInfo("emb", (3, 4), 4), v("bias", 3)], 3, min_partition_bytes=16)
    text = p.describe()
    lines = text.splitlines()
    for s in p.shards:
        line = next(ln for ln in lines if ln.strip().startswith(s.name + " "))
        assert f"-> /job:ps/task:{s.ps_task}" in line
        assert str(s.shape) in line and f"{s.nbytes} bytes" in line
    for task, nbytes in enumerate(p.bytes_per_ps()):
        assert f"/job:ps/task:{task}: {nbytes} bytes" in text
    # three 16-byte parts, then bias (3) on task 0 (all tie): max/mean = 19 / 17
    assert p.bytes_per_ps() == [19, 16, 16]
    assert "imbalance (max/mean) 1.12" in text


def test_shards_on_rejects_unknown_task_and_shards_of_unknown_is_empty():
    p = place([v("a", 1)], 2)
    with pytest.raises(PlacementError, match="0..1, got 2"):
        p.shards_on(2)
    assert p.shards_of("nope") == []
    assert p.shards_on(1) == []


def test_placement_rejects_shard_on_missing_task():
    with pytest.raises(PlacementError, match="ps task 3"):
        ShardPlacement(2, (Shard("a", "a", 3, 0, 1, (1,), 1),))


# -- invalid requests ----------------------------------------------------------


@pytest.mark.parametrize("num_ps", [0, -1, 1.5, True])
def test_invalid_num_ps(num_ps):
    with pytest.raises(PlacementError, match="num_ps"):
        place([v("a", 1)], num_ps)


def test_invalid_strategy():
    with pytest.raises(PlacementError, match=r"strategy.*'random'"):
        place([v("a", 1)], 2, strategy="random")


def test_duplicate_variable_names():
    with pytest.raises(PlacementError, match="'a' appears more than once"):
        place([v("a", 1), v("b", 1), v("a", 2)], 2)


def test_shard_name_clash_with_a_part_name():
    big = VariableInfo("w", (4, 4), 4)
    with pytest.raises(PlacementError, match="w/part_0"):
        place([big, v("w/part_0", 1)], 2, min_partition_bytes=8)


def test_not_a_variable_info():
    with pytest.raises(PlacementError, match="expected VariableInfo"):
        place([("a", (1,), 4)], 1)  # type: ignore[list-item]


def test_empty_model():
    p = place([], 3)
    assert p.shards == () and p.bytes_per_ps() == [0, 0, 0]
    assert "imbalance (max/mean) 1.00" in p.describe()
    assert MiB == 1 << 20

"""A live re-layout: ps tasks added and drained while workers train (:mod:`psframe.ps.elastic.relayout`).

Unit tests of the parts (which clusters may follow which, the shard record on
the wire), then ps tasks in this process with workers in threads: a ps task is
added (asked from outside, as ``psframe reshard`` does) and later drained, and
the values equal the known-gradient arithmetic exactly: every step applied
once, the optimizer state moved with its rows.

This file holds the unit tier's tests of the subject; `tests/service/test_relayout.py`,
`tests/cluster/test_relayout.py` hold the other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.checkpoint.deltas import RowChanges
from psframe.checkpoint.shard import OptimizerData, ShardData, VariableData
from psframe.checkpoint.slices import slice_rows
from psframe.errors import ClusterSpecError
from psframe.ps.elastic.relayout import check_new_cluster
from psframe.ps.elastic.shard_codec import decode_shard, encode_shard, shard_chunks
from psframe.wire import codec
from tests.service.test_relayout import with_ps


def test_only_ps_tasks_added_at_the_end_or_drained_from_it_are_taken_live():
    before = psframe.ClusterSpec({"ps": ["h:1", "h:2"], "worker": ["w:1"]})
    check_new_cluster(before, with_ps(before, ["h:1", "h:2", "h:3"]))
    check_new_cluster(before, with_ps(before, ["h:1"]))
    with pytest.raises(ClusterSpecError, match="must begin with the old one"):
        check_new_cluster(before, with_ps(before, ["h:2", "h:3"]))
    with pytest.raises(ClusterSpecError, match="nothing to move"):
        check_new_cluster(before, before)
    with pytest.raises(ClusterSpecError, match="the same workers"):
        check_new_cluster(before, psframe.ClusterSpec({"ps": ["h:1"], "worker": ["w:1", "w:2"]}))


def test_a_shard_record_crosses_the_wire_without_pickle_and_comes_back_equal():
    value = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    shard = ShardData(
        global_step=7,
        ps_task=1,
        num_shards=2,
        optimizer=OptimizerData("Adam", {"lr": 0.01, "betas": [0.9, 0.99]}),
        sync=None,
        variables=(
            VariableData(
                "w/part_1",
                "w",
                "float32",
                (4, 3),
                (8, 3),
                4,
                1,
                2,
                value,
                {"step": torch.tensor(3.0), "exp_avg": value * 2},
            ),
        ),
        pushes={"last_push": [5, 0], "applied_steps": [3, 0]},
    )
    rows = {"t/part_0": RowChanges(torch.tensor([2, 5]), torch.ones(2, 3), {"sum": torch.zeros(2, 3), "n": 4})}
    fetched = decode_shard(encode_shard(shard, rows, mark=11, layout_version=3))
    assert (fetched.mark, fetched.layout_version) == (11, 3)
    (changed,) = fetched.rows.values()
    assert torch.equal(changed.index, torch.tensor([2, 5])) and changed.state["n"] == 4
    assert torch.equal(changed.state["sum"], torch.zeros(2, 3))
    back = fetched.shard
    assert back.global_step == 7 and back.pushes == shard.pushes and back.optimizer == shard.optimizer
    (part,) = back.variables
    assert torch.equal(part.value, value) and torch.equal(part.state["exp_avg"], value * 2)
    assert part.row_start == 4 and part.full_shape == (8, 3)
    # A piece of a part to be made (rows cut anew) stays a view of the reply, but its step count;
    # a part kept whole is a copy of its own.
    for piece in (True, False):
        buffer = bytearray(encode_shard(shard))
        whole = set() if piece else {("w", 4, (4, 3))}  # the parts the asking task makes
        (part,) = decode_shard(memoryview(buffer), whole).shard.variables
        buffer[:] = bytes(len(buffer))  # the reply's buffer, written over
        assert torch.equal(part.value, torch.zeros_like(value) if piece else value)
        assert torch.equal(part.state["exp_avg"], torch.zeros_like(value) if piece else value * 2)
        assert float(part.state["step"]) == 3.0


def test_a_reply_to_a_task_of_this_host_goes_through_a_shared_memory_file_it_removes():
    import os

    from psframe.errors import SharedRegionError
    from psframe.ps.elastic.relayout import Relayout
    from psframe.ps.elastic.shard_codec import received
    from psframe.wire import psframe_pb2 as pb
    from psframe.wire import same_host

    if not same_host.available():
        pytest.skip("no /dev/shm here")
    value = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    part = VariableData("w", "w", "float32", (6, 4), (6, 4), 0, 0, 1, value, {"sum": value * 3})
    chunks = shard_chunks(ShardData(5, 0, 1, OptimizerData("Adagrad", {}), None, (part,)))
    reply = b"".join(chunks)
    relayout = Relayout()
    assert relayout.hand_over(chunks, same_host=False) == reply  # another host's task: through gRPC
    small = relayout.hand_over(chunks, same_host=True)
    assert len(small) < 200 < len(reply)  # the header only: the file holds the rest
    (path,) = [r.message.path for r in relayout._shared]
    assert os.path.exists(path)
    (back,) = received(small).shard.variables
    assert torch.equal(back.value, value) and torch.equal(back.state["sum"], value * 3)
    assert not os.path.exists(path)  # read once, removed by the reader
    assert not relayout.release(relayout.version + 1)  # a word for another layout: nothing goes
    assert relayout._shared
    assert relayout.release(relayout.version)  # this layout's: the holder lets go of its file
    assert relayout._shared == []
    # A file this process cannot map as such (another host's): said, for a call through gRPC.
    bogus = pb.SameHostRegion(path=path, key=b"k" * 16, size=64, request_start=64, reply_start=64)
    with pytest.raises(SharedRegionError):
        received(codec.encode(pb.FetchPartsReplyHeader(shared=bogus), ()))


def test_a_task_of_the_new_layout_is_sent_only_the_parts_that_hold_its_rows():
    from psframe.ps.elastic.relayout import Relayout
    from psframe.wire import psframe_pb2 as pb

    def part(k: int, rows: int = 4, stride: int = 0) -> VariableData:
        value = torch.full((rows, 2), float(k))
        return VariableData(
            f"w/part_{k}", "w", "float32", (rows, 2), (12, 2), 4 * k, k, 3, value, {}, row_stride=stride
        )

    relayout = Relayout()
    before = psframe.ClusterSpec({"ps": ["h:1", "h:2"], "worker": ["w:1"]})
    relayout.move(before, with_ps(before, ["h:1"]))
    relayout.keep(ShardData(3, 0, 2, OptimizerData("SGD", {}), None, (part(0), part(1), part(2))))

    def sent(*ranges: tuple[int, int]) -> list[str]:
        rows = [pb.RowRange(variable="w", start=a, end=b) for a, b in ranges]
        return [v.name for v in decode_shard(encode_shard(relayout.parts(["w"], rows))).shard.variables]

    assert sent((0, 5)) == ["w/part_0", "w/part_1"]  # rows 0..4: the first part and a row of the second
    assert sent((8, 12)) == ["w/part_2"]
    assert sent() == ["w/part_0", "w/part_1", "w/part_2"]  # no range: every part
    assert relayout.parts(["b"], []).variables == ()

    # Trimmed (a FetchParts reply): only the rows asked for cross, with their element-wise state.
    for k, v in enumerate(relayout.snapshot.variables):
        v.state.update(sum=v.value * 10, step=torch.tensor(float(k)))
    wanted = [pb.RowRange(variable="w", start=3, end=5), pb.RowRange(variable="w", start=9, end=12)]
    pieces = decode_shard(encode_shard(relayout.parts(["w"], wanted, trim=True))).shard.variables
    assert [(p.name, p.row_start, p.shape) for p in pieces] == [
        ("w/part_0", 3, (1, 2)),
        ("w/part_1", 4, (1, 2)),
        ("w/part_2", 9, (3, 2)),
    ]
    for p in pieces:
        k = int(p.name[-1])
        assert torch.equal(p.value, torch.full(p.shape, float(k))) and torch.equal(p.state["sum"], p.value * 10)
        assert float(p.state["step"]) == k  # not element-wise: whole
    restored, _ = slice_rows([ShardData(3, 0, 2, OptimizerData("SGD", {}), None, tuple(pieces))], "w", 3, 5)
    assert restored[:, 0].tolist() == [0.0, 1.0]  # the rows rebuilt from the pieces
    whole = relayout.parts(["w"], [pb.RowRange(variable="w", start=0, end=12)], trim=True).variables
    assert [p.value.data_ptr() for p in whole] == [v.value.data_ptr() for v in relayout.snapshot.variables]

    # A table by id modulo its 3 parts: a task cutting it alike is sent the part of its first row
    # alone; one cutting it otherwise (every 4th row, or runs of rows) every part.
    strided = tuple(
        VariableData(f"t/part_{k}", "t", "float32", (4, 2), (12, 2), k, k, 3, torch.zeros(4, 2), {}, row_stride=3)
        for k in range(3)
    )
    relayout.keep(ShardData(3, 0, 2, OptimizerData("SGD", {}), None, strided))

    def table_sent(wanted: pb.RowRange) -> list[str]:
        return [v.name for v in relayout.parts(["t"], [wanted]).variables]

    assert table_sent(pb.RowRange(variable="t", start=1, end=11, stride=3)) == ["t/part_1"]
    assert table_sent(pb.RowRange(variable="t", start=1, end=10, stride=4)) == ["t/part_0", "t/part_1", "t/part_2"]
    assert table_sent(pb.RowRange(variable="t", start=0, end=6)) == ["t/part_0", "t/part_1", "t/part_2"]


def test_a_status_request_that_waits_is_answered_once_the_layout_moves():
    """ps 0's side of a following worker's long poll: no answer before the layout moves past the
    version asked about (or the wait ends), and an answer as soon as it does."""
    import threading

    from psframe.ps.elastic.relayout import Relayout

    relayout = Relayout()
    before = psframe.ClusterSpec({"ps": ["h:1", "h:2"], "worker": ["w:1"]})
    relayout.wait_past(-1, 30.0)  # past already: at once
    answered = threading.Event()

    def ask() -> None:
        relayout.wait_past(relayout.version, 30.0)
        answered.set()

    waiting = threading.Thread(target=ask, daemon=True)
    waiting.start()
    assert not answered.wait(0.2)  # nothing moved: still waiting
    relayout.move(before, with_ps(before, ["h:1"]))
    assert answered.wait(10)  # moved: answered (long before its 30 s)
    waiting.join(10)
    relayout.wait_past(relayout.version, 0.01)  # nothing moves: the wait ends on its own

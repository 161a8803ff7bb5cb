"""The mean a synchronous round applies (``psframe.ps.protocol.round_mean``), in spans and by variable.

The oracle is the mean the design fixes, written out here: per variable,
``((g0 + g1) + g2 ...) / n`` over the members in task-index order. The sum
taken over whole messages (spans) must give its bits exactly, for 2 and 3
members, several dtypes, a step sent in several messages, a backup worker
left out, and a round that carries table rows too; where the members' spans
do not hold the round's gradients alike, the mean is taken by variable, with
the same bits.
"""

from __future__ import annotations

import threading

import pytest
import torch

import psframe
from psframe.cluster import ClusterSpec
from psframe.ps.protocol.round_mean import Contribution, GradientSpan, RoundMean
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.ps.store import VariableStore
from psframe.wire import codec, encoding
from psframe.wire import psframe_pb2 as pb
from psframe.wire.layouts import Layouts
from tests.unit.test_sync_unit import LR, TIMEOUT, Call, sgd_reference, snapshot, wait_until

SHAPES = {"w": (37, 11), "b": (11,), "c": (5,)}  # odd sizes: padding between the tensors of a message


def _grads(seed: int, dtype: torch.dtype = torch.float32, sign: float = 1.0) -> dict[str, torch.Tensor]:
    """Gradients spanning many magnitudes, so that the order of additions shows in the bits."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in SHAPES.items():
        mantissa = torch.randn(shape, generator=generator, dtype=torch.float64)
        exponent = torch.randint(-3, 9, shape, generator=generator).to(torch.float64)
        out[name] = (sign * mantissa * torch.pow(10.0, exponent)).to(dtype)
    return out


def _sent(grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], GradientSpan]:
    """``grads`` as a ps task reads them from a worker's message: views of it, and their span."""
    data = codec.encode(pb.PushPullHeader(step=0), list(grads.items()))
    tensors, span = Layouts().read(encoding.parse(data, pb.PushPullHeader))
    assert span is not None
    return dict(zip(grads, tensors)), GradientSpan(*span)


def _contribution(*messages: dict[str, torch.Tensor]) -> Contribution:
    """A member whose gradients came in these messages, each read with its span."""
    contribution = Contribution()
    for grads in messages:
        contribution.add(*_sent(grads))
    return contribution


def _oracle(names, members: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        total = members[0][name] + members[1][name]
        for grads in members[2:]:
            total = total + grads[name]
        out[name] = total / len(members)
    return out


def _assert_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), f"{name}: not the oracle's bits"


def _one_buffer(mean: dict[str, torch.Tensor]) -> bool:
    """Whether the mean's tensors all lie in one buffer (the sum was taken over spans)."""
    return len({tensor.untyped_storage().data_ptr() for tensor in mean.values()}) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("count", [2, 3])
def test_the_sum_over_spans_gives_the_bits_of_the_sum_by_variable(count, dtype):
    grads = [_grads(10 + i, dtype, sign=-1.0 if i == 2 else 1.0) for i in range(count)]
    expected = _oracle(SHAPES, grads)
    mean = RoundMean().of(list(SHAPES), [_contribution(g) for g in grads])
    assert _one_buffer(mean)
    _assert_exact(mean, expected)
    by_variable = RoundMean().of(list(SHAPES), [Contribution(grads=dict(g)) for g in grads])
    assert not _one_buffer(by_variable)
    _assert_exact(by_variable, expected)
    if count == 3:  # the oracle can tell: another order of the members gives other bits
        assert any(not torch.equal(expected[n], _oracle([n], grads[::-1])[n]) for n in SHAPES)


def test_a_step_in_several_messages_is_summed_message_by_message():
    grads = [_grads(20 + i) for i in range(3)]
    members = [_contribution({"w": g["w"]}, {"b": g["b"], "c": g["c"]}) for g in grads]
    mean = RoundMean().of(list(SHAPES), members)
    assert mean["b"].untyped_storage().data_ptr() == mean["c"].untyped_storage().data_ptr()
    assert mean["w"].untyped_storage().data_ptr() != mean["b"].untyped_storage().data_ptr()
    _assert_exact(mean, _oracle(SHAPES, grads))


def test_members_laid_out_otherwise_are_summed_by_variable_with_the_same_bits():
    grads = [_grads(30 + i) for i in range(2)]
    reordered = {name: grads[1][name] for name in ("b", "w", "c")}
    mean = RoundMean().of(list(SHAPES), [_contribution(grads[0]), _contribution(reordered)])
    assert not _one_buffer(mean)
    _assert_exact(mean, _oracle(SHAPES, grads))


def test_a_gradient_sent_again_outside_its_span_replaces_it():
    grads = [_grads(40 + i) for i in range(2)]
    member = _contribution(_grads(99))  # a first try, then "w" sent again in a message of its own
    member.add(*_sent({"w": grads[0]["w"]}))
    member.add({"b": grads[0]["b"], "c": grads[0]["c"]})  # compressed on the wire: widened, no span
    assert list(member.spans) == [(torch.float32, (("w", 0, SHAPES["w"]),))]
    mean = RoundMean().of(list(SHAPES), [member, _contribution(grads[1])])
    _assert_exact(mean, _oracle(SHAPES, grads))


def test_the_buffers_are_kept_from_round_to_round():
    names, rounds = list(SHAPES), [[_grads(50 + 2 * r + i) for i in range(2)] for r in range(2)]
    mean_of = RoundMean()
    first = mean_of.of(names, [_contribution(g) for g in rounds[0]])
    _assert_exact(first, _oracle(names, rounds[0]))
    where = first["w"].data_ptr()
    second = mean_of.of(names, [_contribution(g) for g in rounds[1]])
    assert second["w"].data_ptr() == where
    _assert_exact(second, _oracle(names, rounds[1]))


def test_one_member_s_gradients_are_applied_as_they_came():
    grads = _grads(60)
    member = _contribution(grads)
    mean = RoundMean().of(list(SHAPES), [member])
    assert all(mean[name] is member.grads[name] for name in SHAPES)


# --------------------------------------------------------------------- the barrier, with spans

TABLE = (6, 3)


def _store() -> VariableStore:
    generator = torch.Generator().manual_seed(7)
    values = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    values["emb"] = torch.randn(TABLE, generator=generator)
    store = VariableStore(task_name="/job:ps/task:0")
    assert store.create(values, psframe.optim.SGD(lr=LR), tables=["emb"], table_optimizer=psframe.optim.SGD(lr=LR))
    return store


def _rows(worker: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(70 + worker)
    ids = torch.tensor([worker % TABLE[0], 4, (worker + 2) % TABLE[0]])  # row 4 from everyone: summed
    return [("emb", ids, torch.randn(len(ids), TABLE[1], generator=generator))]


def _round_with_a_backup(spans: bool) -> tuple[VariableStore, SyncAggregator, dict[int, dict[str, torch.Tensor]]]:
    """Three workers, two gradients a round: workers 2 and 0 make it, worker 1 comes late."""
    store = _store()
    agg = SyncAggregator(store, num_workers=3, replicas_to_aggregate=2, timeout=TIMEOUT)
    grads = {w: _grads(80 + w, sign=-1.0 if w == 1 else 1.0) for w in range(3)}

    def push(worker: int) -> bool:
        if spans:
            views, span = _sent(grads[worker])
            return agg.push(worker, 0, views, rows=_rows(worker), span=span)
        return agg.push(worker, 0, grads[worker], rows=_rows(worker))

    first = Call(push, 2)
    wait_until(lambda: agg._round.completed == [2], store, first, what="worker 2 waiting")
    second = Call(push, 0)
    assert first.value() is False and second.value() is False
    assert push(1) is True  # the backup: stale by now
    assert agg.dropped_gradients == 1 and agg.members_of(0) == (0, 2)
    return store, agg, grads


def test_a_round_in_spans_with_a_backup_worker_and_table_rows_is_exact():
    store, agg, grads = _round_with_a_backup(spans=True)
    assert agg._mean._buffers, "the round was not summed over spans"
    reference_store, _, _ = _round_with_a_backup(spans=False)
    actual, reference = snapshot(store), snapshot(reference_store)
    _assert_exact(actual, reference)  # the table's rows too
    initial = snapshot(_store())
    dense = sgd_reference({n: initial[n] for n in SHAPES}, _oracle(SHAPES, [grads[0], grads[2]]))
    _assert_exact({n: actual[n] for n in SHAPES}, dense)
    assert not torch.equal(actual["emb"], initial["emb"])


# --------------------------------------------------------------------- the data plane, with stream caches


def _train(cached: bool, steps: int = 4) -> dict[str, torch.Tensor]:
    """Two workers' threads send steps to a sync service, each on its own stream (with its cache)
    or without one; the variables after the last round."""
    cluster = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})  # never dialed
    service = ParameterServerService(cluster, 0)
    service.store.create({name: torch.zeros(shape) for name, shape in SHAPES.items()}, psframe.optim.SGD(lr=LR))
    service._start_sync(pb.SyncDef(replicas_to_aggregate=2, total_num_replicas=2, timeout_seconds=60.0))
    errors: list[str] = []

    def worker(index: int) -> None:
        cache = StreamCache() if cached else None
        caller = pb.Caller(job_name="worker", task_index=index, cluster_fingerprint=cluster.fingerprint)
        for step in range(steps):
            header = pb.PushPullHeader(caller=caller, push_id=step + 1, step=step, pull=list(SHAPES), end_of_step=True)
            data = codec.encode(header, list(_grads(100 * index + step).items()))
            reply = encoding.parse(service.push_pulls.reply(data, cache), pb.PushPullReplyHeader).header
            if reply.error_class or reply.global_step != step + 1:
                errors.append(f"worker {index} step {step}: {reply.error_class} {reply.error_message}")

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a worker thread hung"
    assert not errors, errors
    assert bool(service.aggregator._mean._buffers) == cached
    return snapshot(service.store)


def test_rounds_read_through_the_streams_layouts_give_the_bits_of_rounds_read_in_full():
    _assert_exact(_train(cached=True), _train(cached=False))

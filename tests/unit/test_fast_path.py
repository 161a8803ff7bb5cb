"""The ps task's fast path (psframe.ps.service.push_pull_handler), against its general path. No network.

Oracle: two services fed the same requests, one with a stream's cached requests and one
without, give the same replies and end with the same variables, bit for bit;
requests the fast path must not take (another caller, a compressed one, a bad
one, a store made anew) are answered as the general path answers them.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.cluster import ClusterSpec
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.wire import codec, dtypes, encoding
from psframe.wire import psframe_pb2 as pb

CLUSTER = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
VALUES = {
    "w": torch.arange(12, dtype=torch.float32).view(4, 3),
    "b": torch.ones(3),
    "n": torch.zeros(2, dtype=torch.float64),
}


def _service(optimizer=None) -> ParameterServerService:
    service = ParameterServerService(CLUSTER, 0)
    service.store.create({k: v.clone() for k, v in VALUES.items()}, optimizer or psframe.optim.Adam(lr=0.1))
    return service


def _request(
    step: int,
    push: list[str],
    pull: list[str],
    *,
    worker: int = 0,
    scale: float = 1.0,
    fingerprint: str | None = None,
    wire_dtype: str = "",
    end_of_step: bool = True,
) -> bytes:
    caller = pb.Caller(
        job_name="worker",
        task_index=worker,
        cluster_fingerprint=CLUSTER.fingerprint if fingerprint is None else fingerprint,
    )
    header = pb.PushPullHeader(caller=caller, step=step, pull=pull, end_of_step=end_of_step, wire_dtype=wire_dtype)
    grads = [(name, torch.full_like(VALUES[name], scale * (step + 1) + 0.25 * i)) for i, name in enumerate(push)]
    if wire_dtype:
        grads = [(name, g.to(dtypes.WIRE_DTYPES[wire_dtype]) if g.dtype == torch.float32 else g) for name, g in grads]
    return codec.encode(header, grads)


def _replies(requests: list[bytes], service: ParameterServerService, plans: StreamCache | None):
    return [codec.decode(service.push_pulls.reply(r, plans), pb.PushPullReplyHeader) for r in requests]


def _same(replies_a, replies_b) -> None:
    assert len(replies_a) == len(replies_b)
    for (header_a, tensors_a), (header_b, tensors_b) in zip(replies_a, replies_b):
        assert header_a == header_b
        assert len(tensors_a) == len(tensors_b)
        assert all(torch.equal(a, b) for a, b in zip(tensors_a, tensors_b))


def _variables(service: ParameterServerService) -> dict[str, torch.Tensor]:
    _, values, _states = service.store.snapshot()
    return values


def _planned_equals_general(requests: list[bytes], optimizer=None) -> StreamCache:
    planned, general = _service(optimizer), _service(optimizer)
    plans = StreamCache()
    _same(_replies(requests, planned, plans), _replies(requests, general, None))
    a, b = _variables(planned), _variables(general)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert planned.store.global_step == general.store.global_step
    assert planned.store.pushes == general.store.pushes
    return plans


@pytest.mark.parametrize(
    "optimizer", [psframe.optim.SGD(lr=0.5, momentum=0.9), psframe.optim.Adam(lr=0.1), psframe.optim.Adagrad(lr=0.3)]
)
def test_a_step_plan_repeated_gives_what_the_general_path_gives(optimizer):
    # Each step: two messages (the second ends the step), as a worker's planned requests.
    requests = []
    for step in range(6):
        requests += [_request(step, ["w"], ["w"], end_of_step=False), _request(step, ["b", "n"], ["b", "n", "w"])]
    plans = _planned_equals_general(requests, optimizer)
    assert len(plans._requests) == 2  # one per kind of request, made once


def test_requests_the_fast_path_must_not_take_are_answered_the_general_way():
    requests = [
        _request(0, ["w", "b"], ["w", "b"]),
        _request(1, ["w", "b"], ["w", "b"]),
        _request(2, ["w", "b"], ["w", "b"], worker=1),  # another caller: its own plan
        _request(3, ["w", "b"], ["w", "b"], fingerprint="another cluster"),  # refused, by name
        _request(4, ["w", "b"], ["w", "b"], wire_dtype="bfloat16"),  # compressed: never planned
        _request(5, ["w", "b"], ["b", "w"]),  # same push, another pull order
        _request(6, ["w", "b"], ["w"], end_of_step=False),  # counts no step
        _request(7, [], ["w", "b"]),  # pull only
        _request(8, [], ["w", "b"]),
        _request(9, ["w", "b"], ["w", "b"]),
        _request(10, ["w", "b"], ["w", "b"], worker=1),
    ]
    _planned_equals_general(requests)


def test_a_bad_request_after_a_plan_is_refused_and_changes_nothing():
    service = _service()
    plans = StreamCache()
    good = _request(0, ["w", "b"], ["w", "b"])
    service.push_pulls.reply(good, plans)
    service.push_pulls.reply(good, plans)
    before = {k: v.clone() for k, v in _variables(service).items()}
    step = service.store.global_step
    header = pb.PushPullHeader(
        caller=pb.Caller(job_name="worker", task_index=0, cluster_fingerprint=CLUSTER.fingerprint), pull=["w", "b"]
    )
    bad = codec.encode(header, [("w", torch.ones(3, 4)), ("b", torch.ones(3))])  # w's shape is wrong
    reply, _ = codec.decode(service.push_pulls.reply(bad, plans), pb.PushPullReplyHeader)
    assert reply.error_class == "ShapeMismatchError"
    after = _variables(service)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert service.store.global_step == step


def test_a_plan_of_variables_made_anew_is_dropped_not_used():
    service = _service(psframe.optim.SGD(lr=1.0))
    plans = StreamCache()
    request = _request(0, ["w"], ["w"])
    service.push_pulls.reply(request, plans)
    (plan,) = plans._requests
    # The store's variables made anew (as when a checkpoint is restored): new tensors.
    _, values, states = service.store.snapshot()
    service.store.attach_shared({k: v.clone().fill_(5.0) for k, v in values.items()}, states, psframe.optim.SGD(lr=1.0))
    reply, (w,) = codec.decode(service.push_pulls.reply(request, plans), pb.PushPullReplyHeader)
    assert not reply.error_class
    assert torch.equal(w, torch.full((4, 3), 5.0) - 1.0)  # the new variable, updated once
    assert plan not in plans._requests and len(plans._requests) == 1


def test_stream_plans_are_tried_from_the_one_after_the_last_used():
    service = _service()
    plans = StreamCache()
    kinds = [_request(0, [name], [name]) for name in ("w", "b", "n")]
    for data in kinds:
        service.push_pulls.reply(data, plans)
    headers = [encoding.parse(data, pb.PushPullHeader).header for data in kinds]
    for header, plan in zip(headers * 2, plans._requests * 2):
        assert plans.find(header) is plan
        assert plans._next == (plans._requests.index(plan) + 1) % 3

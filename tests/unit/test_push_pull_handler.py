"""The data plane alone: PushPullHandler.answer over a store, from request bytes to reply bytes.

No gRPC, no re-layout: the handler is built from its parts as the service builds it, and
requests are encoded with the wire codec, as a worker's are.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError, PsframeError
from psframe.memory.malloc import MemoryReturner
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.ledger_cut import LedgerCut
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import StalenessGate
from psframe.ps.service.place import TaskPlace
from psframe.ps.service.push_pull_handler import PushPullHandler, StreamCache
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb

TASK = "/job:ps/task:0"
LR = 0.5
CLUSTER = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})  # never dialed


class Guard:
    """Takes every caller, or refuses the ones named."""

    def __init__(self, refuse: tuple[int, ...] = ()) -> None:
        self.refuse = refuse
        self.asked = 0
        self.pending = False  # no re-layout asked for

    def check_caller(self, caller: pb.Caller) -> None:
        self.asked += 1
        if caller.task_index in self.refuse:
            raise ClusterMismatchError(f"worker {caller.task_index} is not taken here")


def _values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}


def _handler(admission: Guard | None = None) -> tuple[PushPullHandler, VariableStore, PushLedger]:
    store = VariableStore(task_name=TASK)
    assert store.create(_values(), psframe.optim.SGD(lr=LR))
    ledger = PushLedger(CLUSTER.num_workers)
    roster = WorkerRoster(CLUSTER.num_workers, 60.0)
    data = RangeQueue(gone=lambda worker: False, lock=store.lock)
    model = ServedModel(store, ledger, data, roster, TaskPlace(CLUSTER, 0, None, None), task_index=0, elastic=False)
    handler = PushPullHandler(
        store,
        ledger,
        LedgerCut(ledger, store.lock, roster, TASK),
        roster,
        StalenessGate(ledger, roster, TASK),
        data,
        model,
        admission=admission or Guard(),
        layout=Guard(),
        memory=MemoryReturner(enabled=False),
        task_name=TASK,
        keeps_data=True,
    )
    return handler, store, ledger


def _push(worker: int, push_id: int, grads: dict[str, torch.Tensor], pull: tuple[str, ...] = ("w", "b")) -> bytes:
    header = pb.PushPullHeader(
        caller=pb.Caller(job_name="worker", task_index=worker),
        push_id=push_id,
        pull=list(pull),
        end_of_step=True,
    )
    return codec.encode(header, list(grads.items()))


def _grads(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}


def _reply(data: bytes) -> tuple[pb.PushPullReplyHeader, dict[str, torch.Tensor]]:
    header, tensors = codec.decode(data, pb.PushPullReplyHeader)
    return header, {meta.name: tensor for meta, tensor in zip(header.tensors, tensors)}


def test_an_asynchronous_push_is_applied_and_answered_with_the_values_after_it():
    handler, store, _ = _handler()
    before, grads = _values(), _grads(7)
    header, values = _reply(handler.answer(_push(1, 1, grads)))
    assert not header.error_class and not header.duplicate
    assert header.global_step == store.global_step == 1
    for name in ("w", "b"):
        assert torch.equal(values[name], before[name] - LR * grads[name])


def test_a_push_sent_again_is_answered_and_not_applied_twice():
    handler, store, ledger = _handler()
    grads = _grads(8)
    first, values = _reply(handler.answer(_push(1, 1, grads)))
    again, values_again = _reply(handler.answer(_push(1, 1, grads)))
    assert again.duplicate and not first.duplicate
    assert store.global_step == 1 and ledger.applied_steps(1) == 1
    assert all(torch.equal(values[name], values_again[name]) for name in ("w", "b"))


def test_the_cached_path_gives_the_bits_of_the_general_one():
    """The same pushes through a stream's cache (the fast path) and without one."""
    general, _, _ = _handler()
    cached, _, _ = _handler()
    cache = StreamCache()
    for push_id in range(1, 5):
        grads = _grads(push_id)
        _, slow = _reply(general.answer(_push(0, push_id, grads)))
        _, fast = _reply(cached.answer(_push(0, push_id, grads), cache))
        assert all(torch.equal(slow[name], fast[name]) for name in ("w", "b")), push_id


def test_a_refused_caller_changes_nothing():
    admission = Guard(refuse=(1,))
    handler, store, ledger = _handler(admission)
    before = _values()
    with pytest.raises(ClusterMismatchError, match="worker 1 is not taken here"):
        handler.answer(_push(1, 1, _grads(9)))
    assert admission.asked == 1
    assert store.global_step == 0 and ledger.applied_steps(1) == 0
    with store.lock:
        assert all(torch.equal(v, before[n]) for n, v in zip(store.names, store.read(store.names)))


def test_a_gradient_of_another_shape_is_refused_and_nothing_is_applied():
    handler, store, _ = _handler()
    grads = _grads(10)
    grads["w"] = torch.zeros(3, 4)
    with pytest.raises(PsframeError, match="w"):
        handler.answer(_push(0, 1, grads))
    assert store.global_step == 0

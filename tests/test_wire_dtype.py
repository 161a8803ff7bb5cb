"""Optional wire compression (``wire_dtype``): what is rounded, what is not.

The oracle: with ``wire_dtype="bfloat16"`` the ps applies exactly the
bfloat16-rounded gradient, widened, to its float32 variables; the worker
receives exactly the bfloat16-rounded variables; nothing else changes.
"""

from __future__ import annotations

import re

import pytest
import torch

import psframe
from psframe.errors import DtypeMismatchError, WireFormatError
from psframe.ps.store import VariableStore
from psframe.wire import codec, transport
from psframe.wire import psframe_pb2 as pb
from tests.test_store_contract import GrpcBackend
from tests.test_trainer import loss_of, make_model

LR = 0.5


def test_wire_dtype_names():
    assert codec.wire_dtype_from_name("") is None
    assert codec.wire_dtype_from_name("bfloat16") is torch.bfloat16
    assert codec.wire_dtype_from_name("float16") is torch.float16
    for bad in ("float32", "int8", "bf16"):
        with pytest.raises(WireFormatError, match=r"expected one of \['bfloat16', 'float16'\]"):
            codec.wire_dtype_from_name(bad)


def test_to_wire_narrows_only_wider_floating_point():
    x = torch.tensor([1.0 + 2**-10, -3.0, 1e30])
    assert torch.equal(codec.to_wire(x, torch.bfloat16), x.bfloat16())
    assert codec.to_wire(x, None) is x
    ints = torch.arange(5)
    assert codec.to_wire(ints, torch.bfloat16) is ints
    half = torch.ones(3, dtype=torch.float16)
    assert codec.to_wire(half, torch.bfloat16) is half  # no wider than the wire dtype: as is
    assert codec.to_wire(x.double(), torch.float16).dtype == torch.float16


def test_store_widens_compressed_gradients_and_leaves_the_rest_for_its_checks():
    store = VariableStore()
    store.create({"w": torch.zeros(3), "n": torch.zeros(2, dtype=torch.float16)}, psframe.optim.SGD(lr=1.0))
    grads = {
        "w": torch.ones(3, dtype=torch.bfloat16),
        "n": torch.ones(2, dtype=torch.bfloat16),
        "x": torch.ones(1, dtype=torch.bfloat16),
    }
    widened = store.widen(grads, torch.bfloat16)
    assert widened["w"].dtype == torch.float32 and torch.equal(widened["w"], torch.ones(3))
    assert widened["n"] is grads["n"]  # a float16 variable is not wider: refused later, by apply
    assert widened["x"] is grads["x"]  # unknown: apply names it
    with pytest.raises(DtypeMismatchError):
        store.apply({"n": widened["n"]})


@pytest.fixture
def backend():
    backend = GrpcBackend()
    yield backend
    backend.close()


def _push_pull(backend: GrpcBackend, grads: dict[str, torch.Tensor], pull: list[str], wire_dtype: str):
    """One PushPull request as it travels, with any wire_dtype name (valid or not)."""
    header = pb.PushPullHeader(caller=backend.client.caller, pull=pull, end_of_step=True, wire_dtype=wire_dtype)
    watchdog = transport.Watchdog()
    with transport.Connection(backend.cluster.task_address("ps", 0)) as connection:
        stream = connection.open_stream("PushPull", watchdog)
        stream.send(codec.encode(header, list(grads.items())), 30.0)
        reply, tensors = codec.decode(stream.receive(), pb.PushPullReplyHeader)
        stream.close()
    watchdog.stop()
    if reply.error_class:
        raise psframe.errors.error_from_name(reply.error_class, reply.error_message)
    return dict(zip(pull, (t.clone() for t in tensors)))


def test_the_ps_applies_the_rounded_gradient_and_returns_rounded_values(backend):
    torch.manual_seed(0)
    start = torch.randn(64)
    backend.create({"w": start.clone(), "steps": torch.zeros(2, dtype=torch.int64)}, psframe.optim.SGD(lr=LR))
    grad = torch.randn(64)
    pulled = _push_pull(backend, {"w": grad.bfloat16()}, ["w", "steps"], "bfloat16")
    expected = start - LR * grad.bfloat16().float()  # what torch.optim.SGD computes in float32
    assert pulled["w"].dtype == torch.bfloat16 and torch.equal(pulled["w"], expected.bfloat16())
    assert pulled["steps"].dtype == torch.int64  # not floating point: as stored
    _, exact = backend.push_pull({}, ["w"])  # no wire dtype: the ps's float32 value, exactly
    assert exact["w"].dtype == torch.float32 and torch.equal(exact["w"], expected)


@pytest.mark.parametrize("wire_dtype, error", [("", DtypeMismatchError), ("int8", WireFormatError)])
def test_a_compressed_gradient_without_a_valid_wire_dtype_changes_nothing(backend, wire_dtype, error):
    start = torch.arange(4.0)
    backend.create({"w": start.clone()}, psframe.optim.SGD(lr=LR))
    with pytest.raises(error):
        _push_pull(backend, {"w": torch.ones(4, dtype=torch.bfloat16)}, ["w"], wire_dtype)
    step, values = backend.push_pull({}, ["w"], end_of_step=False)
    assert step == 0 and torch.equal(values["w"], start)


@pytest.mark.parametrize("wire_dtype", ["bfloat16", torch.float16])
def test_trainer_with_wire_dtype_matches_local_sgd_on_rounded_values(local_cluster, wire_dtype):
    wire = codec.WIRE_DTYPES[wire_dtype] if isinstance(wire_dtype, str) else wire_dtype
    cluster = local_cluster(num_ps=2, num_workers=1)
    model, reference = make_model(), make_model()
    ps_values = {n: p.detach().clone() for n, p in reference.named_parameters()}
    transport = psframe.Transport(wire_dtype=wire_dtype)
    with psframe.Trainer(model, cluster, optimizer=psframe.optim.SGD(lr=LR), transport=transport) as trainer:
        for step in range(3):
            trainer.step(loss_of(model, step))
            # The reference model holds what the worker should hold: the ps's
            # float32 values after an update with the rounded gradient, rounded.
            reference.zero_grad()
            loss_of(reference, step).backward()
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    ps_values[name] -= LR * p.grad.to(wire).float()
                    p.copy_(ps_values[name].to(wire).float())
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert p.dtype == torch.float32, name
                assert torch.equal(p, q), f"{name} differs at step {step}"
        trainer.pull()  # a pull travels uncompressed: the ps's exact values
        for name, p in model.named_parameters():
            assert torch.equal(p, ps_values[name]), name


@pytest.mark.parametrize("bad", ["int8", torch.int8, "fp16", 16])
def test_trainer_refuses_an_unknown_wire_dtype(bad):
    with pytest.raises(ValueError, match=rf"wire_dtype must be one of .* or None, got {re.escape(repr(bad))}$"):
        psframe.Trainer(
            make_model(),
            {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]},
            transport=psframe.Transport(wire_dtype=bad),
        )

"""Optional wire compression (``wire_dtype``): what is rounded, what is not.

The oracle: with ``wire_dtype="bfloat16"`` the ps applies exactly the
bfloat16-rounded gradient, widened, to its float32 variables; the worker
receives exactly the bfloat16-rounded variables; nothing else changes.

This file holds the unit tier's tests of the subject; `tests/service/test_wire_dtype.py` holds the
other tiers'.
"""

from __future__ import annotations

import re

import pytest
import torch

import psframe
from psframe.errors import DtypeMismatchError, WireFormatError
from psframe.ps.store import VariableStore
from psframe.wire import codec, dtypes, transport
from psframe.wire import psframe_pb2 as pb
from tests.service.test_store_contract import GrpcBackend
from tests.service.test_trainer import make_model

LR = 0.5


def test_wire_dtype_names():
    assert dtypes.wire_dtype_from_name("") is None
    assert dtypes.wire_dtype_from_name("bfloat16") is torch.bfloat16
    assert dtypes.wire_dtype_from_name("float16") is torch.float16
    for bad in ("float32", "int8", "bf16"):
        with pytest.raises(WireFormatError, match=r"expected one of \['bfloat16', 'float16'\]"):
            dtypes.wire_dtype_from_name(bad)


def test_to_wire_narrows_only_wider_floating_point():
    x = torch.tensor([1.0 + 2**-10, -3.0, 1e30])
    assert torch.equal(dtypes.to_wire(x, torch.bfloat16), x.bfloat16())
    assert dtypes.to_wire(x, None) is x
    ints = torch.arange(5)
    assert dtypes.to_wire(ints, torch.bfloat16) is ints
    half = torch.ones(3, dtype=torch.float16)
    assert dtypes.to_wire(half, torch.bfloat16) is half  # no wider than the wire dtype: as is
    assert dtypes.to_wire(x.double(), torch.float16).dtype == torch.float16


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


@pytest.mark.parametrize("bad", ["int8", torch.int8, "fp16", 16])
def test_trainer_refuses_an_unknown_wire_dtype(bad):
    with pytest.raises(ValueError, match=rf"wire_dtype must be one of .* or None, got {re.escape(repr(bad))}$"):
        psframe.Trainer(
            make_model(),
            {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]},
            transport=psframe.Transport(wire_dtype=bad),
        )

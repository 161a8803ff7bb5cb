"""Optional wire compression (``wire_dtype``): what is rounded, what is not.

The oracle: with ``wire_dtype="bfloat16"`` the ps applies exactly the
bfloat16-rounded gradient, widened, to its float32 variables; the worker
receives exactly the bfloat16-rounded variables; nothing else changes.

This file holds the service tier's tests of the subject; `tests/unit/test_wire_dtype.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.errors import DtypeMismatchError, WireFormatError
from psframe.wire import dtypes
from tests.service.test_trainer import loss_of, make_model
from tests.unit.test_wire_dtype import LR, _push_pull, backend  # noqa: F401


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
    wire = dtypes.WIRE_DTYPES[wire_dtype] if isinstance(wire_dtype, str) else wire_dtype
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

"""Unit tests for psframe.optim: optimizer specs by name and keyword arguments, checked up front.

This file holds the unit tier's tests of the subject; `tests/cluster/test_optim.py` holds the other
tiers'.
"""

from __future__ import annotations

import inspect
import logging
import math

import pytest
import torch

from psframe import optim
from psframe.errors import OptimizerConfigError, PsframeError
from psframe.optim import SUPPORTED, OptimizerSpec, kernels
from psframe.optim.ftrl import Ftrl
from psframe.optim.rows_kernels import SparseSGD
from psframe.optim.rowwise_adagrad import RowWiseAdagrad


def _param() -> torch.Tensor:
    return torch.zeros(2, requires_grad=True)


def test_supported_is_every_closure_free_torch_optimizer():
    assert set(SUPPORTED) == {
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "RMSprop",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "ASGD",
        "Rprop",
        "SparseAdam",
        "SparseSGD",  # psframe's own, for embedding tables
        "Ftrl",
        "RowWiseAdagrad",
    }
    assert "LBFGS" not in SUPPORTED  # its step() needs a closure only a worker has


@pytest.mark.parametrize("name", SUPPORTED)
def test_factory_per_optimizer(name):
    factory = getattr(optim, name)
    assert factory.__name__ == name
    spec = factory()
    assert isinstance(spec, OptimizerSpec)
    assert spec.name == name
    assert dict(spec.kwargs) == {}
    assert type(spec.build([_param()])) is kernels.optimizer_class(name)
    own = {"SparseSGD": SparseSGD, "Ftrl": Ftrl, "RowWiseAdagrad": RowWiseAdagrad}
    assert kernels.optimizer_class(name) is own.get(name, getattr(torch.optim, name, None))


def test_factory_keeps_kwargs_exactly():
    spec = optim.SGD(lr=0.5, momentum=0.9, nesterov=True, weight_decay=1e-4, dampening=0)
    assert spec.name == "SGD"
    assert dict(spec.kwargs) == {"lr": 0.5, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "dampening": 0}
    assert type(spec.kwargs["nesterov"]) is bool
    assert type(spec.kwargs["dampening"]) is int
    assert type(spec.kwargs["lr"]) is float
    assert spec == OptimizerSpec(
        "SGD", {"lr": 0.5, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4, "dampening": 0}
    )
    assert spec != optim.SGD(lr=0.5)
    assert spec != OptimizerSpec("Adam", {})


def test_repr_names_the_factory_call():
    assert repr(optim.Adam(lr=0.01, betas=(0.8, 0.99))) == "psframe.optim.Adam(lr=0.01, betas=(0.8, 0.99))"
    assert repr(optim.SGD()) == "psframe.optim.SGD()"


def test_spec_is_frozen():
    spec = optim.SGD(lr=0.1)
    with pytest.raises(AttributeError):
        spec.name = "Adam"  # type: ignore[misc]


def test_caller_dict_is_copied():
    kwargs = {"lr": 0.1}
    spec = OptimizerSpec("SGD", kwargs)
    kwargs["lr"] = -5.0
    assert spec.kwargs["lr"] == 0.1


@pytest.mark.parametrize(
    "factory, kwargs, cls, expected",
    [
        (
            optim.SGD,
            dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
            torch.optim.SGD,
            dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2, dampening=0),
        ),
        (
            optim.Adam,
            dict(lr=1e-3, betas=(0.8, 0.99), amsgrad=True),
            torch.optim.Adam,
            dict(lr=1e-3, betas=(0.8, 0.99), amsgrad=True),
        ),
        (optim.AdamW, dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
        (optim.Adagrad, dict(lr=0.05, lr_decay=0.01), torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01)),
        (
            optim.RMSprop,
            dict(alpha=0.9, centered=True, momentum=0.5),
            torch.optim.RMSprop,
            dict(alpha=0.9, centered=True, momentum=0.5),
        ),
    ],
)
def test_build_gives_the_torch_optimizer(factory, kwargs, cls, expected):
    p = _param()
    opt = factory(**kwargs).build([p])
    assert type(opt) is cls
    assert opt.param_groups[0]["params"][0] is p
    for key, value in expected.items():
        assert opt.param_groups[0][key] == value, key


def test_lists_become_tuples():
    spec = optim.Adam(betas=[0.8, 0.99])
    assert spec.kwargs["betas"] == (0.8, 0.99)
    assert type(spec.kwargs["betas"]) is tuple
    assert spec == optim.Adam(betas=(0.8, 0.99))
    assert spec.build([_param()]).param_groups[0]["betas"] == (0.8, 0.99)
    etas = optim.Rprop(etas=[0.4, 1.3], step_sizes=[1e-6, 50]).kwargs
    assert etas == {"etas": (0.4, 1.3), "step_sizes": (1e-6, 50)}
    assert type(etas["step_sizes"][1]) is int


# ------------------------------------------------------------------------- refusals


def test_unknown_name():
    with pytest.raises(OptimizerConfigError, match="'sgd'.*expected one of SGD, Adam"):
        OptimizerSpec("sgd")
    with pytest.raises(OptimizerConfigError, match="'LBFGS'"):
        OptimizerSpec("LBFGS")
    with pytest.raises(OptimizerConfigError, match="'Optimizer'"):
        OptimizerSpec("Optimizer")


def test_unknown_kwarg_names_it():
    with pytest.raises(OptimizerConfigError, match="momentun") as info:
        optim.SGD(lr=0.1, momentun=0.9)
    assert "torch.optim.SGD" in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.parametrize(
    "factory, kwargs, needle",
    [
        (optim.SGD, dict(lr=-1), "lr"),
        (optim.SGD, dict(lr=0.1, momentum=-0.5), "momentum"),
        (optim.Adam, dict(betas=(0.9, 1.5)), "betas"),
        (optim.Adam, dict(eps=-1e-8), "eps"),
        (optim.SGD, dict(lr=0.1, nesterov=True), "nesterov"),
        (optim.RMSprop, dict(alpha=-0.1), "alpha"),
    ],
)
def test_invalid_value_names_it(factory, kwargs, needle):
    with pytest.raises(OptimizerConfigError, match=needle) as info:
        factory(**kwargs)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "kwargs, key, kind",
    [
        (dict(lr=0.1, momentum=[torch.zeros(1), torch.ones(1)]), "momentum", "numbers only"),
        (dict(lr=0.1, momentum={"value": 0.9}), "momentum", "dict"),
        (dict(lr=torch.tensor(0.1)), "lr", "Tensor"),
        (dict(lr=0.1, fused=None), "fused", "NoneType"),  # named arguments left None are not sent
        (dict(lr=0.1, dampening=[[0.0]]), "dampening", "numbers only"),
        (dict(lr=0.1, weight_decay=(0.1, True)), "weight_decay", "numbers only"),
    ],
)
def test_non_wire_types_name_the_argument(kwargs, key, kind):
    with pytest.raises(OptimizerConfigError, match=kind) as info:
        optim.SGD(**kwargs)
    assert f"{key}=" in str(info.value)


def test_refusals_are_psframe_value_errors():
    for make in (lambda: OptimizerSpec("Nope"), lambda: optim.SGD(lr=-1), lambda: optim.SGD(lr=[{}])):
        with pytest.raises(PsframeError):
            make()
        with pytest.raises(ValueError):
            make()


def test_refusal_is_not_cached_as_acceptance():
    """The up-front check is memoised; a bad config after a good one (and again) still fails."""
    optim.SGD(lr=0.3)
    for _ in range(2):
        with pytest.raises(OptimizerConfigError):
            optim.SGD(lr=-0.3)
    assert optim.SGD(lr=0.3).kwargs == {"lr": 0.3}


@pytest.fixture
def fresh_foreach_decisions():
    """Forget the per-process foreach decisions before and after the test."""
    kernels._decide_foreach.cache_clear()
    yield
    kernels._decide_foreach.cache_clear()


# SparseAdam and SparseSGD: sparse gradients only; psframe's Ftrl and RowWiseAdagrad have no multi-tensor kernels
@pytest.mark.parametrize("name", [n for n in SUPPORTED if n not in kernels.OWN_OPTIMIZERS and n != "SparseAdam"])
def test_build_groups_small_variables_for_multi_tensor_kernels_with_the_same_results(name, monkeypatch):
    monkeypatch.setattr(kernels, "FOREACH_GROUP_BYTES", 64)  # 16 float32 values
    torch.manual_seed(0)
    shapes = [(3,), (4, 2), (5,), (40,), (2,), (6, 2), (100,)]  # the 40- and 100-value ones are large
    mine = [torch.randn(s, requires_grad=True) for s in shapes]
    reference = [p.detach().clone().requires_grad_() for p in mine]
    kwargs = {"lr": 0.01} if name != "SGD" else {"lr": 0.1, "momentum": 0.9}
    built = OptimizerSpec(name, kwargs).build(mine)
    groups = [([tuple(p.shape) for p in g["params"]], g["foreach"]) for g in built.param_groups]
    # Whatever the installed torch makes of this optimizer, the groups follow
    # the decision and the values are the per-parameter kernels' exactly.
    if kernels.foreach_same_results(getattr(torch.optim, name), kwargs, [torch.float32]):
        # In order, up to 64 bytes a group: 12 + 32 + 20 bytes, then 8 + 48; 160 and 400 bytes apart.
        assert groups == [([(3,), (4, 2), (5,)], True), ([(2,), (6, 2)], True), ([(40,), (100,)], False)]
    else:
        assert groups == [(shapes, False)]
    local = getattr(torch.optim, name)(reference, **kwargs)  # torch's default kernels on CPU
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(mine, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        built.step()
        local.step()
    for p, q in zip(mine, reference):
        assert torch.equal(p, q), f"{name}: {tuple(p.shape)} differs"


class _OneUlpOff(torch.optim.SGD):
    """SGD whose multi-tensor groups end one float32 step (ulp) away from its per-parameter ones."""

    def step(self, closure=None):
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                if group["foreach"]:
                    for p in group["params"]:
                        p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))
        return loss


class _NoMultiTensorKernels(torch.optim.SGD):
    """SGD whose multi-tensor path fails, as for arguments or dtypes it does not support."""

    def step(self, closure=None):
        if any(group["foreach"] for group in self.param_groups):
            raise RuntimeError("no multi-tensor kernel for this")
        return super().step(closure)


def test_foreach_decision_holds_where_the_kernels_agree(fresh_foreach_decisions, caplog):
    # Plain SGD's multi-tensor step is the same single add as its per-parameter one.
    with caplog.at_level(logging.DEBUG, logger="psframe.optim.kernels"):
        assert kernels.foreach_same_results(torch.optim.SGD, {"lr": 0.1}) is True
    assert "SGD(lr=0.1) on torch.float32: multi-tensor kernels give the same bits" in caplog.text
    assert torch.__version__ in caplog.text


def test_foreach_decision_fails_on_one_ulp(fresh_foreach_decisions, caplog):
    with caplog.at_level(logging.INFO, logger="psframe.optim.kernels"):
        assert kernels.foreach_same_results(_OneUlpOff, {"lr": 0.1}) is False
    assert "_OneUlpOff(lr=0.1) on torch.float32: no multi-tensor groups" in caplog.text
    assert "differ after" in caplog.text and "torch.float32 tensor" in caplog.text


def test_foreach_decision_fails_when_the_check_cannot_run(fresh_foreach_decisions, caplog):
    with caplog.at_level(logging.INFO, logger="psframe.optim.kernels"):
        assert kernels.foreach_same_results(_NoMultiTensorKernels, {"lr": 0.1}) is False
    assert "could not be compared (RuntimeError: no multi-tensor kernel for this)" in caplog.text


def test_build_falls_back_to_per_parameter_groups_when_the_check_fails(fresh_foreach_decisions, monkeypatch):
    monkeypatch.setattr(kernels, "FOREACH_GROUP_BYTES", 64)
    monkeypatch.setattr(kernels, "_same_bits", lambda a, b: False)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(100, requires_grad=True)]
    built = optim.SGD(lr=0.1).build(params)
    assert [(len(g["params"]), g["foreach"]) for g in built.param_groups] == [(2, False)]


def test_build_groups_when_the_check_passes(fresh_foreach_decisions, monkeypatch):
    monkeypatch.setattr(kernels, "FOREACH_GROUP_BYTES", 64)
    monkeypatch.setattr(kernels, "_same_bits", lambda a, b: True)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(100, requires_grad=True)]
    built = optim.NAdam(lr=0.1).build(params)
    assert [(len(g["params"]), g["foreach"]) for g in built.param_groups] == [(1, True), (1, False)]


def test_foreach_decision_is_made_once_per_optimizer_arguments_and_dtypes(fresh_foreach_decisions, monkeypatch):
    calls = []
    check = kernels._foreach_difference
    monkeypatch.setattr(kernels, "_foreach_difference", lambda *args: calls.append(args) or check(*args))
    for _ in range(3):
        kernels.foreach_same_results(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
        kernels.foreach_same_results(torch.optim.SGD, {"momentum": 0.9, "lr": 0.1}, [torch.float32, torch.float32])
    assert len(calls) == 1
    kernels.foreach_same_results(torch.optim.SGD, {"lr": 0.2, "momentum": 0.9})
    kernels.foreach_same_results(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, [torch.float64])
    assert len(calls) == 3


def test_foreach_decision_checks_the_variables_dtypes(fresh_foreach_decisions, monkeypatch):
    seen = []
    monkeypatch.setattr(kernels, "_foreach_difference", lambda cls, kwargs, dtypes: seen.append(dtypes))
    params = [
        torch.zeros(3, requires_grad=True),
        torch.zeros(2, dtype=torch.float64, requires_grad=True),
        torch.zeros(4, dtype=torch.int64),
    ]  # an int variable is never updated
    optim.Adam(lr=0.1).build(params)
    assert seen == [(torch.float32, torch.float64)]


def test_foreach_decision_leaves_the_global_random_state_alone(fresh_foreach_decisions):
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    kernels.foreach_same_results(torch.optim.Adam, {"lr": 0.1})
    assert torch.equal(torch.rand(4), expected)


def test_build_keeps_an_explicit_foreach(monkeypatch):
    monkeypatch.setattr(kernels, "FOREACH_GROUP_BYTES", 64)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(100, requires_grad=True)]
    built = optim.Adam(lr=0.1, foreach=True).build(params)
    assert len(built.param_groups) == 1 and built.param_groups[0]["foreach"] is True


# ------------------------------------------------------------ kernels.step


def _stepped_twice(step_function, hook=None) -> tuple[list[torch.Tensor], list[str]]:
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    optimizer = torch.optim.Adam(params, lr=0.1)
    calls: list[str] = []
    if hook:
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for i in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.5 + i)
        step_function(optimizer)
    return [p.detach().clone() for p in params], calls


def test_step_gives_the_bits_optimizer_step_gives():
    ours, _ = _stepped_twice(kernels.step)
    theirs, _ = _stepped_twice(lambda o: o.step())
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_step_runs_the_hooks_registered_on_an_optimizer():
    _, calls = _stepped_twice(kernels.step, hook=True)
    assert calls == ["pre", "post"] * 2


def test_step_opens_the_profiler_range_when_a_profiler_runs():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _stepped_twice(kernels.step)
    names = {event.name for event in prof.events()}
    assert "Optimizer.step#Adam.step" in names


# ------------------------------------------------------------ the factories' signatures


@pytest.mark.parametrize("name", SUPPORTED)
def test_factories_name_the_optimizers_own_arguments(name):
    named = [p.name for p in inspect.signature(getattr(optim, name)).parameters.values() if p.kind is p.KEYWORD_ONLY]
    accepted = inspect.signature(kernels.optimizer_class(name).__init__).parameters
    assert "lr" in named and named[-1] == "schedule"  # psframe's own: the learning-rate schedule
    assert [n for n in named[:-1] if n not in accepted] == []


def test_arguments_left_none_are_not_sent():
    spec = optim.Adam(lr=0.1, betas=None, amsgrad=True)
    assert dict(spec.kwargs) == {"lr": 0.1, "amsgrad": True}
    assert optim.SGD().kwargs == {}


def test_other_arguments_of_the_installed_torch_pass_through():
    assert dict(optim.Adam(lr=0.1, capturable=False).kwargs) == {"lr": 0.1, "capturable": False}
    with pytest.raises(OptimizerConfigError, match="capturabel"):
        optim.Adam(lr=0.1, capturabel=False)

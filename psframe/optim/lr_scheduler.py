"""Learning-rate schedules the ps tasks apply, named the way ``torch.optim.lr_scheduler`` names them.

A schedule is given with the optimizer it drives, and runs where that
optimizer runs, on every ps task, by global step::

    optimizer = psframe.optim.SGD(
        lr=0.1, momentum=0.9, schedule=psframe.optim.lr_scheduler.StepLR(step_size=1000, gamma=0.5)
    )

The update that takes the global step from ``k`` to ``k + 1`` uses the
learning rate torch's scheduler gives after ``k`` calls of its ``step()``:
the loop ``optimizer.step(); scheduler.step()`` of one process, with one
iteration per global step (one per applied push in asynchronous training,
one per round in synchronous training). The embedding tables' optimizer
follows the schedule of the optimizer it is the row-by-row form of; a
``table_optimizer`` given to the trainer takes its own ``schedule=``.
``ReduceLROnPlateau`` is stepped by a metric the chief reports instead
(``Trainer.report_metric``).

Like optimizers, schedules travel by class name and keyword arguments, and
are checked on the worker, up front, by building the real torch scheduler
over a dummy optimizer. ``LambdaLR`` and ``MultiplicativeLR`` take a
function the ps tasks can import by name: one defined at the top level of
a module (the training script itself, when the ps tasks run it too), or a
``functools.partial`` of one with numbers, strings or tuples as arguments.
A lambda or a nested function cannot travel, and is refused. How a ps task
runs a schedule is :mod:`psframe.optim.schedule_clock`.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from psframe.errors import OptimizerConfigError
from psframe.optim import kernels

# torch.optim.lr_scheduler classes a ps can run. CyclicLR takes its ``mode``, not a scale_fn.
SUPPORTED = (
    "LambdaLR",
    "MultiplicativeLR",
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "SequentialLR",
    "PolynomialLR",
    "CosineAnnealingLR",
    "ChainedScheduler",
    "ReduceLROnPlateau",
    "CyclicLR",
    "CosineAnnealingWarmRestarts",
    "OneCycleLR",
)
WITH_FUNCTION = ("LambdaLR", "MultiplicativeLR")  # their lr_lambda: a FunctionRef
WITH_SCHEDULERS = ("SequentialLR", "ChainedScheduler")  # their schedulers: ScheduleSpecs
# Arguments psframe sets itself: the optimizer and where the schedule starts (the global step).
_NOT_GIVEN = ("optimizer", "last_epoch", "verbose", "lr_lambda", "schedulers", "scale_fn")
# What a schedule is checked over on its own, before it meets its optimizer: one with momentum.
_CHECK_OPTIMIZER = ("SGD", {"lr": 0.1, "momentum": 0.9})

ArgValue = float | int | bool | str | tuple[float, ...] | tuple[int, ...]


def _plain(where: str, key: str, value: Any) -> ArgValue:
    """``value`` as it can travel: a number, bool or string, or a tuple of numbers (from a list)."""
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return value
        raise OptimizerConfigError(f"{where}({key}={value!r}): tuples may hold numbers only")
    if isinstance(value, (bool, int, float, str)):
        return value
    raise OptimizerConfigError(
        f"{where}({key}={value!r}): expected a number, bool, string or tuple of numbers, got {type(value).__name__}"
    )


@dataclass(frozen=True)
class FunctionRef:
    """A function the ps tasks import by name, with arguments bound to it (a ``functools.partial``).

    Args:
        path: ``"module:qualname"``, e.g. ``"train:warmup_factor"``.
        args: positional arguments given before the step (numbers, bools, strings, tuples of numbers).
        kwargs: keyword arguments given with them (the same kinds).
    """

    path: str
    args: tuple[ArgValue, ...] = ()
    kwargs: Mapping[str, ArgValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, _, qualname = self.path.partition(":")
        if not module or not qualname:
            raise OptimizerConfigError(f"a function travels as 'module:qualname', got {self.path!r}")
        object.__setattr__(self, "args", tuple(_plain(self.path, str(i), v) for i, v in enumerate(self.args)))
        object.__setattr__(self, "kwargs", {k: _plain(self.path, k, v) for k, v in self.kwargs.items()})

    @classmethod
    def of(cls, function: Any, where: str) -> FunctionRef:
        """The reference of ``function``: a ``"module:qualname"`` string, a function importable by
        its name, or a ``functools.partial`` of one.

        Raises:
            OptimizerConfigError: it cannot travel (a lambda, a nested function, a bound method,
                a partial with other arguments), naming what to do instead.
        """
        if isinstance(function, FunctionRef):
            return function
        if isinstance(function, str):
            return cls(function)
        args: tuple = ()
        kwargs: dict = {}
        if isinstance(function, functools.partial):
            function, args, kwargs = function.func, function.args, dict(function.keywords)
        module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
        if callable(function) and module and qualname and _lookup(module, qualname) is function:
            return cls(f"{module}:{qualname}", args, kwargs)
        raise OptimizerConfigError(
            f"{where}(lr_lambda={function!r}): the ps tasks call the function by its name, so it must be "
            f"defined at the top level of a module they can import (the training script, when they run it "
            f"too), e.g. `def warmup(step): return min(1.0, (step + 1) / 100)`; a functools.partial of one, "
            f"with numbers, strings or tuples as arguments, travels too; a lambda or a nested function cannot"
        )

    def resolve(self) -> Callable[[int], float]:
        """The function, imported by name (with its arguments bound).

        Raises:
            OptimizerConfigError: it cannot be imported here.
        """
        module, _, qualname = self.path.partition(":")
        try:
            function = _lookup(module, qualname, strict=True)
        except (ImportError, AttributeError) as e:
            raise OptimizerConfigError(
                f"cannot import the schedule's function {self.path!r} here: {e} (define it at the top level of "
                f"a module both the workers and the ps tasks import)"
            ) from e
        if not callable(function):
            raise OptimizerConfigError(f"the schedule's function {self.path!r} is a {type(function).__name__}")
        return functools.partial(function, *self.args, **self.kwargs) if self.args or self.kwargs else function

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "args": list(self.args), "kwargs": dict(self.kwargs)}


def _lookup(module: str, qualname: str, *, strict: bool = False) -> Any:
    """``module.qualname``, importing the module (``__main__``: this program); None if absent (unless ``strict``)."""
    try:
        found: Any = sys.modules["__main__"] if module == "__main__" else importlib.import_module(module)
        for name in qualname.split("."):
            found = getattr(found, name)
        return found
    except (ImportError, AttributeError, KeyError):
        if strict:
            raise
        return None


@dataclass(frozen=True)
class ScheduleSpec:
    """A ``torch.optim.lr_scheduler`` class by name, with its keyword arguments.

    Args:
        name: the class name (one of :data:`SUPPORTED`).
        kwargs: keyword arguments of its constructor other than the optimizer, ``last_epoch``
            and those below; numbers, bools, strings and tuples of numbers only.
        schedulers: ``SequentialLR``'s and ``ChainedScheduler``'s schedules, in order.
        function: ``LambdaLR``'s and ``MultiplicativeLR``'s ``lr_lambda``.

    Raises:
        OptimizerConfigError: an unknown name, or arguments torch refuses.
    """

    name: str
    kwargs: Mapping[str, ArgValue] = field(default_factory=dict)
    schedulers: tuple[ScheduleSpec, ...] = ()
    function: FunctionRef | None = None

    def __post_init__(self) -> None:
        if self.name not in SUPPORTED:
            raise OptimizerConfigError(f"unknown schedule {self.name!r}; expected one of {', '.join(SUPPORTED)}")
        taken = sorted(set(self.kwargs) & set(_NOT_GIVEN))
        if taken:
            raise OptimizerConfigError(f"{self.name}({', '.join(taken)}=...): psframe sets these itself")
        object.__setattr__(self, "kwargs", {k: _plain(self.name, k, v) for k, v in self.kwargs.items()})
        object.__setattr__(self, "schedulers", tuple(self.schedulers))
        if (self.function is None) == (self.name in WITH_FUNCTION):
            wanted = "needs its lr_lambda" if self.function is None else "takes no function (lr_lambda)"
            raise OptimizerConfigError(f"{self.name} {wanted}")
        if bool(self.schedulers) != (self.name in WITH_SCHEDULERS):
            raise OptimizerConfigError(
                f"{self.name} {'takes no schedulers' if self.schedulers else 'needs schedulers'}"
            )
        for child in self.schedulers:
            if not isinstance(child, ScheduleSpec) or child.plateau:
                raise OptimizerConfigError(
                    f"{self.name} chains psframe.optim.lr_scheduler schedules stepped by the global step, got {child!r}"
                )
        check(self, *_CHECK_OPTIMIZER, resolve=False)

    @property
    def plateau(self) -> bool:
        """Whether a metric steps it (``ReduceLROnPlateau``), not the global step."""
        return self.name == "ReduceLROnPlateau"

    @property
    def calls_functions(self) -> bool:
        """Whether it (or a schedule it chains) calls a function imported by name."""
        return self.function is not None or any(s.calls_functions for s in self.schedulers)

    def to_dict(self) -> dict[str, Any]:
        """The spec as builtins (for checkpoints and JSON); :meth:`from_dict` reads it back."""
        return {
            "name": self.name,
            "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs.items()},
            "schedulers": [s.to_dict() for s in self.schedulers],
            "function": None if self.function is None else self.function.to_dict(),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ScheduleSpec:
        """The spec :meth:`to_dict` gave (checked again).

        Raises:
            OptimizerConfigError: not such a dict, or a spec torch refuses.
        """
        try:
            function = obj.get("function")
            return cls(
                obj["name"],
                dict(obj.get("kwargs") or {}),
                tuple(cls.from_dict(s) for s in obj.get("schedulers") or ()),
                None if function is None else FunctionRef(function["path"], function["args"], function["kwargs"]),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise OptimizerConfigError(f"not a schedule: {obj!r} ({type(e).__name__}: {e})") from e

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.kwargs.items()]
        if self.function is not None:
            args.insert(0, f"lr_lambda={self.function.path!r}")
        if self.schedulers:
            args.insert(0, f"schedulers={list(self.schedulers)!r}")
        return f"psframe.optim.lr_scheduler.{self.name}({', '.join(args)})"


def build(
    spec: ScheduleSpec, optimizer: torch.optim.Optimizer, *, resolve: bool = True
) -> torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau:
    """The torch scheduler of ``spec`` over ``optimizer``, built as a user would: a chain's
    schedules first, in order, then the chain. ``resolve``: import the functions (else a
    stand-in that keeps the learning rate, to check the other arguments without importing).

    Raises:
        OptimizerConfigError: a function cannot be imported.
        TypeError, ValueError: torch refused the arguments (its own exception).
    """
    cls = getattr(torch.optim.lr_scheduler, spec.name)
    kwargs: dict[str, Any] = dict(spec.kwargs)
    if spec.function is not None:
        kwargs["lr_lambda"] = spec.function.resolve() if resolve else _keep
    if spec.name == "ChainedScheduler":
        return cls([build(s, optimizer, resolve=resolve) for s in spec.schedulers], optimizer=optimizer)
    if spec.name == "SequentialLR":
        kwargs["schedulers"] = [build(s, optimizer, resolve=resolve) for s in spec.schedulers]
    return cls(optimizer, **kwargs)


def _keep(step: int) -> float:
    return 1.0


def check(spec: ScheduleSpec, optimizer: str, kwargs: Mapping[str, Any], *, resolve: bool = True) -> None:
    """Build ``spec`` over a dummy ``torch.optim.<optimizer>(**kwargs)`` and step it once.

    Raises:
        OptimizerConfigError: torch refused it, naming the schedule and the optimizer.
    """
    probe = kernels.probe(optimizer, kwargs)
    probe._opt_called = True  # type: ignore[attr-defined]  # never stepped: no warning that it was not
    try:
        scheduler: Any = build(spec, probe, resolve=resolve)
        scheduler.step(0.0) if spec.plateau else scheduler.step()
    except OptimizerConfigError:
        raise
    except Exception as e:  # torch's own refusal, of any type, said with the spec
        raise OptimizerConfigError(f"torch refused {spec!r} over torch.optim.{optimizer}({kwargs}): {e}") from e


# ---- the factories: torch.optim.lr_scheduler's classes and arguments, less the optimizer and
# last_epoch. An argument left None is not sent: torch's default applies.


def _spec(name: str, arguments: dict[str, Any], **parts: Any) -> ScheduleSpec:
    return ScheduleSpec(name, {k: v for k, v in arguments.items() if v is not None}, **parts)


def LambdaLR(*, lr_lambda: Callable[[int], float] | str) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.LambdaLR``: the optimizer's ``lr`` times ``lr_lambda(global_step)``.

    Args:
        lr_lambda: a function importable by name on the ps tasks (see the module), or a
            ``functools.partial`` of one, or its ``"module:qualname"``.

    Raises:
        OptimizerConfigError: the function cannot travel, or fails at step 0.
    """
    spec = ScheduleSpec("LambdaLR", function=FunctionRef.of(lr_lambda, "LambdaLR"))
    check(spec, *_CHECK_OPTIMIZER)  # the function itself, at step 0
    return spec


def MultiplicativeLR(*, lr_lambda: Callable[[int], float] | str) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.MultiplicativeLR``: the rate times ``lr_lambda(global_step)`` at each step
    (see :func:`LambdaLR` for the function)."""
    spec = ScheduleSpec("MultiplicativeLR", function=FunctionRef.of(lr_lambda, "MultiplicativeLR"))
    check(spec, *_CHECK_OPTIMIZER)
    return spec


def StepLR(*, step_size: int, gamma: float | None = None) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.StepLR``: times ``gamma`` every ``step_size`` global steps
    (TF's ``exponential_decay(..., staircase=True)``)."""
    return _spec("StepLR", {"step_size": step_size, "gamma": gamma})


def MultiStepLR(*, milestones: tuple[int, ...] | list[int], gamma: float | None = None) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.MultiStepLR``: times ``gamma`` at each global step of ``milestones``."""
    return _spec("MultiStepLR", {"milestones": tuple(milestones), "gamma": gamma})


def ConstantLR(*, factor: float | None = None, total_iters: int | None = None) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.ConstantLR``: times ``factor`` until global step ``total_iters``."""
    return _spec("ConstantLR", {"factor": factor, "total_iters": total_iters})


def LinearLR(
    *, start_factor: float | None = None, end_factor: float | None = None, total_iters: int | None = None
) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.LinearLR``: a linear ramp of the factor over ``total_iters`` global steps
    (a warm-up)."""
    return _spec("LinearLR", {"start_factor": start_factor, "end_factor": end_factor, "total_iters": total_iters})


def ExponentialLR(*, gamma: float) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.ExponentialLR``: times ``gamma`` at every global step."""
    return _spec("ExponentialLR", {"gamma": gamma})


def SequentialLR(*, schedulers: list[ScheduleSpec], milestones: tuple[int, ...] | list[int]) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[i]`` from global step ``milestones[i - 1]`` on
    (a warm-up, then a decay)."""
    return ScheduleSpec("SequentialLR", {"milestones": tuple(milestones)}, schedulers=tuple(schedulers))


def ChainedScheduler(*, schedulers: list[ScheduleSpec]) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.ChainedScheduler``: every one of ``schedulers`` at every global step."""
    return ScheduleSpec("ChainedScheduler", schedulers=tuple(schedulers))


def PolynomialLR(*, total_iters: int | None = None, power: float | None = None) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.PolynomialLR``: a polynomial decay to 0 over ``total_iters`` global steps."""
    return _spec("PolynomialLR", {"total_iters": total_iters, "power": power})


def CosineAnnealingLR(*, T_max: int, eta_min: float | None = None) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.CosineAnnealingLR``: a cosine from ``lr`` to ``eta_min`` over ``T_max``
    global steps."""
    return _spec("CosineAnnealingLR", {"T_max": T_max, "eta_min": eta_min})


def CosineAnnealingWarmRestarts(
    *,
    T_0: int,
    T_mult: int | None = None,
    eta_min: float | None = None,
) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``: cosines restarted every ``T_0`` (times ``T_mult``)
    global steps."""
    return _spec("CosineAnnealingWarmRestarts", {"T_0": T_0, "T_mult": T_mult, "eta_min": eta_min})


def CyclicLR(
    *,
    base_lr: float,
    max_lr: float,
    step_size_up: int | None = None,
    step_size_down: int | None = None,
    mode: str | None = None,
    gamma: float | None = None,
    scale_mode: str | None = None,
    cycle_momentum: bool | None = None,
    base_momentum: float | None = None,
    max_momentum: float | None = None,
) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.CyclicLR`` (with its ``mode``; a ``scale_fn`` cannot travel)."""
    return _spec("CyclicLR", locals())


def OneCycleLR(
    *,
    max_lr: float,
    total_steps: int | None = None,
    epochs: int | None = None,
    steps_per_epoch: int | None = None,
    pct_start: float | None = None,
    anneal_strategy: str | None = None,
    cycle_momentum: bool | None = None,
    base_momentum: float | None = None,
    max_momentum: float | None = None,
    div_factor: float | None = None,
    final_div_factor: float | None = None,
    three_phase: bool | None = None,
) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.OneCycleLR``, over ``total_steps`` global steps (with ``cycle_momentum``,
    the optimizer's momentum or Adam's first beta cycles too)."""
    return _spec("OneCycleLR", locals())


def ReduceLROnPlateau(
    *,
    mode: str | None = None,
    factor: float | None = None,
    patience: int | None = None,
    threshold: float | None = None,
    threshold_mode: str | None = None,
    cooldown: int | None = None,
    min_lr: float | None = None,
    eps: float | None = None,
) -> ScheduleSpec:
    """``torch.optim.lr_scheduler.ReduceLROnPlateau``, stepped by the metric the chief reports
    (``Trainer.report_metric(value)``), on every ps task, not by the global step."""
    return _spec("ReduceLROnPlateau", locals())


__all__ = ["ScheduleSpec", "FunctionRef", "SUPPORTED", *SUPPORTED]

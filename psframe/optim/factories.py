"""The factories of :mod:`psframe.optim`: one per optimizer a ps task runs, named as its class.

Each returns an :class:`~psframe.optim.OptimizerSpec` (the optimizer's name and
keyword arguments) for ``psframe.Trainer``; ``psframe.optim`` exports them all.
Most name ``torch.optim``'s classes; ``SparseSGD``, ``Ftrl`` and
``RowWiseAdagrad`` name psframe's own (:mod:`psframe.optim.rows_kernels`,
:mod:`psframe.optim.ftrl`, :mod:`psframe.optim.rowwise_adagrad`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psframe.optim.lr_scheduler import ScheduleSpec

if TYPE_CHECKING:  # psframe.optim imports this module: its names are imported for their types only
    from psframe.optim import KwargValue, OptimizerSpec

# The factories below name torch.optim's arguments so that editors and the
# API reference show them. An argument left None is not sent: the ps builds
# the optimizer with torch.optim's default for it. ``**more`` passes any other
# keyword argument of the installed torch's optimizer (checked like the rest);
# ``schedule`` is the learning-rate schedule (psframe.optim.lr_scheduler).


def _spec(name: str, arguments: dict[str, Any]) -> OptimizerSpec:
    """The spec of a factory's arguments: those given, plus its ``more``, and its schedule."""
    from psframe.optim import OptimizerSpec  # here: psframe.optim imports this module while it is made

    more, schedule = arguments.pop("more"), arguments.pop("schedule")
    return OptimizerSpec(name, {**{k: v for k, v in arguments.items() if v is not None}, **more}, schedule)


def SGD(
    *,
    lr: float | None = None,
    momentum: float | None = None,
    dampening: float | None = None,
    weight_decay: float | None = None,
    nesterov: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.SGD`` on the ps tasks.

    Arguments are ``torch.optim.SGD``'s; one left None takes torch's default.
    ``schedule``: a learning-rate schedule of :mod:`psframe.optim.lr_scheduler`, e.g.
    ``StepLR(step_size=1000, gamma=0.5)``, applied on the ps tasks by global step.

    Returns:
        An :class:`OptimizerSpec` to pass to ``psframe.Trainer``.

    Raises:
        OptimizerConfigError: torch.optim.SGD refuses the arguments (or torch the schedule).
    """
    return _spec("SGD", locals())


def Adam(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    amsgrad: bool | None = None,
    decoupled_weight_decay: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.Adam`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("Adam", locals())


def AdamW(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    amsgrad: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.AdamW`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("AdamW", locals())


def Adagrad(
    *,
    lr: float | None = None,
    lr_decay: float | None = None,
    weight_decay: float | None = None,
    initial_accumulator_value: float | None = None,
    eps: float | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.Adagrad`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("Adagrad", locals())


def RMSprop(
    *,
    lr: float | None = None,
    alpha: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    momentum: float | None = None,
    centered: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.RMSprop`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("RMSprop", locals())


def Adadelta(
    *,
    lr: float | None = None,
    rho: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.Adadelta`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("Adadelta", locals())


def Adamax(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.Adamax`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("Adamax", locals())


def NAdam(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    momentum_decay: float | None = None,
    decoupled_weight_decay: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.NAdam`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("NAdam", locals())


def RAdam(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    decoupled_weight_decay: bool | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.RAdam`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("RAdam", locals())


def ASGD(
    *,
    lr: float | None = None,
    lambd: float | None = None,
    alpha: float | None = None,
    t0: float | None = None,
    weight_decay: float | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.ASGD`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("ASGD", locals())


def Rprop(
    *,
    lr: float | None = None,
    etas: tuple[float, float] | None = None,
    step_sizes: tuple[float, float] | None = None,
    maximize: bool | None = None,
    foreach: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.Rprop`` on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("Rprop", locals())


def SparseAdam(
    *,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    maximize: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run ``torch.optim.SparseAdam`` on the ps tasks, for embedding tables
    (see :func:`SGD` for the arguments' rules)."""
    return _spec("SparseAdam", locals())


def SparseSGD(
    *,
    lr: float | None = None,
    momentum: float | None = None,
    nesterov: bool | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run :class:`psframe.optim.rows_kernels.SparseSGD` (SGD with lazy momentum, for embedding
    tables) on the ps tasks (see :func:`SGD` for the arguments' rules)."""
    return _spec("SparseSGD", locals())


def Ftrl(
    *,
    lr: float | None = None,
    lr_power: float | None = None,
    initial_accumulator_value: float | None = None,
    l1: float | None = None,
    l2: float | None = None,
    l2_shrinkage: float | None = None,
    beta: float | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run :class:`psframe.optim.ftrl.Ftrl` (FTRL-Proximal as TensorFlow's ``FtrlOptimizer``, for
    embedding tables and dense variables alike) on the ps tasks (see :func:`SGD` for the arguments' rules;
    one left None takes ``Ftrl``'s default: ``lr=1e-3, lr_power=-0.5, initial_accumulator_value=0.1``,
    no regularization)."""
    return _spec("Ftrl", locals())


def RowWiseAdagrad(
    *,
    lr: float | None = None,
    eps: float | None = None,
    initial_accumulator_value: float | None = None,
    weight_decay: float | None = None,
    schedule: ScheduleSpec | None = None,
    **more: KwargValue,
) -> OptimizerSpec:
    """Run :class:`psframe.optim.rowwise_adagrad.RowWiseAdagrad` (Adagrad with one accumulator per
    row, as FBGEMM's, for embedding tables; ``weight_decay``: FBGEMM's L2 decay) on the ps tasks (see
    :func:`SGD` for the arguments' rules; one left None takes its default: ``lr=1e-2, eps=1e-10,
    initial_accumulator_value=0, weight_decay=0``)."""
    return _spec("RowWiseAdagrad", locals())

"""How a ps task runs ``torch.optim`` optimizers: fast, and with torch's own results.

Three things that :mod:`psframe.optim`'s specs leave to this module:

* :func:`build`: the optimizer over a ps task's variables, with small
  variables in multi-tensor ("foreach") groups wherever the installed torch's
  multi-tensor kernels give the same bits as its per-parameter ones
  (:func:`foreach_same_results` decides, once per process);
* :func:`step`: ``optimizer.step()`` without torch's profiler and hook wrapper
  when nothing uses it (a ps steps thousands of times a second), and an
  embedding table's Adagrad step by gathers and scatters of its rows where
  that gives torch's bits (:func:`psframe.optim.rows_kernels.adagrad_rows_step`);
* :func:`check_arguments`: the arguments tried on a dummy parameter, so a
  worker finds a typo before any task is contacted, without the import of
  ``torch._dynamo`` that a first step would pay.

They reach below torch.optim's public API (``step.__wrapped__``, the hook
dictionaries, ``add_param_group.__wrapped__``), each with a fallback to the
plain call where the installed torch lacks what they look for.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from psframe.optim import rows_kernels
from psframe.optim.ftrl import Ftrl
from psframe.optim.rowwise_adagrad import RowWiseAdagrad

log = logging.getLogger(__name__)

# Variables up to this size share multi-tensor optimizer kernels, in groups
# of at most this many bytes (see build).
FOREACH_GROUP_BYTES = 4 << 20

# Whether an optimizer's multi-tensor ("foreach") kernels give the same bits
# as its per-parameter ones depends on the torch release, the optimizer, its
# arguments and the dtype. On torch 2.13, NAdam's differ on most float32
# tensors of more than a few values (tensors of a dozen values may agree),
# RAdam's and ASGD's differ, and in float16 or bfloat16 most optimizers' do
# (their multi-tensor kernels round intermediate results differently); on
# torch 2.11, NAdam's differ even on a dozen values. So no list is kept: the
# first build of each optimizer, arguments and dtypes in a process steps both
# kernels on these shapes and compares the bits (see foreach_same_results).
# The 33,153 values of the last shape catch differences as rare as about one
# value in 10^4 (Adadelta's in bfloat16); rarer ones could pass unseen, the
# shapes being a sample.
_CHECK_SHAPES = ((3,), (5, 7), (67,), (129, 257))
_CHECK_STEPS = 5


# psframe's own optimizer classes by name, beside torch.optim's (names in neither are unknown).
OWN_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "SparseSGD": rows_kernels.SparseSGD,
    "Ftrl": Ftrl,
    "RowWiseAdagrad": RowWiseAdagrad,
}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class of a name in :data:`SUPPORTED`: psframe's own (:data:`OWN_OPTIMIZERS`), or torch.optim's."""
    own = OWN_OPTIMIZERS.get(name)
    return own if own is not None else getattr(torch.optim, name)


def qualified_name(name: str) -> str:
    """How messages name optimizer ``name``: ``torch.optim.Adam``, or ``psframe.optim.Ftrl`` for psframe's own."""
    return f"psframe.optim.{name}" if name in OWN_OPTIMIZERS else f"torch.optim.{name}"


def step(optimizer: torch.optim.Optimizer, *, rows: bool = False) -> None:
    """``optimizer.step()``, without the profiler range and hook dispatch around it when nothing uses them.

    torch.optim wraps every optimizer class's ``step`` in a function that
    opens a profiler range and runs the step hooks. On a ps task, which
    steps once per push, thousands of times a second on small models, that
    wrapper costs about a fifth of a step of the MNIST MLP's four variables.
    With no profiler running and no step hook registered (psframe registers
    none, and a ps task's optimizers are its own), the wrapper does nothing
    but call the step, so the step is called directly; with a profiler or a
    hook, or a torch without the wrapper, ``optimizer.step()`` is.

    An embedding table's Adagrad step (``rows``: sparse gradients) is taken by
    :func:`psframe.optim.rows_kernels.adagrad_rows_step` where it gives torch's
    bits: a third of the time of torch's on rows of 8 floats. A dense step
    (``rows`` False) never looks for it.
    """
    unwrapped = getattr(type(optimizer).step, "__wrapped__", None)
    if unwrapped is None or _watched(optimizer):
        optimizer.step()
    elif not (rows and rows_kernels.adagrad_rows_step(optimizer)):
        unwrapped(optimizer)


def step_rows(
    optimizer: torch.optim.Optimizer, work: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> bool:
    """A table optimizer's step on pushed rows, ``(table, ids, gradient rows)``, taken on them
    directly where :func:`step` would take it with the row kernel and nothing watches the step
    (:func:`psframe.optim.rows_kernels.adagrad_rows_direct`).

    Returns:
        True if taken; False if nothing changed and the step needs sparse gradients (:func:`step`).
    """
    if getattr(type(optimizer).step, "__wrapped__", None) is None or _watched(optimizer):
        return False
    return rows_kernels.adagrad_rows_direct(optimizer, work)


# The step hooks torch runs for every optimizer: its registries, found once (they are
# dicts it adds to in place); None where the installed torch keeps them elsewhere.
_TORCH_OPTIMIZER = sys.modules.get("torch.optim.optimizer")  # imported with torch
_GLOBAL_STEP_HOOKS = (
    getattr(_TORCH_OPTIMIZER, "_global_optimizer_pre_hooks", None),
    getattr(_TORCH_OPTIMIZER, "_global_optimizer_post_hooks", None),
)
_GLOBAL_STEP_HOOKS_KNOWN = None not in _GLOBAL_STEP_HOOKS


def _watched(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a profiler or a step hook would see this optimizer's step (True where torch does not say)."""
    return (
        torch.autograd._profiler_enabled()
        or not _GLOBAL_STEP_HOOKS_KNOWN
        or any(_GLOBAL_STEP_HOOKS)
        or bool(getattr(optimizer, "_optimizer_step_pre_hooks", True))
        or bool(getattr(optimizer, "_optimizer_step_post_hooks", True))
    )


def foreach_same_results(
    cls: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any] | None = None,
    dtypes: Iterable[torch.dtype] = (torch.float32,),
) -> bool:
    """Whether ``cls``'s multi-tensor kernels give the same bits as its
    per-parameter ones on the installed torch, for these arguments and dtypes.

    Decided once per process for each optimizer class, arguments and set of
    dtypes, by running a few steps of both kernels from the same values and
    gradients (random, from a private generator: the global random state is
    left alone) on tensors of a few shapes, and comparing the results bit
    for bit; a few milliseconds per dtype (the first optimizer step in a
    process also pays torch's one-off imports, which the ps's first step
    would pay otherwise). The answer and its reason are logged (debug when
    they agree, info when they do not).

    Args:
        cls: a ``torch.optim.Optimizer`` subclass taking a ``foreach`` argument.
        kwargs: its keyword arguments, other than ``foreach``.
        dtypes: the dtypes of the variables it will update.

    Returns:
        True where every result agrees; False where one differs, or where
        the check itself fails (an argument or dtype the multi-tensor kernels
        refuse), so that a False only ever costs speed.
    """
    items = tuple(sorted((kwargs or {}).items()))
    # Classes hash by identity; the stubs of Optimizer say otherwise.
    return _decide_foreach(cls, items, tuple(sorted(set(dtypes), key=str)))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=64)
def _decide_foreach(
    cls: type[torch.optim.Optimizer], items: tuple[tuple[str, Any], ...], dtypes: tuple[torch.dtype, ...]
) -> bool:
    """:func:`foreach_same_results`, memoised, with the choice logged."""
    what = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in items)}) on {', '.join(map(str, dtypes))}"
    try:
        difference = _foreach_difference(cls, dict(items), dtypes)
    except Exception as e:  # noqa: BLE001 - any failure leaves them not shown equal: the safe answer
        difference = f"could not be compared ({type(e).__name__}: {e})"
    if difference is None:
        log.debug(
            "%s: multi-tensor kernels give the same bits as per-parameter ones on torch %s; small variables share them",
            what,
            torch.__version__,
        )
        return True
    log.info("%s: no multi-tensor groups: on torch %s its multi-tensor kernels %s", what, torch.__version__, difference)
    return False


def _foreach_difference(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], dtypes: tuple[torch.dtype, ...]
) -> str | None:
    """None if both kernels of ``cls`` end on the same bits; else what differs."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, dtype=dtype, generator=generator) for dtype in dtypes for shape in _CHECK_SHAPES]
    multi = [t.clone().requires_grad_() for t in start]
    single = [t.clone().requires_grad_() for t in start]
    multi_opt = cls(multi, foreach=True, **kwargs)  # type: ignore[call-arg]
    single_opt = cls(single, foreach=False, **kwargs)  # type: ignore[call-arg]
    for _ in range(_CHECK_STEPS):
        for p, q in zip(multi, single):
            grad = torch.randn(p.shape, dtype=p.dtype, generator=generator)
            p.grad, q.grad = grad, grad.clone()
        multi_opt.step()
        single_opt.step()
    for p, q in zip(multi, single):
        if not _same_bits(p, q):
            count = int((p.detach() != q.detach()).sum())
            return (
                f"differ after {_CHECK_STEPS} steps: {count} of the {p.numel()} values of a "
                f"{tuple(p.shape)} {p.dtype} tensor"
            )
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (unlike ``==``, a NaN equals the same NaN)."""
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _trained_dtypes(params: list[torch.Tensor]) -> set[torch.dtype]:
    """The dtypes of the variables an optimizer can update (floating or complex)."""
    return {p.dtype for p in params if p.is_floating_point() or p.is_complex()} or {torch.float32}


def _foreach_groups(params: list[torch.Tensor]) -> list[dict]:
    """Parameter groups for :meth:`OptimizerSpec.build`: small variables in
    multi-tensor groups of bounded size, the rest in one per-parameter group."""
    groups: list[dict] = []
    large: list[torch.Tensor] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if nbytes > FOREACH_GROUP_BYTES:
            large.append(param)
            continue
        if current and current_bytes + nbytes > FOREACH_GROUP_BYTES:
            groups.append({"params": current, "foreach": True})
            current, current_bytes = [], 0
        current.append(param)
        current_bytes += nbytes
    if current:
        groups.append({"params": current, "foreach": True})
    if large:
        groups.append({"params": large, "foreach": False})
    return groups


def build(
    name: str, kwargs: Mapping[str, Any], params: list[torch.Tensor], *, per_parameter: bool = False
) -> torch.optim.Optimizer:
    """Create the optimizer ``name(**kwargs)`` over ``params``, as a ps task runs it.

    Unless told otherwise (``foreach=`` in ``kwargs``), and where the installed
    torch's multi-tensor ("foreach") kernels of this optimizer give the same
    bits as its per-parameter ones for these arguments and dtypes (see
    :func:`foreach_same_results`), variables of up to
    :data:`FOREACH_GROUP_BYTES` are packed, in order, into parameter groups of
    at most that many bytes that run the multi-tensor kernels: one call per
    group instead of a Python loop over many small variables. Larger variables
    run the per-parameter kernels: the multi-tensor ones allocate temporaries
    as large as all the variables of their group, which for large ones would
    double a ps task's memory. Where the kernels differ, every variable runs
    the per-parameter ones, so the values are torch's per-parameter results
    either way. ``per_parameter`` asks for the per-parameter kernels outright
    (an embedding table's sparse updates have no multi-tensor form).
    """
    cls = optimizer_class(name)
    kwargs = dict(kwargs)
    if "foreach" not in inspect.signature(cls.__init__).parameters or "foreach" in kwargs:
        return cls(params, **kwargs)
    if per_parameter:
        return cls(params, foreach=False, **kwargs)  # type: ignore[call-arg]
    if not foreach_same_results(cls, kwargs, _trained_dtypes(params)):
        return cls(params, foreach=False, **kwargs)  # type: ignore[call-arg]
    return cls(_foreach_groups(params), **kwargs)


# torch.optim.Optimizer.add_param_group without its torch._disable_dynamo
# wrapper, which imports torch._dynamo on first use: a second and some 70 MB
# that a worker, which checks optimizer arguments but never steps an
# optimizer, need not pay.
_ADD_PARAM_GROUP = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group)


@functools.lru_cache(maxsize=64)
def check_arguments(name: str, items: tuple[tuple[str, Any], ...]) -> None:
    """Build optimizer ``name(**dict(items))`` over a dummy parameter (accepted arguments are remembered).

    Raises:
        TypeError, ValueError: torch refused the arguments (its own exception).
    """
    probe(name, dict(items))


def probe(name: str, kwargs: Mapping[str, Any]) -> torch.optim.Optimizer:
    """Optimizer ``name(**kwargs)`` (:func:`optimizer_class`) over one dummy parameter, never stepped: to check
    arguments, and for a learning-rate schedule to run over (:mod:`psframe.optim.schedule_clock`).

    Its ``add_param_group`` (which ``Optimizer.__init__`` calls) is replaced,
    on that one instance, by the unwrapped function (see :data:`_ADD_PARAM_GROUP`).

    Raises:
        TypeError, ValueError: torch refused the arguments (its own exception).
    """
    cls = optimizer_class(name)
    optimizer = cls.__new__(cls)
    optimizer.add_param_group = types.MethodType(_ADD_PARAM_GROUP, optimizer)  # type: ignore[method-assign]
    cls.__init__(optimizer, [torch.zeros(1, requires_grad=True)], **kwargs)
    return optimizer

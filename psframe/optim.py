"""Server-side optimizers, named the way ``torch.optim`` names them.

The ps tasks run real ``torch.optim`` optimizers over the variables they
hold; a worker only says which one and with which keyword arguments::

    optimizer = psframe.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)
    optimizer = psframe.optim.Adam(lr=1e-3, betas=(0.9, 0.999))

Arguments are checked on the worker, up front, by building the optimizer
once over a dummy parameter, so a typo fails before any task is contacted.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from psframe import sparse_optim
from psframe.errors import OptimizerConfigError

log = logging.getLogger(__name__)

# Variables up to this size share multi-tensor optimizer kernels, in groups
# of at most this many bytes (see OptimizerSpec.build).
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

# torch.optim optimizers a ps can run: every one whose step() needs no
# closure. LBFGS re-evaluates the loss, which only a worker can do.
SUPPORTED = (
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
    "SparseSGD",  # psframe's own: SGD with lazy momentum for embedding tables (psframe.sparse_optim)
)

KwargValue = float | int | bool | str | tuple[float, ...]


@dataclass(frozen=True)
class OptimizerSpec:
    """A ``torch.optim`` optimizer by class name and keyword arguments.

    Args:
        name: the class name in ``torch.optim`` (one of :data:`SUPPORTED`).
        kwargs: keyword arguments for its constructor; numbers, bools,
            strings and tuples of numbers only, since they cross the wire.

    Raises:
        OptimizerConfigError: unknown name, or arguments torch.optim refuses.
    """

    name: str
    kwargs: Mapping[str, KwargValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in SUPPORTED:
            raise OptimizerConfigError(f"unknown optimizer {self.name!r}; expected one of {', '.join(SUPPORTED)}")
        clean: dict[str, KwargValue] = {}
        for key, value in self.kwargs.items():
            if isinstance(value, list):
                value = tuple(value)
            if isinstance(value, tuple):
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                    raise OptimizerConfigError(f"{self.name}({key}={value!r}): tuples may hold numbers only")
            elif not isinstance(value, (bool, int, float, str)):
                raise OptimizerConfigError(
                    f"{self.name}({key}={value!r}): expected a number, bool, string or tuple "
                    f"of numbers, got {type(value).__name__}"
                )
            clean[key] = value
        object.__setattr__(self, "kwargs", clean)
        _check(self.name, tuple(sorted(clean.items())))

    def build(self, params: list[torch.Tensor], *, per_parameter: bool = False) -> torch.optim.Optimizer:
        """Create the torch optimizer over ``params`` (done on the ps).

        Unless told otherwise (``foreach=``), and where the installed torch's
        multi-tensor ("foreach") kernels of this optimizer give the same bits
        as its per-parameter ones for these arguments and dtypes (see
        :func:`foreach_same_results`), variables of up to
        :data:`FOREACH_GROUP_BYTES` are packed, in order, into parameter
        groups of at most that many bytes that run the multi-tensor kernels:
        one call per group instead of a Python loop over many small
        variables. Larger variables run the per-parameter kernels: the
        multi-tensor ones allocate temporaries as large as all the variables
        of their group, which for large ones would double a ps task's memory.
        Where the kernels differ, every variable runs the per-parameter ones,
        so the values are torch's per-parameter results either way.
        ``per_parameter`` asks for the per-parameter kernels outright (an
        embedding table's sparse updates have no multi-tensor form).
        """
        cls = optimizer_class(self.name)
        kwargs = dict(self.kwargs)
        if "foreach" not in inspect.signature(cls.__init__).parameters or "foreach" in kwargs:
            return cls(params, **kwargs)
        if per_parameter:
            return cls(params, foreach=False, **kwargs)
        if not foreach_same_results(cls, kwargs, _trained_dtypes(params)):
            return cls(params, foreach=False, **kwargs)
        return cls(_foreach_groups(params), **kwargs)

    def for_tables(self) -> OptimizerSpec:
        """The optimizer that goes with this one for embedding tables (see
        :func:`psframe.sparse_optim.table_optimizer`): itself, or its row-by-row form.

        Raises:
            OptimizerConfigError: it has no row-by-row form.
        """
        name, kwargs = sparse_optim.table_optimizer(self.name, dict(self.kwargs))
        return OptimizerSpec(name, kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"psframe.optim.{self.name}({args})"


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The optimizer class of a name in :data:`SUPPORTED`: torch.optim's, or psframe's ``SparseSGD``."""
    return sparse_optim.SparseSGD if name == "SparseSGD" else getattr(torch.optim, name)


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``, without the profiler range and hook dispatch around it when nothing uses them.

    torch.optim wraps every optimizer class's ``step`` in a function that
    opens a profiler range and runs the step hooks. On a ps task, which
    steps once per push, thousands of times a second on small models, that
    wrapper costs about a fifth of a step of the MNIST MLP's four variables.
    With no profiler running and no step hook registered (psframe registers
    none, and a ps task's optimizers are its own), the wrapper does nothing
    but call the step, so the step is called directly; with a profiler or a
    hook, or a torch without the wrapper, ``optimizer.step()`` is.
    """
    unwrapped = getattr(type(optimizer).step, "__wrapped__", None)
    if (
        unwrapped is None
        or torch.autograd._profiler_enabled()
        or _global_step_hooks()
        or getattr(optimizer, "_optimizer_step_pre_hooks", True)
        or getattr(optimizer, "_optimizer_step_post_hooks", True)
    ):
        optimizer.step()
    else:
        unwrapped(optimizer)


def _global_step_hooks() -> bool:
    """Whether a step hook is registered for every optimizer (True where torch does not say)."""
    module = sys.modules.get("torch.optim.optimizer")
    pre = getattr(module, "_global_optimizer_pre_hooks", None)
    post = getattr(module, "_global_optimizer_post_hooks", None)
    return pre is None or post is None or bool(pre) or bool(post)


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
    return _decide_foreach(cls, items, tuple(sorted(set(dtypes), key=str)))


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
    multi_opt = cls(multi, foreach=True, **kwargs)
    single_opt = cls(single, foreach=False, **kwargs)
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


# torch.optim.Optimizer.add_param_group without its torch._disable_dynamo
# wrapper, which imports torch._dynamo on first use: a second and some 70 MB
# that a worker, which checks optimizer arguments but never steps an
# optimizer, need not pay.
_ADD_PARAM_GROUP = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", torch.optim.Optimizer.add_param_group)


@functools.lru_cache(maxsize=64)
def _check(name: str, items: tuple[tuple[str, Any], ...]) -> None:
    """Raise OptimizerConfigError unless ``torch.optim.<name>(**items)`` accepts the arguments."""
    cls = optimizer_class(name)
    checked = type(f"_Checked{name}", (cls,), {"add_param_group": _ADD_PARAM_GROUP})
    dummy = torch.zeros(1, requires_grad=True)
    try:
        checked([dummy], **dict(items))
    except (TypeError, ValueError) as e:
        raise OptimizerConfigError(f"torch.optim.{name} refused {dict(items)}: {e}") from e


def _factory(name: str):
    def make(**kwargs: KwargValue) -> OptimizerSpec:
        return OptimizerSpec(name, kwargs)

    make.__name__ = name
    make.__qualname__ = name
    make.__doc__ = (
        f"Run ``torch.optim.{name}`` on the ps tasks with these keyword arguments.\n\n"
        f"Returns:\n    An :class:`OptimizerSpec` to pass to ``psframe.Trainer``."
    )
    return make


SGD = _factory("SGD")
Adam = _factory("Adam")
AdamW = _factory("AdamW")
Adagrad = _factory("Adagrad")
RMSprop = _factory("RMSprop")
Adadelta = _factory("Adadelta")
Adamax = _factory("Adamax")
NAdam = _factory("NAdam")
RAdam = _factory("RAdam")
ASGD = _factory("ASGD")
Rprop = _factory("Rprop")
SparseAdam = _factory("SparseAdam")
SparseSGD = _factory("SparseSGD")
SparseSGD.__doc__ = (
    "Run :class:`psframe.sparse_optim.SparseSGD` (SGD with lazy momentum, for embedding tables) "
    "on the ps tasks.\n\nReturns:\n    An :class:`OptimizerSpec` to pass to ``psframe.Trainer``."
)


@dataclass(frozen=True)
class SyncReplicas:
    """Synchronous training, as TF's ``SyncReplicasOptimizer``.

    Every update averages the gradients of exactly ``replicas_to_aggregate``
    workers computed at the same global step, summed in task-index order (so
    runs are bit-identical), and the same workers are used on every ps task.
    With backup workers (``total_num_replicas`` > ``replicas_to_aggregate``)
    the first workers to finish a step are used and the late ones' gradients
    are dropped. Stale gradients are dropped and counted, never applied.

    When workers finish (run out of data or steps) and fewer than
    ``replicas_to_aggregate`` remain, each update averages the gradients of
    all remaining workers instead; the ps logs the change.

    Args:
        replicas_to_aggregate: gradients per update; defaults to the number
            of workers.
        total_num_replicas: workers taking part; defaults to the number of
            workers, and must equal it when given.
        timeout: seconds any barrier wait may last before failing with an
            error naming the step and the missing workers.

    Raises:
        ValueError: a count is not positive, or R > N, or timeout is not finite and > 0.
    """

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("replicas_to_aggregate", "total_num_replicas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if r is not None and n is not None and r > n:
            raise ValueError(f"replicas_to_aggregate ({r}) must be <= total_num_replicas ({n})")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")

    def resolve(self, num_workers: int) -> SyncReplicas:
        """This spec with the defaults filled in for a cluster of ``num_workers``.

        Raises:
            ValueError: the counts do not fit the cluster.
        """
        n = self.total_num_replicas if self.total_num_replicas is not None else num_workers
        r = self.replicas_to_aggregate if self.replicas_to_aggregate is not None else n
        if n != num_workers:
            raise ValueError(
                f"total_num_replicas ({n}) must equal the number of workers in the cluster ({num_workers})"
            )
        return SyncReplicas(r, n, self.timeout)


@dataclass(frozen=True)
class SyncReplicasOptimizer:
    """TF's name for an optimizer plus :class:`SyncReplicas`.

    ``Trainer(optimizer=SyncReplicasOptimizer(SGD(lr=0.1), 2, 3))`` is the
    same as ``Trainer(optimizer=SGD(lr=0.1), sync=SyncReplicas(2, 3))``.
    """

    optimizer: OptimizerSpec
    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, OptimizerSpec):
            raise OptimizerConfigError(
                f"SyncReplicasOptimizer wraps a psframe.optim spec such as psframe.optim.SGD(lr=0.1), "
                f"got {type(self.optimizer).__name__}"
            )
        self.sync  # noqa: B018 - reading it validates the counts

    @property
    def sync(self) -> SyncReplicas:
        return SyncReplicas(self.replicas_to_aggregate, self.total_num_replicas, self.timeout)


__all__ = ["OptimizerSpec", "SyncReplicas", "SyncReplicasOptimizer", "SUPPORTED", *SUPPORTED]

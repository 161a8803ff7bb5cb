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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from psframe.errors import OptimizerConfigError

# Variables up to this size share multi-tensor optimizer kernels, in groups
# of at most this many bytes (see OptimizerSpec.build).
FOREACH_GROUP_BYTES = 4 << 20
# The optimizers whose multi-tensor kernels give the same bits as their
# per-parameter ones (tests/test_optim.py checks it); RAdam's and ASGD's do not.
FOREACH_SAME_RESULTS = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "Rprop"})

# torch.optim optimizers a ps can run: every one whose step() needs no
# closure. LBFGS re-evaluates the loss, which only a worker can do.
SUPPORTED = (
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop",
    "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "SparseAdam",
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
            raise OptimizerConfigError(
                f"unknown optimizer {self.name!r}; expected one of {', '.join(SUPPORTED)}"
            )
        clean: dict[str, KwargValue] = {}
        for key, value in self.kwargs.items():
            if isinstance(value, list):
                value = tuple(value)
            if isinstance(value, tuple):
                if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                    raise OptimizerConfigError(
                        f"{self.name}({key}={value!r}): tuples may hold numbers only"
                    )
            elif not isinstance(value, (bool, int, float, str)):
                raise OptimizerConfigError(
                    f"{self.name}({key}={value!r}): expected a number, bool, string or tuple "
                    f"of numbers, got {type(value).__name__}"
                )
            clean[key] = value
        object.__setattr__(self, "kwargs", clean)
        _check(self.name, tuple(sorted(clean.items())))

    def build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """Create the torch optimizer over ``params`` (done on the ps).

        Unless told otherwise (``foreach=``), and for the optimizers of
        :data:`FOREACH_SAME_RESULTS`, variables of up to
        :data:`FOREACH_GROUP_BYTES` are packed, in order, into parameter
        groups of at most that many bytes that run torch's multi-tensor
        ("foreach") kernels: one call per group instead of a Python loop over
        many small variables. Larger variables run the per-parameter kernels:
        the multi-tensor ones allocate temporaries as large as all the
        variables of their group, which for large ones would double a ps
        task's memory. Both compute the same values, bit for bit.
        """
        cls = getattr(torch.optim, self.name)
        kwargs = dict(self.kwargs)
        if "foreach" not in inspect.signature(cls.__init__).parameters or "foreach" in kwargs:
            return cls(params, **kwargs)
        if self.name not in FOREACH_SAME_RESULTS:
            return cls(params, foreach=False, **kwargs)
        return cls(_foreach_groups(params), **kwargs)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"psframe.optim.{self.name}({args})"


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
_ADD_PARAM_GROUP = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__",
                           torch.optim.Optimizer.add_param_group)


@functools.lru_cache(maxsize=64)
def _check(name: str, items: tuple[tuple[str, Any], ...]) -> None:
    """Raise OptimizerConfigError unless ``torch.optim.<name>(**items)`` accepts the arguments."""
    cls = getattr(torch.optim, name)
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
        ValueError: a count is not positive, or R > N, or timeout <= 0.
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
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")

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
        self.sync  # validates the counts

    @property
    def sync(self) -> SyncReplicas:
        return SyncReplicas(self.replicas_to_aggregate, self.total_num_replicas, self.timeout)


__all__ = ["OptimizerSpec", "SyncReplicas", "SyncReplicasOptimizer", "SUPPORTED", *SUPPORTED]

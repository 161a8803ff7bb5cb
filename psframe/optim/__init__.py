"""Server-side optimizers, named the way ``torch.optim`` names them.

The ps tasks run real ``torch.optim`` optimizers over the variables they
hold (and psframe's own for embedding tables: ``SparseSGD``, ``Ftrl``,
``RowWiseAdagrad``); a worker only says which one and with which keyword
arguments, through the factories of :mod:`psframe.optim.factories`, exported here::

    optimizer = psframe.optim.SGD(lr=0.1, momentum=0.9, nesterov=True)
    optimizer = psframe.optim.Adam(lr=1e-3, betas=(0.9, 0.999))
    table_optimizer = psframe.optim.Ftrl(lr=0.05, l1=1e-3)

Arguments are checked on the worker, up front, by building the optimizer
once over a dummy parameter, so a typo fails before any task is contacted.
A learning-rate schedule goes with its optimizer (``schedule=``, one of
:mod:`psframe.optim.lr_scheduler`) and runs on the ps tasks too, by global step.

How a ps task runs them is in the modules beside this one:
:mod:`psframe.optim.kernels` (fast, with torch's own results),
:mod:`psframe.optim.rows_kernels` (the optimizers of embedding tables, row
by row), :mod:`psframe.optim.ftrl` and :mod:`psframe.optim.rowwise_adagrad`
(psframe's table optimizers), :mod:`psframe.optim.row_state` (which state
is per row, and what a new row's starts at) and
:mod:`psframe.optim.schedule_clock` (schedules).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from psframe.errors import OptimizerConfigError
from psframe.optim import kernels, lr_scheduler, rows_kernels
from psframe.optim.factories import (
    ASGD,
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    Ftrl,
    NAdam,
    RAdam,
    RMSprop,
    RowWiseAdagrad,
    Rprop,
    SparseAdam,
    SparseSGD,
)
from psframe.optim.lr_scheduler import ScheduleSpec

log = logging.getLogger(__name__)

# The optimizers a ps can run: every torch.optim one whose step() needs no
# closure (LBFGS re-evaluates the loss, which only a worker can do), and psframe's own.
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
    # psframe's own (kernels.OWN_OPTIMIZERS), for embedding tables above all:
    "SparseSGD",  # SGD with lazy momentum (psframe.optim.rows_kernels)
    "Ftrl",  # FTRL-Proximal as TensorFlow's (psframe.optim.ftrl)
    "RowWiseAdagrad",  # Adagrad with one accumulator per row, as FBGEMM's (psframe.optim.rowwise_adagrad)
)

KwargValue = float | int | bool | str | tuple[float, ...]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer by class name and keyword arguments: ``torch.optim``'s, or psframe's own.

    Args:
        name: the class name in ``torch.optim``, or of psframe's own (one of :data:`SUPPORTED`).
        kwargs: keyword arguments for its constructor; numbers, bools,
            strings and tuples of numbers only, since they cross the wire.
        schedule: its learning-rate schedule (:mod:`psframe.optim.lr_scheduler`); None: a constant rate.

    Raises:
        OptimizerConfigError: unknown name, or arguments the optimizer refuses (or its schedule).
    """

    name: str
    kwargs: Mapping[str, KwargValue] = field(default_factory=dict)
    schedule: ScheduleSpec | None = None

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
        try:
            kernels.check_arguments(self.name, tuple(sorted(clean.items())))
        except (TypeError, ValueError) as e:
            raise OptimizerConfigError(f"{kernels.qualified_name(self.name)} refused {clean}: {e}") from e
        if self.schedule is not None:
            if not isinstance(self.schedule, ScheduleSpec):
                raise OptimizerConfigError(
                    f"schedule= takes a psframe.optim.lr_scheduler spec, got {type(self.schedule).__name__}"
                )
            lr_scheduler.check(self.schedule, self.name, clean, resolve=False)

    def build(self, params: list[torch.Tensor], *, per_parameter: bool = False) -> torch.optim.Optimizer:
        """Create the torch optimizer over ``params``, as a ps task runs it
        (see :func:`psframe.optim.kernels.build`)."""
        return kernels.build(self.name, self.kwargs, params, per_parameter=per_parameter)

    def for_tables(self) -> OptimizerSpec:
        """The optimizer that goes with this one for embedding tables (see
        :func:`psframe.optim.rows_kernels.table_optimizer`): itself, or its row-by-row form.

        Raises:
            OptimizerConfigError: it has no row-by-row form.
        """
        name, kwargs = rows_kernels.table_optimizer(self.name, dict(self.kwargs))
        return OptimizerSpec(name, kwargs, self.schedule)

    def __repr__(self) -> str:
        args = [f"{k}={v!r}" for k, v in self.kwargs.items()]
        if self.schedule is not None:
            args.append(f"schedule={self.schedule!r}")
        return f"psframe.optim.{self.name}({', '.join(args)})"


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

    In an elastic cluster (ps tasks given ``max_workers``; see
    the guide "Elastic clusters") the workers taking part change while training,
    and each round takes its count from the live workers at its start:
    ``fraction_to_aggregate`` of them, rounded up (1.0, all of them, when
    neither count is given), or ``replicas_to_aggregate`` as a cap (never
    more than are live). ``total_num_replicas`` is not given there.

    Args:
        replicas_to_aggregate: gradients per update; defaults to the number
            of workers.
        total_num_replicas: workers taking part; defaults to the number of
            workers, and must equal it when given.
        timeout: seconds any barrier wait may last before failing with an
            error naming the step and the missing workers.
        fraction_to_aggregate: the share of the workers whose gradients
            make an update, in (0, 1]: ``ceil(fraction x workers)``; instead
            of ``replicas_to_aggregate``.
        async_tables: embedding tables whose rows are applied at once, as in
            asynchronous training, while the dense variables go in rounds (the
            common choice for large tables: a row's gradients do not wait for the
            slowest worker, and a worker's rows are at most a round behind).
            True: every table; or the tables' names (the module, ``"emb"``, or its
            weight, ``"emb.weight"``). Default: none, every variable in rounds.

    Raises:
        ValueError: a count is not positive, or R > N, or timeout is not finite and > 0,
            or a fraction outside (0, 1], or both a fraction and ``replicas_to_aggregate``.
    """

    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    timeout: float = 300.0
    fraction_to_aggregate: float | None = None
    async_tables: bool | tuple[str, ...] = False

    def __post_init__(self) -> None:
        tables = self.async_tables
        if not isinstance(tables, bool):
            if isinstance(tables, str) or not all(isinstance(t, str) and t for t in tables):
                raise ValueError(f"async_tables must be True, False or a tuple of table names, got {tables!r}")
            object.__setattr__(self, "async_tables", tuple(tables))
        for name in ("replicas_to_aggregate", "total_num_replicas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if r is not None and n is not None and r > n:
            raise ValueError(f"replicas_to_aggregate ({r}) must be <= total_num_replicas ({n})")
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout!r}")
        fraction = self.fraction_to_aggregate
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ValueError(f"fraction_to_aggregate must be a number in (0, 1], got {fraction!r}")
            if r is not None:
                raise ValueError(f"give replicas_to_aggregate ({r}) or fraction_to_aggregate ({fraction}), not both")

    def resolve(self, num_workers: int, *, elastic: bool = False) -> SyncReplicas:
        """This spec with the defaults filled in for a cluster of ``num_workers``.

        ``elastic``: the ps tasks take workers joining and leaving (``max_workers``);
        the counts then follow the live workers round by round, and the settings
        stay those given (a fraction, 1.0 by default, or a cap).

        Raises:
            ValueError: the counts do not fit the cluster.
        """
        if elastic:
            if self.total_num_replicas is not None:
                raise ValueError(
                    f"total_num_replicas ({self.total_num_replicas}) is fixed, but the ps tasks take workers "
                    f"joining and leaving (max_workers): leave it unset, each round counts the live workers"
                )
            fraction = self.fraction_to_aggregate
            if fraction is None and self.replicas_to_aggregate is None:
                fraction = 1.0
            return SyncReplicas(self.replicas_to_aggregate, None, self.timeout, fraction, self.async_tables)
        n = self.total_num_replicas if self.total_num_replicas is not None else num_workers
        if self.fraction_to_aggregate is not None:
            r = _share(self.fraction_to_aggregate, n)
        else:
            r = self.replicas_to_aggregate if self.replicas_to_aggregate is not None else n
        if n != num_workers:
            raise ValueError(
                f"total_num_replicas ({n}) must equal the number of workers in the cluster ({num_workers})"
            )
        return SyncReplicas(r, n, self.timeout, async_tables=self.async_tables)

    def required(self, live: int) -> int:
        """How many gradients a round of an elastic cluster averages when ``live`` workers take part."""
        if self.fraction_to_aggregate is not None:
            return min(live, _share(self.fraction_to_aggregate, live))
        return min(live, self.replicas_to_aggregate or live)


def _share(fraction: float, workers: int) -> int:
    """``ceil(fraction x workers)``, at least 1 (a product a rounding error above a whole number is that number)."""
    return max(1, math.ceil(fraction * workers - 1e-9))


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


# The specs, and the factories of every name in SUPPORTED.
__all__ = [
    "ASGD",
    "SGD",
    "SUPPORTED",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Ftrl",
    "NAdam",
    "OptimizerSpec",
    "RAdam",
    "RMSprop",
    "RowWiseAdagrad",
    "Rprop",
    "SparseAdam",
    "SparseSGD",
    "SyncReplicas",
    "SyncReplicasOptimizer",
]

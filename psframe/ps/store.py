"""The variables a ps task holds, and the optimizer that updates them.

Plain torch, no network: the servicer translates requests into calls here.
A store is empty until the chief creates its variables, then ready::

    EMPTY --create()--> READY --apply()/read()--> READY

Updates are all-or-nothing: every gradient of a push is checked against its
variable before any variable changes, so a bad push leaves the store as it
was.

Embedding tables are variables too, updated row by row: a push carries the
ids of the rows it touched and their gradients (:meth:`apply_rows`), a pull
names the rows it wants (:meth:`read_rows`), and a second optimizer, one
that takes sparse gradients (:mod:`psframe.sparse_optim`), updates them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy
import torch

from psframe import huge_pages, optim
from psframe.dynamic_rows import DynamicRows
from psframe.errors import (
    ClusterMismatchError,
    DtypeMismatchError,
    InvalidGradientError,
    NotReadyError,
    PsframeError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psframe.optim import OptimizerSpec
from psframe.ps.store_state import StoreState
from psframe.ps.table_rows import DynamicPart
from psframe.wire import messages

# Generations of variables, unique in the process (see VariableStore.generation).
_GENERATIONS = itertools.count(1)


class VariableStore(StoreState):
    """Variables plus a ``torch.optim`` optimizer over them.

    Callers that read variables while others may push hold :attr:`lock`
    around both, so that what they read is one consistent version.

    A ps task served from several processes gives every process's store the
    same lock, counters and memory (:mod:`psframe.ps.shared`): their variables
    and optimizer state are then one, in shared memory.

    Args:
        owner: the task name used in error messages, e.g. ``/job:ps/task:0``.
        lock: a reentrant lock; one of this process's by default.
        counters: global step, applied pushes and refused pushes, as an int64
            array of 3; this process's own by default.
        allocate: ``allocate(dtype, shape)`` makes the memory of a variable
            (and, in :meth:`share_state`, of optimizer state); torch's by default.
    """

    def __init__(
        self,
        owner: str = "this ps task",
        *,
        lock: Any = None,
        counters: numpy.ndarray | None = None,
        allocate: Callable[[torch.dtype, tuple[int, ...]], torch.Tensor] | None = None,
    ) -> None:
        self.owner = owner
        self.lock = lock if lock is not None else threading.RLock()
        self._counters = counters if counters is not None else numpy.zeros(3, dtype=numpy.int64)
        self._allocate = allocate
        self._variables: dict[str, torch.Tensor] = {}
        self._optimizer: torch.optim.Optimizer | None = None  # of the dense variables (None: there are none)
        self._optimizer_spec: OptimizerSpec | None = None
        self._tables: frozenset[str] = frozenset()  # the variables that are embedding tables
        self._table_optimizer: torch.optim.Optimizer | None = None
        self._table_optimizer_spec: OptimizerSpec | None = None
        self._dynamic: dict[str, DynamicRows] = {}  # the dynamic tables' parts, each with its optimizer
        self._ready = False
        # Bumped whenever a variable's value changes: two reads under the lock
        # that see the same version read the same values.
        self.version = 0
        # Changes whenever the variables are made anew (create, adopt): what was
        # checked against one generation's variables (a request plan, views of
        # them) holds until it changes. Unique among the stores of a process.
        self.generation = 0
        self._stepped = False  # an optimizer step went through in this store

    # Counted in an array that several processes may share (see `counters`).
    global_step = property(
        lambda self: int(self._counters[0]), lambda self, value: self._counters.__setitem__(0, value)
    )
    pushes = property(lambda self: int(self._counters[1]), lambda self, value: self._counters.__setitem__(1, value))
    rejected_pushes = property(
        lambda self: int(self._counters[2]), lambda self, value: self._counters.__setitem__(2, value)
    )

    # ---- creation

    @property
    def ready(self) -> bool:
        """Whether the variables exist."""
        return self._ready

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        return self._optimizer_spec

    @property
    def table_optimizer_spec(self) -> OptimizerSpec | None:
        """The embedding tables' optimizer; None when the store holds no table."""
        return self._table_optimizer_spec

    @property
    def tables(self) -> frozenset[str]:
        """The names of the variables that are embedding tables."""
        return self._tables

    def create(
        self,
        values: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec,
        *,
        copy: bool = True,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
        dynamic: Mapping[str, DynamicPart] | None = None,
    ) -> bool:
        """Create the variables (copies of ``values``, or ``values`` themselves
        with ``copy=False``: tensors from :meth:`copy_in`, where the store has
        memory of its own) and the optimizer.

        Creating again with the same names, shapes, dtypes and optimizer is a
        no-op (the chief restarted, or the store was restored); anything else
        is refused. ``tables`` name the variables that are embedding tables,
        updated by ``table_optimizer``; ``dynamic`` defines the parts of
        dynamic tables, which start empty (:mod:`psframe.dynamic_rows`).

        Returns:
            True if the variables were created, False if they already existed.

        Raises:
            ClusterMismatchError: the store already holds a different model.
        """
        with self.lock:
            dynamic = dict(dynamic or {})
            if self.ready:
                self._check_same_model(values, optimizer, tables, table_optimizer, dynamic)
                return False
            variables = {}
            for name, value in values.items():
                if copy:
                    variable = self.copy_in(value)
                else:  # made by copy_in or empty already, or a tensor of the request
                    variable = value.detach().to("cpu").contiguous()
                    huge_pages.back([variable])
                variable.requires_grad_(variable.is_floating_point() or variable.is_complex())
                variables[name] = variable
            self._build_optimizers(variables, optimizer, tables, table_optimizer, dynamic)
            self._variables = variables
            self.version += 1
            self.generation = next(_GENERATIONS)
            return True

    def _build_optimizers(
        self,
        variables: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec,
        tables: Sequence[str],
        table_optimizer: OptimizerSpec | None,
        dynamic: Mapping[str, DynamicPart] | None = None,
    ) -> None:
        unknown = sorted(set(tables) - set(variables))
        if unknown:
            raise UnknownVariableError(f"{self.owner}: tables {unknown} are not among the variables created")
        if (tables or dynamic) and table_optimizer is None:
            raise ClusterMismatchError(
                f"{self.owner}: embedding tables {sorted([*tables, *(dynamic or ())])} need a table optimizer"
            )
        self._dynamic = {
            name: DynamicRows(name, part.row_shape, part.dtype, part.spec, table_optimizer)
            for name, part in (dynamic or {}).items()
        }
        dense = [v for name, v in variables.items() if name not in tables]
        self._optimizer = optimizer.build(dense) if dense else None
        self._optimizer_spec = optimizer
        self._tables = frozenset(tables)
        self._table_optimizer = (
            table_optimizer.build([variables[n] for n in tables], per_parameter=True) if tables else None
        )
        self._table_optimizer_spec = table_optimizer if tables or dynamic else None
        self._back_state()
        self._ready = True

    def _back_state(self) -> None:
        """Put the optimizers' large state tensors on huge pages (:mod:`psframe.huge_pages`):
        torch makes them, some at build, some at their variable's first step."""
        for optimizer in self._optimizers():
            huge_pages.back_state(optimizer)

    def _optimizer_of(self, name: str) -> torch.optim.Optimizer:
        return self._table_optimizer if name in self._tables else self._optimizer

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self._optimizer, self._table_optimizer) if o is not None]

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised memory for a variable, in the store's memory
        (shared memory, where it was given ``allocate``)."""
        return huge_pages.empty(shape, dtype) if self._allocate is None else self._allocate(dtype, shape)

    def copy_in(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` in the store's memory (shared memory, where it was given ``allocate``)."""
        if self._allocate is None:
            return huge_pages.copy(value)
        return self._allocate(value.dtype, tuple(value.shape)).copy_(value.detach())

    def _check_same_model(
        self,
        values: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec,
        tables: Sequence[str],
        table_optimizer: OptimizerSpec | None,
        dynamic: Mapping[str, DynamicPart],
    ) -> None:
        messages.check_same_variables(
            f"{self.owner} already holds a different model",
            messages.keys_of_tensors(values),
            messages.keys_of_tensors(self._variables),
        )
        held = {name: DynamicPart(rows.spec, rows.row_shape, rows.dtype) for name, rows in self._dynamic.items()}
        if dict(dynamic) != held:
            raise ClusterMismatchError(f"{self.owner} holds dynamic tables {held}, not {dict(dynamic)}")
        if optimizer != self._optimizer_spec:
            raise ClusterMismatchError(f"{self.owner} already runs {self._optimizer_spec!r}, not {optimizer!r}")
        if frozenset(tables) != self._tables or ((tables or dynamic) and table_optimizer != self._table_optimizer_spec):
            raise ClusterMismatchError(
                f"{self.owner} holds embedding tables {sorted(self._tables)} updated by "
                f"{self._table_optimizer_spec!r}, not {sorted(tables)} by {table_optimizer!r}"
            )

    def adopt(
        self,
        values: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]],
        optimizer: OptimizerSpec,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
    ) -> None:
        """Take variables and optimizer state that live elsewhere (shared memory) as this store's own.

        The tensors are used as they are, not copied: updates through this
        store and through every other store over them are one.
        """
        with self.lock:
            variables = {
                name: value.requires_grad_(value.is_floating_point() or value.is_complex())
                for name, value in values.items()
            }
            self._build_optimizers(variables, optimizer, tables, table_optimizer)
            self._variables = variables
            for name, state in states.items():
                if state:
                    self._optimizer_of(name).state[variables[name]] = dict(state)
            self.version += 1
            self.generation = next(_GENERATIONS)

    # ---- the hot path

    @property
    def names(self) -> list[str]:
        return list(self._variables)

    def _require_ready(self) -> None:
        if not self.ready:
            raise NotReadyError(f"{self.owner} holds no variables yet: the chief has not created them")

    def _variable(self, name: str) -> torch.Tensor:
        try:
            return self._variables[name]
        except KeyError:
            raise UnknownVariableError(
                f"{self.owner} holds no variable {name!r}; it holds {len(self._variables)}: "
                f"{', '.join(list(self._variables)[:8])}{'...' if len(self._variables) > 8 else ''}"
            ) from None

    def check_names(self, names: Sequence[str]) -> None:
        """Raise unless every name is a variable of this store."""
        with self.lock:
            self._require_ready()
            for name in names:
                self._variable(name)

    def check_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raise if any gradient does not fit its variable; changes nothing
        but the count of rejected pushes."""
        with self.lock:
            try:
                self._check_gradients(grads)
            except PsframeError:
                self.rejected_pushes += 1
                raise

    def _check_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        self._require_ready()
        for name, grad in grads.items():
            variable = self._variable(name)
            if name in self._tables:
                raise InvalidGradientError(
                    f"{name!r} on {self.owner} is an embedding table: it takes the rows a batch touched "
                    f"(ids and rows), not a whole gradient; nothing was applied"
                )
            if grad.dtype != variable.dtype:
                raise DtypeMismatchError(
                    f"gradient for {name!r} has dtype {grad.dtype} but the variable on "
                    f"{self.owner} has dtype {variable.dtype}; nothing was applied"
                )
            if grad.shape != variable.shape:
                raise ShapeMismatchError(
                    f"gradient for {name!r} has shape {tuple(grad.shape)} but the variable on "
                    f"{self.owner} has shape {tuple(variable.shape)}; nothing was applied"
                )

    def widen(self, grads: Mapping[str, torch.Tensor], wire_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gradients that travelled compressed, converted back to their variable's dtype.

        A gradient in ``wire_dtype`` for a wider floating-point variable is
        converted (a new tensor); any other gradient is returned as given, so
        that :meth:`apply` refuses what does not fit, naming it.
        """
        with self.lock:
            widened = {}
            for name, grad in grads.items():
                variable = self._variables.get(name)
                if (
                    variable is not None
                    and grad.dtype == wire_dtype
                    and variable.is_floating_point()
                    and variable.element_size() > grad.element_size()
                ):
                    grad = grad.to(variable.dtype)
                widened[name] = grad
            return widened

    def apply(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply one optimizer step with these gradients.

        Variables without a gradient in ``grads`` are left alone (torch.optim
        skips parameters whose ``grad`` is None). The gradient tensors are
        only read.

        Raises:
            NotReadyError, UnknownVariableError, ShapeMismatchError,
            DtypeMismatchError: nothing was applied.
        """
        with self.lock:
            self.check_gradients(grads)
            if not grads:
                return
            self._step([self._variables[name] for name in grads], list(grads.values()))

    def _step(
        self,
        variables: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """One step of ``optimizer`` (the dense variables' by default) with these gradients; counts a push."""
        for variable, grad in zip(variables, grads):
            variable.grad = grad
        try:
            optim.step(optimizer or self._optimizer)
            state = (optimizer or self._optimizer).state
            for variable in variables:  # torch makes some state at a variable's first step
                self._place_state(state.get(variable))
            self._stepped = True
        finally:
            self.version += 1  # even a step that failed halfway may have changed some
            for variable in variables:
                variable.grad = None
        self.pushes += 1

    def variables(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The live variables named (those :meth:`update` takes); hold :attr:`lock` while using them."""
        with self.lock:
            self._require_ready()
            return [self._variable(name) for name in names]

    def update(self, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], end_of_step: bool) -> int:
        """:meth:`push_pull` without its checks, for gradients already checked
        against these variables of the current :attr:`generation` (a request
        plan's); the caller holds :attr:`lock`.

        Returns:
            The global step after the request.
        """
        if grads:
            self._step(variables, grads)
            if end_of_step:
                return self.advance_step()
        return self.global_step

    def push_pull(
        self,
        grads: Mapping[str, torch.Tensor],
        pull: Sequence[str],
        end_of_step: bool,
        rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]] = (),
    ) -> tuple[int, list[torch.Tensor]]:
        """One worker request: apply ``grads`` (and the gradients of table
        ``rows``, see :meth:`apply_rows`), count the step, read ``pull``.

        Every name is checked before anything changes. Hold :attr:`lock`
        while using the returned tensors: they are the live variables.

        Returns:
            The global step after the request, and the variables named in ``pull``.
        """
        with self.lock:
            self.check_names(pull)
            self.check_rows(rows)
            self.apply(grads)
            self.apply_rows(rows)
            step = self.advance_step() if end_of_step else self.global_step
            return step, self.read(pull)

    def read(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The live variables named; valid while the caller holds :attr:`lock`."""
        with self.lock:
            self._require_ready()
            return [self._variable(name).detach() for name in names]

    def advance_step(self) -> int:
        """Count one finished worker step; returns the new global step."""
        with self.lock:
            self.global_step += 1
            return self.global_step

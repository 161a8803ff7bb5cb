"""The variables a ps task holds, and the optimizers that update them.

Plain torch, no network: the servicer translates requests into calls here.
A store is empty until the chief creates its variables, then ready::

    EMPTY --create()--> READY --apply()/read()--> READY

Updates are all-or-nothing: every gradient of a push is checked against its
variable before any variable changes, so a bad push leaves the store as it
was.

Embedding tables are variables too, updated row by row: a push carries the
ids of the rows it touched and their gradients (:meth:`VariableStore.apply_rows`),
a pull names the rows it wants (:meth:`VariableStore.read_rows`), and a
second optimizer, one that takes sparse gradients
(:mod:`psframe.optim.rows_kernels`), updates them.

The store is made of parts that each own their state: the model the chief
created (:class:`~psframe.ps.store.store_model.StoreModel`: the dense variables
with their optimizer, the embedding tables with theirs) and the memory it
lives in (a :class:`psframe.memory.Memory` policy it is given). The store adds
what spans them: the lock, the counters, checking a whole request before
any part changes, and the state a checkpoint keeps.

The parts are the modules of this package: :mod:`~psframe.ps.store.store_model`,
:mod:`~psframe.ps.store.optimized_variables` (dense variables and their
optimizer), :mod:`~psframe.ps.store.table_parts` (table parts, row by row),
:mod:`~psframe.ps.store.row_versions` and :mod:`~psframe.ps.store.changes`
(what changed since a snapshot: row caches and delta checkpoints read them).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from psframe.errors import (
    CheckpointError,
    DtypeMismatchError,
    InvalidGradientError,
    NotReadyError,
    PsframeError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psframe.memory import Memory
from psframe.optim import OptimizerSpec
from psframe.ps.store.changes import Changes
from psframe.ps.store.optimized_variables import OptimizedVariables
from psframe.ps.store.store_model import StoreModel
from psframe.ps.store.table_parts import DynamicPart, RowPush

# Generations of variables, unique in the process (see VariableStore.generation).
_GENERATIONS = itertools.count(1)


@dataclass(frozen=True)
class StoreChanges:
    """Copies of what changed in a store since a checkpoint (:meth:`VariableStore.changes_since`)."""

    global_step: int
    values: dict[str, torch.Tensor]  # dense variables changed, whole
    states: dict[str, dict[str, Any]]  # and their optimizer state
    rows: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]  # fixed table part -> (rows, values, state)
    dynamic: dict[str, dict[str, Any]]  # dynamic table part -> DynamicRows.export_changes


def _memory_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """What a tensor is, as memory: two with the same key are views of the same bytes, alike."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


class VariableStore:
    """Variables plus a ``torch.optim`` optimizer over them.

    Callers that read variables while others may push hold :attr:`lock`
    around both, so that what they read is one consistent version.

    A ps task served from several processes gives every process's store the
    same lock, counters and memory (:mod:`psframe.ps.serving.shared_store`): their variables
    and optimizer state are then one, in shared memory.

    Args:
        task_name: the task name used in error messages, e.g. ``/job:ps/task:0``.
        lock: a reentrant lock; one of this process's by default.
        counters: global step, applied pushes, refused pushes and the count the fixed
            table rows' versions are stamped from (:mod:`psframe.ps.store.row_versions`), as
            an int64 array of 4; this process's own by default.
        memory: where the variables and their optimizer state live, a
            :class:`psframe.memory.Memory`: this process's memory, plain torch,
            by default; a ps task's service gives huge pages
            (:class:`~psframe.memory.HugePageMemory`) or the task's shared
            memory (:class:`~psframe.ps.serving.store_memory.SharedStoreMemory`).
    """

    def __init__(
        self,
        task_name: str = "this ps task",
        *,
        lock: Any = None,
        counters: numpy.ndarray | None = None,
        memory: Memory | None = None,
    ) -> None:
        self.task_name = task_name
        self.lock = lock if lock is not None else threading.RLock()
        self._counters = counters if counters is not None else numpy.zeros(4, dtype=numpy.int64)
        self._memory = memory if memory is not None else Memory()
        self._model = StoreModel(task_name)  # made anew by create() and adopt()
        # The model clear() let go of (a re-layout's cut): create() takes over what it keeps of it.
        self._let_go: StoreModel | None = None
        self._ready = False
        # Bumped whenever a variable's value changes: two reads under the lock
        # that see the same version read the same values.
        self.version = 0
        # Changes whenever the variables are made anew (create, adopt): what was
        # checked against one generation's variables (a cached request, views of
        # them) holds until it changes. Unique among the stores of a process.
        self.generation = 0
        # Stamps of what changed, for delta checkpoints; updates made by other processes
        # sharing the memory (`counters` given) are not seen here.
        self._changes = Changes(complete=counters is None)
        self._dense_names: dict[int, str] = {}  # id of a dense variable -> its name
        self._fixed_names: dict[int, str] = {}  # id of a fixed table part -> its name

    # Counted in an array that several processes may share (see `counters`).
    @property
    def global_step(self) -> int:
        return int(self._counters[0])

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._counters[0] = value

    @property
    def pushes(self) -> int:
        return int(self._counters[1])

    @pushes.setter
    def pushes(self, value: int) -> None:
        self._counters[1] = value

    @property
    def rejected_pushes(self) -> int:
        return int(self._counters[2])

    @rejected_pushes.setter
    def rejected_pushes(self, value: int) -> None:
        self._counters[2] = value

    # ---- creation

    @property
    def ready(self) -> bool:
        """Whether the variables exist."""
        return self._ready

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        """The dense variables' optimizer; None before the variables exist."""
        return self._model.optimizer_spec

    @property
    def table_optimizer_spec(self) -> OptimizerSpec | None:
        """The embedding tables' optimizer; None when the store holds no table."""
        return self._model.table_parts.optimizer_spec

    @property
    def tables(self) -> frozenset[str]:
        """The names of the variables that are embedding tables."""
        return self._model.table_parts.fixed_names

    @property
    def dynamic_tables(self) -> frozenset[str]:
        """The names of the dynamic tables' parts this store holds."""
        return self._model.table_parts.dynamic_names

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
        """Create the variables and the optimizers.

        Creating again with the same names, shapes, dtypes and optimizer is a
        no-op (the chief restarted, or the store was restored); anything else
        is refused.

        Args:
            values: the variables' initial values, by name.
            optimizer: the dense variables' optimizer.
            copy: copy ``values`` into the store's memory; without, the
                tensors are used as they are (from :meth:`copy_in` or
                :meth:`empty`, where the store has memory of its own). After
                :meth:`clear`, a value that is a variable of the model let go
                of (its memory, shape and dtype) is that variable again, and
                the optimizers of that model carry on over the new one's
                (a re-layout's step costs the parts that move, not all).
            tables: the variables that are embedding tables, updated by ``table_optimizer``.
            table_optimizer: the tables' optimizer, one that takes sparse gradients.
            dynamic: the parts of dynamic tables, which start empty (:mod:`psframe.tables.dynamic_rows`).

        Returns:
            True if the variables were created, False if they already existed.

        Raises:
            ClusterMismatchError: the store already holds a different model,
                or tables are given without a table optimizer.
            UnknownVariableError: a table is not among ``values``.
        """
        with self.lock:
            dynamic = dict(dynamic or {})
            if self.ready:
                self._model.check_same(values, optimizer, tables, table_optimizer, dynamic)
                return False
            previous, self._let_go = self._let_go, None
            held = {}
            if previous is not None and not copy:  # an empty tensor has no memory of its own to know it by
                held = {_memory_key(v): v for v in previous.variables().values() if v.numel()}
            variables = {}
            for name, value in values.items():
                if copy:
                    variable = self.copy_in(value)
                elif value.numel() and _memory_key(value) in held:
                    variable = held[_memory_key(value)]  # kept across a re-layout: the one its optimizer knows
                else:  # made by copy_in or empty already, or a tensor of the request
                    variable = value.detach().to("cpu").contiguous()
                    self._memory.keep(variable)
                variable.requires_grad_(variable.is_floating_point() or variable.is_complex())
                variables[name] = variable
            self._build(
                StoreModel(
                    self.task_name,
                    variables,
                    optimizer,
                    tables,
                    table_optimizer,
                    dynamic,
                    self._memory,
                    self._counters[3:4],
                    previous=previous if held else None,
                )
            )
            self.version += 1
            self.generation = next(_GENERATIONS)
            return True

    def adopt(
        self,
        values: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]],
        optimizer: OptimizerSpec,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
        row_versions: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Take variables and optimizer state that live elsewhere (shared memory) as this store's own.

        The tensors are used as they are, not copied: updates through this
        store and through every other store over them are one. So are
        ``row_versions``, the fixed table rows' versions (:mod:`psframe.ps.store.row_versions`).
        """
        with self.lock:
            variables = {
                name: value.requires_grad_(value.is_floating_point() or value.is_complex())
                for name, value in values.items()
            }
            model = StoreModel(
                self.task_name,
                variables,
                optimizer,
                tables,
                table_optimizer,
                memory=self._memory,
                version_count=self._counters[3:4],
                versions=row_versions,
            )
            self._build(model)
            # After _build, whose memory looks after new optimizer state: shared state is taken as it is.
            for name, state in states.items():
                if state:
                    self._model.set_state(name, dict(state))
            self.version += 1
            self.generation = next(_GENERATIONS)

    def clear(self) -> None:
        """Drop the variables and their optimizers (a live re-layout moved them elsewhere):
        the store is not ready until created again. Requests cached on the variables no longer
        hold. The next :meth:`create` takes over what it keeps of them."""
        with self.lock:
            self._let_go = self._model if self._ready else None
            self._model = StoreModel(self.task_name)
            self._dense_names, self._fixed_names = {}, {}
            self._ready = False
            self.version += 1
            self.generation = next(_GENERATIONS)

    def _build(self, model: StoreModel) -> None:
        """Hold ``model``, its optimizers' state looked after by the store's memory."""
        for group in model.groups:
            self._memory.back_state(group.optimizer)
        self._model = model
        self._dense_names = {id(model.dense.get(name)): name for name in model.dense}
        fixed = model.table_parts.fixed
        self._fixed_names = {id(fixed.get(name)): name for name in fixed}
        self._changes = Changes(complete=self._changes.complete)  # new variables: no snapshot holds them
        self._ready = True

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised memory for a variable, in the store's memory
        (see ``memory``)."""
        return self._memory.empty(dtype, shape)

    def copy_in(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` in the store's memory (see ``memory``)."""
        return self._memory.copy_in(value)

    # ---- the hot path

    @property
    def names(self) -> list[str]:
        """Every variable's name, dense or fixed table, in the order created (dynamic parts aside)."""
        return list(self._model.names)

    def _require_ready(self) -> None:
        if not self.ready:
            raise NotReadyError(f"{self.task_name} holds no variables yet: the chief has not created them")

    def check_names(self, names: Sequence[str]) -> None:
        """Raise unless every name is a variable of this store."""
        with self.lock:
            self._require_ready()
            for name in names:
                self._model.variable(name)

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
            variable = self._model.dense.get(name)
            if variable is None:
                self._model.variable(name)  # names what this store holds
                raise InvalidGradientError(
                    f"{name!r} on {self.task_name} is an embedding table: it takes the rows a batch touched "
                    f"(ids and rows), not a whole gradient; nothing was applied"
                )
            if grad.dtype != variable.dtype:
                raise DtypeMismatchError(
                    f"gradient for {name!r} has dtype {grad.dtype} but the variable on "
                    f"{self.task_name} has dtype {variable.dtype}; nothing was applied"
                )
            if grad.shape != variable.shape:
                raise ShapeMismatchError(
                    f"gradient for {name!r} has shape {tuple(grad.shape)} but the variable on "
                    f"{self.task_name} has shape {tuple(variable.shape)}; nothing was applied"
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
                variable = self._model.get(name)
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
            self._step(self._model.dense, [self._model.variable(name) for name in grads], list(grads.values()))

    def _step(
        self, group: OptimizedVariables, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> None:
        """One step of ``group``'s optimizer with these gradients; counts a push."""
        dense = group is self._model.dense
        stateless = [] if dense else [t for t in variables if not group.state_of(t)]
        try:
            group.step(variables, grads, self._memory)
        finally:
            self.version += 1  # even a step that failed halfway may have changed some
            self._stamp(group, variables, grads, stateless)
        self.pushes += 1

    def _step_rows(self, rows: Sequence[RowPush]) -> bool:
        """The fixed tables' step on their pushed rows as they came, where the table optimizer's
        row kernel takes it (no sparse gradient made); counts a push. False: nothing changed."""
        parts = self._model.table_parts
        work = [(parts.fixed.get(name), ids, values) for name, ids, values in rows]  # checked: fixed tables
        taken = True  # until it says otherwise: a step that failed halfway may have changed some rows
        try:
            taken = parts.fixed.step_rows(work)  # type: ignore[arg-type]
        finally:
            if taken:
                self.version += 1
                for name, ids, _ in rows:
                    parts.versions.touch(name, ids)
        if taken:
            self.pushes += 1
        return taken

    def _stamp(
        self,
        group: OptimizedVariables,
        variables: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        stateless: Sequence[torch.Tensor],
    ) -> None:
        """Note what a step changed, for delta checkpoints and row caches: dense variables whole,
        a fixed table's rows (all of them where the step made the table's optimizer state,
        ``stateless`` before), with a new version (:mod:`psframe.ps.store.row_versions`)."""
        if group is self._model.dense:
            self._changes.dense_changed(self._dense_names[id(v)] for v in variables)
            return
        names = self._fixed_names
        made_state = {id(t) for t in stateless if group.state_of(t)}
        versions = self._model.table_parts.versions
        for table, grad in zip(variables, grads):
            if id(table) in made_state:
                versions.touch_whole(names[id(table)])
            else:
                versions.touch(names[id(table)], grad.indices()[0])

    def variables(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The live variables named (those :meth:`update` takes); hold :attr:`lock` while using them."""
        with self.lock:
            self._require_ready()
            return [self._model.variable(name) for name in names]

    def update(self, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], end_of_step: bool) -> int:
        """:meth:`push_pull` without its checks, for gradients already checked
        against these dense variables of the current :attr:`generation` (a
        cached request's); the caller holds :attr:`lock`.

        Returns:
            The global step after the request.
        """
        if grads:
            self._step(self._model.dense, variables, grads)
            if end_of_step:
                return self.advance_step()
        return self.global_step

    def push_pull(
        self,
        grads: Mapping[str, torch.Tensor],
        pull: Sequence[str],
        end_of_step: bool,
        rows: Sequence[RowPush] = (),
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
            variable = self._model.variable
            return [variable(name).detach() for name in names]

    def advance_step(self) -> int:
        """Count one finished worker step; returns the new global step."""
        with self.lock:
            self.global_step += 1
            return self.global_step

    # ---- embedding tables, row by row

    def _require_table(self, name: str) -> None:
        if name not in self._model.table_parts:
            self._model.variable(name)  # names what this store holds
            raise UnknownVariableError(
                f"{name!r} on {self.task_name} is not an embedding table; "
                "its rows cannot be pulled or pushed one by one"
            )

    def check_rows(self, rows: Sequence[RowPush]) -> None:
        """Raise unless every ``(table, ids, gradient rows)`` fits its table; changes
        nothing but the count of rejected pushes."""
        with self.lock:
            try:
                self._require_ready()
                for name, ids, values in rows:
                    self._require_table(name)
                    self._model.table_parts.check_push(name, ids, values)
            except PsframeError:
                self.rejected_pushes += 1
                raise

    def apply_rows(self, rows: Sequence[RowPush]) -> None:
        """One step of the table optimizer with the gradients of these rows,
        given as ``(table, ids, rows)``: only those rows (and their optimizer
        state) change. A table may appear with no rows: its optimizer still
        counts a step (as one process's would, for a batch that used the table).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError, ShapeMismatchError,
            DtypeMismatchError: nothing was applied.
        """
        with self.lock:
            self.check_rows(rows)
            if not rows:
                return
            parts = self._model.table_parts
            dynamic_names = parts.dynamic_names
            dynamic = [row for row in rows if row[0] in dynamic_names]
            fixed = [row for row in rows if row[0] not in dynamic_names]
            if fixed and not self._step_rows(fixed):
                tables, grads = parts.sparse_gradients(fixed)
                self._step(parts.fixed, tables, grads)
            if dynamic:
                try:
                    parts.apply_dynamic(dynamic)
                finally:
                    self.version += 1
                if not fixed:
                    self.pushes += 1

    def check_row_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``name`` is a table of this store and ``ids`` are rows of it."""
        with self.lock:
            self._require_ready()
            self._require_table(name)
            self._model.table_parts.check_ids(name, ids)

    def read_rows(self, name: str, ids: torch.Tensor, create: bool = True) -> torch.Tensor:
        """A copy of rows ``ids`` of table ``name``. A dynamic table makes the
        rows of ids it does not hold, unless not ``create`` (then it gives
        their initial values and keeps nothing).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError.
        """
        with self.lock:
            self.check_row_ids(name, ids)
            return self._model.table_parts.read(name, ids, create)

    def read_rows_since(
        self, name: str, ids: torch.Tensor, create: bool, cached: torch.Tensor, staleness: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For a worker's row cache: the version of each id's row of table ``name``, and copies
        of the rows it must get again (:func:`psframe.tables.rows.to_refresh` of ``cached``, its versions).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError.
        """
        with self.lock:
            self.check_row_ids(name, ids)
            return self._model.table_parts.read_since(name, ids, create, cached, staleness)

    # ---- the state taken whole: accounting, checkpoints, shared memory

    def nbytes(self) -> int:
        """Bytes of the variables plus the optimizers' tensor state."""
        with self.lock:
            return self._model.nbytes()

    def optimizer_state(self) -> dict[str, dict[str, Any]] | None:
        """Each variable's live optimizer state (empty for a stateless optimizer such as
        plain SGD); None while some variable has none yet, before its first update."""
        with self.lock:
            self._require_ready()
            state = {name: self._model.state_of(name) for name in self._model.names}
            for group in self._model.groups:  # the dense variables' optimizer, and the tables'
                made = [state[name] for name in group]
                # No state at all is stateless only once an update went through without making any.
                if not all(made) and (any(made) or not group.stepped):
                    return None
            return {name: dict(s or {}) for name, s in state.items()}

    def row_versions(self) -> dict[str, torch.Tensor]:
        """The fixed table rows' versions, by table part (:mod:`psframe.ps.store.row_versions`), as they are."""
        with self.lock:
            return self._model.table_parts.versions.tensors

    def share_state(self) -> None:
        """Move the optimizers' state where the store's memory keeps state (shared memory),
        in place: the optimizers go on with the same values, now where other processes map them.

        State already there stays. The private memory of each variable's
        state is given back to the OS once moved (:func:`psframe.memory.malloc.trim`):
        the heap would keep it resident, and the task would hold its state twice.
        """
        with self.lock:
            for name in self._model.names:
                self._memory.place_state(self._model.state_of(name))

    def snapshot(self, *, copy: bool = True) -> tuple[int, dict[str, torch.Tensor], dict[str, dict]]:
        """Copies of the global step, the variables and each one's optimizer state; without
        ``copy``, the store's own tensors (for a caller that makes the store let go of them)."""
        with self.lock:
            self._require_ready()
            values, states = self._model.copies(clone=copy)
            return self.global_step, values, states

    def live_copies(self, names: Sequence[str]) -> tuple[dict[str, torch.Tensor], dict[str, dict], int]:
        """Copies of variables ``names`` and of their optimizer state, and the fixed table rows'
        version count at that instant (:meth:`RowVersions.mark`): a row changed after it has a
        higher version. Call it under :attr:`lock` to read more of the same instant.

        Raises:
            NotReadyError: the store holds no model.
            UnknownVariableError: a name it does not hold.
        """
        with self.lock:
            self._require_ready()
            self.check_names(names)
            values, states = self._model.copies(list(names))
            return values, states, self._model.table_parts.versions.mark()

    def restore(
        self,
        values: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping],
        global_step: int,
        *,
        copy: bool = True,
    ) -> None:
        """Overwrite variables, optimizer state and global step (from a checkpoint).

        Everything is checked before anything changes. Without ``copy`` the state
        tensors are taken as they are (nothing else holds them).

        Raises:
            UnknownVariableError, ShapeMismatchError, DtypeMismatchError.
        """
        with self.lock:
            self._check_gradients(values)  # same rules: known name, same shape and dtype
            self.version += 1
            for name, value in values.items():
                with torch.no_grad():
                    self._model.variable(name).copy_(value)
            for name, state in states.items():
                if not copy:
                    self._model.set_state(name, dict(state))
                    self._memory.place_state(self._model.state_of(name))
                    continue
                self._model.set_state(
                    name,
                    {k: self._memory.copy_state(x) if isinstance(x, torch.Tensor) else x for k, x in state.items()},
                )
            self._model.table_parts.versions.touch_all()  # rows workers cached are of before the restore
            self.global_step = global_step

    def dynamic_counts(self) -> dict[str, dict[str, int]]:
        """Each dynamic table part's rows held and ids admitted, filtered and evicted, by name."""
        with self.lock:
            return self._model.table_parts.dynamic_counts()

    def mark_snapshot(self, step: int) -> None:
        """The store as it is now is checkpoint ``step``'s (just saved, or restored): a delta from
        ``step`` holds what changes after this. Call it under :attr:`lock`, with the snapshot."""
        with self.lock:
            self._changes.snapshot(step, self._model.table_parts.versions.mark())
            self._model.table_parts.close_epoch(self._changes.epoch, self._changes.oldest())

    def changes_since(self, step: int) -> StoreChanges:
        """Copies of what changed since checkpoint ``step`` (see :meth:`mark_snapshot`).

        Raises:
            CheckpointError: this store holds no snapshot of ``step`` (it was
                made anew or restarted since, or the step is too old): the
                delta needs a full checkpoint instead.
        """
        with self.lock:
            self._require_ready()
            epoch = self._changes.epoch_of(step)
            if epoch is None:
                raise CheckpointError(
                    f"{self.task_name} has no snapshot of checkpoint step {step} to write a delta from "
                    f"(its variables were made or restored since, or the step is too old); save a full checkpoint"
                )
            values, states = self._model.copies(self._changes.dense_since(epoch, list(self._model.dense)))
            rows = {}
            mark, versions = self._changes.row_mark(epoch), self._model.table_parts.versions
            for name in sorted(self._model.table_parts.fixed_names):
                index = versions.changed_since(name, mark)
                rows[name] = (index, *self._model.row_copies(name, index))
            dynamic = self._model.table_parts.export_dynamic_changes(epoch)
            return StoreChanges(self.global_step, values, states, rows, dynamic)

    def export_dynamic(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps of each dynamic table part (:meth:`DynamicRows.export`)."""
        with self.lock:
            return self._model.table_parts.export_dynamic()

    def load_dynamic(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Refill dynamic table parts from a checkpoint's exports (the parts start over empty)."""
        with self.lock:
            self._model.table_parts.load_dynamic(saved)
            self.version += 1

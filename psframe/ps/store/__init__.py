"""The variables a ps task holds, and the optimizers that update them: :class:`VariableStore`.

Plain torch, no network: the servicer translates requests into calls here.
A store is empty until the chief creates its variables, then ready::

    EMPTY --create()--> READY --apply()/read()--> READY

Updates are all-or-nothing: every gradient of a push is checked against its
variable before any variable changes, so a bad push leaves the store as it
was. Embedding tables are variables too, updated row by row
(:meth:`VariableStore.apply_rows`, :meth:`VariableStore.read_rows`) by a
second optimizer, one that takes sparse gradients (:mod:`psframe.optim.rows_kernels`).

The store is a facade over parts that each own their state, the modules of
this package; it adds what spans them: the lock, and the order of things.

- :mod:`~psframe.ps.store.store_model`: the model the chief created, the dense
  variables with their optimizer (:mod:`~psframe.ps.store.optimized_variables`)
  and the table parts with theirs (:mod:`~psframe.ps.store.table_parts`),
  made in the store's memory (:mod:`~psframe.ps.store.model_maker`);
- :mod:`~psframe.ps.store.request_checks`: whether a request fits the model;
- :mod:`~psframe.ps.store.optimized_variables`: the optimizers' steps a push makes;
- :mod:`~psframe.ps.store.counters`: the global step, pushes and versions;
- :mod:`~psframe.ps.store.changes` and :mod:`~psframe.ps.store.row_versions`:
  what changed since a snapshot (delta checkpoints and a re-layout's precopy read them);
- :mod:`~psframe.ps.store.snapshots`: the state taken whole and put back.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy
import torch

from psframe.memory import Memory
from psframe.optim import OptimizerSpec
from psframe.ps.store import snapshots
from psframe.ps.store.changes import ChangeLog, StoreChanges
from psframe.ps.store.counters import GLOBAL_STEP, StoreCounts
from psframe.ps.store.model_maker import ModelMaker
from psframe.ps.store.optimized_variables import ModelUpdates
from psframe.ps.store.request_checks import RequestChecks, widened
from psframe.ps.store.schedules import ModelSchedules
from psframe.ps.store.store_model import StoreModel
from psframe.ps.store.table_parts import DynamicPart, RowPush

# Generations of variables, unique in the process (see VariableStore.generation).
_GENERATIONS = itertools.count(1)


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
            table rows' versions are stamped from, as an int64 array of 4
            (:mod:`psframe.ps.store.counters`); this process's own by default.
        memory: where the variables and their optimizer state live (:class:`psframe.memory.Memory`):
            plain torch by default; a ps task's service gives huge pages
            (:class:`~psframe.memory.HugePageMemory`) or the task's shared memory.
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
        self._counts = StoreCounts(counters)
        self._memory = memory if memory is not None else Memory()
        self._maker = ModelMaker(task_name, self._memory, self._counts, self.lock)
        self._model = self._maker.empty()  # made anew by create() and attach_shared()
        # The model clear() let go of (a re-layout's cut): create() takes over what it keeps of it.
        self._let_go: StoreModel | None = None
        self._ready = False
        # Changes whenever the variables are made anew (create, attach_shared): what was
        # checked against one generation's variables (a cached request, views of
        # them) holds until it changes. Unique among the stores of a process.
        self.generation = 0
        # Stamps of what changed, for delta checkpoints; updates made by other processes
        # sharing the memory (`counters` given) are not seen here.
        self._changes = ChangeLog(self._model, complete=counters is None)
        self._updates = ModelUpdates(self._model, self._memory, self._changes, self._counts)
        self._checks = RequestChecks(task_name, None, self._counts)

    # ---- counts (psframe.ps.store.counters)

    @property
    def global_step(self) -> int:
        """Worker steps finished (counted with every process serving the task)."""
        return self._counts.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self._counts.global_step = value

    @property
    def pushes(self) -> int:
        """Pushes applied."""
        return self._counts.pushes

    @property
    def rejected_pushes(self) -> int:
        """Pushes refused (nothing of them was applied)."""
        return self._counts.rejected_pushes

    @property
    def version(self) -> int:
        """Bumped whenever a variable's value changes: two reads under the lock that see the
        same version read the same values."""
        return self._counts.version

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
    def schedules(self) -> ModelSchedules:
        """The optimizers' learning-rate schedules (:mod:`psframe.ps.store.schedules`); use under :attr:`lock`."""
        return self._model.schedules

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

        Creating again with the same names, shapes, dtypes and optimizer is a no-op (the chief
        restarted, or the store was restored); anything else is refused.

        Args:
            values: the variables' initial values, by name.
            optimizer: the dense variables' optimizer.
            copy: copy ``values`` into the store's memory; without, the tensors are used as they are
                (from :meth:`copy_in` or :meth:`empty`), and after :meth:`clear` a variable of the model
                let go of is taken over (:func:`~psframe.ps.store.model_maker.placed`).
            tables: the variables that are embedding tables, updated by ``table_optimizer``.
            table_optimizer: the tables' optimizer, one that takes sparse gradients.
            dynamic: the parts of dynamic tables, which start empty (:mod:`psframe.tables.dynamic_rows`).

        Returns:
            True if the variables were created, False if they already existed.

        Raises:
            ClusterMismatchError: the store holds a different model, or tables lack a table optimizer.
            UnknownVariableError: a table is not among ``values``.
        """
        with self.lock:
            dynamic = dict(dynamic or {})
            if self.ready:
                self._model.check_same(values, optimizer, tables, table_optimizer, dynamic)
                return False
            let_go, self._let_go = self._let_go, None
            self._hold(
                self._maker.created(values, optimizer, tables, table_optimizer, dynamic, copy=copy, let_go=let_go)
            )
            return True

    def attach_shared(
        self,
        values: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]],
        optimizer: OptimizerSpec,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
        row_versions: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Take variables and optimizer state that live elsewhere (shared memory) as this store's own.

        The tensors are used as they are, not copied: updates through this store and through every
        other store over them are one. So are ``row_versions``, the fixed table rows' versions.
        """
        with self.lock:
            self._hold(self._maker.attached_shared(values, states, optimizer, tables, table_optimizer, row_versions))

    def clear(self) -> None:
        """Drop the variables and their optimizers (a live re-layout moved them elsewhere):
        the store is not ready until created again. Requests cached on the variables no longer
        hold. The next :meth:`create` takes over what it keeps of them."""
        with self.lock:
            self._let_go = self._model if self._ready else None
            self._hold(self._maker.empty(), ready=False)

    def _hold(self, model: StoreModel, *, ready: bool = True) -> None:
        """Hold ``model`` from now on: requests cached on the variables before no longer hold."""
        self._model = model
        self._changes = ChangeLog(model, complete=self._changes.complete)  # new variables: no snapshot holds them
        self._updates = ModelUpdates(model, self._memory, self._changes, self._counts)
        self._checks = RequestChecks(self.task_name, model if ready else None, self._counts)
        self._ready = ready
        self._counts.version += 1
        self.generation = next(_GENERATIONS)

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Uninitialised memory for a variable, in the store's memory (see ``memory``)."""
        return self._memory.empty(dtype, shape)

    def copy_in(self, value: torch.Tensor) -> torch.Tensor:
        """A copy of ``value`` in the store's memory (see ``memory``)."""
        return self._memory.copy_in(value)

    # ---- the hot path

    @property
    def names(self) -> list[str]:
        """Every variable's name, dense or fixed table, in the order created (dynamic parts aside)."""
        return list(self._model.names)

    def check_names(self, names: Sequence[str]) -> None:
        """Raise unless every name is a variable of this store."""
        with self.lock:
            self._checks.names(names)

    def check_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raise if any gradient does not fit its variable; changes nothing but the count of rejected pushes."""
        with self.lock:
            self._checks.gradients(grads)

    def widen(self, grads: Mapping[str, torch.Tensor], wire_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Gradients that travelled compressed in ``wire_dtype``, converted back to their variable's
        dtype; any other is returned as given (:func:`~psframe.ps.store.request_checks.widened`)."""
        with self.lock:
            return widened(self._model, grads, wire_dtype)

    def apply(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Apply one optimizer step with these gradients.

        Variables without a gradient in ``grads`` are left alone (torch.optim skips parameters whose
        ``grad`` is None). The gradient tensors are only read.

        Raises:
            NotReadyError, UnknownVariableError, ShapeMismatchError,
            DtypeMismatchError: nothing was applied.
        """
        with self.lock:
            self.check_gradients(grads)
            if not grads:
                return
            self._updates.step(self._model.dense, [self._model.variable(name) for name in grads], list(grads.values()))

    def variables(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The live variables named (those :meth:`update` takes); hold :attr:`lock` while using them."""
        with self.lock:
            variable = self._checks.ready().variable
            return [variable(name) for name in names]

    def update(self, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], end_of_step: bool) -> int:
        """:meth:`push_pull` without its checks, for gradients already checked against these dense
        variables of the current :attr:`generation` (a cached request's); the caller holds :attr:`lock`.

        Returns:
            The global step after the request.
        """
        counts = self._counts.array  # counted in place: this runs for every push
        if grads:
            self._updates.step(self._model.dense, variables, grads)
            if end_of_step:
                counts[GLOBAL_STEP] += 1
        return int(counts[GLOBAL_STEP])

    def push_pull(
        self,
        grads: Mapping[str, torch.Tensor],
        pull: Sequence[str],
        end_of_step: bool,
        rows: Sequence[RowPush] = (),
    ) -> tuple[int, list[torch.Tensor]]:
        """One worker request: apply ``grads`` (and the gradients of table ``rows``, see
        :meth:`apply_rows`), count the step, read ``pull``. Every name is checked before anything
        changes. Hold :attr:`lock` while using the returned tensors: they are the live variables.

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
            variable = self._checks.ready().variable
            return [variable(name).detach() for name in names]

    def advance_step(self) -> int:
        """Count one finished worker step; returns the new global step."""
        with self.lock:
            self.global_step += 1
            return self.global_step

    # ---- embedding tables, row by row

    def check_rows(self, rows: Sequence[RowPush]) -> None:
        """Raise unless every ``(table, ids, gradient rows)`` fits its table; changes nothing but the
        count of rejected pushes."""
        with self.lock:
            self._checks.rows(rows)

    def apply_rows(self, rows: Sequence[RowPush]) -> None:
        """One step of the table optimizer with the gradients of these rows, given as ``(table, ids,
        rows)``: only those rows (and their optimizer state) change. A table may appear with no rows:
        its optimizer still counts a step (as one process's would, for a batch that used the table).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError, ShapeMismatchError,
            DtypeMismatchError: nothing was applied.
        """
        with self.lock:
            self.check_rows(rows)
            if rows:
                self._updates.rows(rows)

    def check_row_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``name`` is a table of this store and ``ids`` are rows of it."""
        with self.lock:
            self._checks.row_ids(name, ids)

    def read_rows(self, name: str, ids: torch.Tensor, create: bool = True) -> torch.Tensor:
        """A copy of rows ``ids`` of table ``name``. A dynamic table makes the rows of ids it does not
        hold, unless not ``create`` (then it gives their initial values and keeps nothing).

        Raises:
            NotReadyError, UnknownVariableError, RowIdError.
        """
        with self.lock:
            self.check_row_ids(name, ids)
            return self._model.table_parts.read(name, ids, create)

    # ---- the state taken whole: accounting, checkpoints, shared memory

    def nbytes(self) -> int:
        """Bytes of the variables plus the optimizers' tensor state."""
        with self.lock:
            return self._model.nbytes()

    def optimizer_state(self) -> dict[str, dict[str, Any]] | None:
        """Each variable's live optimizer state (empty for a stateless optimizer such as plain SGD);
        None while some variable has none yet, before its first update."""
        with self.lock:
            return snapshots.optimizer_state(self._checks.ready())

    def row_versions(self) -> dict[str, torch.Tensor]:
        """The fixed table rows' versions, by table part (:mod:`psframe.ps.store.row_versions`), as they are."""
        with self.lock:
            return self._model.table_parts.versions.tensors

    def share_state(self) -> None:
        """Move the optimizers' state where the store's memory keeps state (shared memory), in place
        (:func:`~psframe.ps.store.snapshots.share_state`)."""
        with self.lock:
            snapshots.share_state(self._model, self._memory)

    def snapshot(self, *, copy: bool = True) -> tuple[int, dict[str, torch.Tensor], dict[str, dict]]:
        """Copies of the global step, the variables and each one's optimizer state; without
        ``copy``, the store's own tensors (for a caller that makes the store let go of them)."""
        with self.lock:
            values, states = snapshots.copies(self._checks.ready(), clone=copy)
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
            self._checks.names(names)
            values, states = snapshots.copies(self._model, list(names))
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

        Everything is checked before anything changes. Without ``copy`` the state tensors are taken
        as they are (nothing else holds them).

        Raises:
            UnknownVariableError, ShapeMismatchError, DtypeMismatchError.
        """
        with self.lock:
            self._checks.fits(values)  # the gradients' rules: known name, same shape and dtype
            self._counts.version += 1
            snapshots.restore(self._model, self._memory, values, states, copy=copy)
            self._changes.restored()  # every row changed: deltas from before hold them all
            self.global_step = global_step

    def dynamic_counts(self) -> dict[str, dict[str, int]]:
        """Each dynamic table part's rows held and ids admitted, filtered and evicted, by name."""
        with self.lock:
            return self._model.table_parts.dynamic_counts()

    def mark_snapshot(self, step: int) -> None:
        """The store as it is now is checkpoint ``step``'s (just saved, or restored): a delta from
        ``step`` holds what changes after this. Call it under :attr:`lock`, with the snapshot."""
        with self.lock:
            self._changes.mark(step)

    def changes_since(self, step: int) -> StoreChanges:
        """Copies of what changed since checkpoint ``step`` (see :meth:`mark_snapshot`).

        Raises:
            CheckpointError: no snapshot of ``step`` is held (see :meth:`~psframe.ps.store.changes.ChangeLog.since`).
        """
        with self.lock:
            self._checks.ready()
            return self._changes.since(step, self.global_step)

    def export_dynamic(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint keeps of each dynamic table part (:meth:`DynamicRows.export`)."""
        with self.lock:
            return self._model.table_parts.export_dynamic()

    def load_dynamic(self, saved: Mapping[str, Mapping[str, Any]]) -> None:
        """Refill dynamic table parts from a checkpoint's exports (the parts start over empty)."""
        with self.lock:
            self._model.table_parts.load_dynamic(saved)
            self._counts.version += 1

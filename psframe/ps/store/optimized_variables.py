"""Named variables with the ``torch.optim`` optimizer that updates them, and how a push steps them.

The model a ps task holds (:class:`~psframe.ps.store.store_model.StoreModel`) has
two groups of :class:`OptimizedVariables`: its dense variables, which gradients
update whole, and its fixed embedding tables (:mod:`psframe.ps.store.table_parts`),
whose optimizer takes sparse gradients.

:class:`ModelUpdates` takes the steps a push makes on a model whose gradients
the store checked already. A push's dense gradients are one step of the
dense variables' optimizer. Its table rows are one step of the table
optimizer: on the rows as they came, where the optimizer's row kernel takes
them (:func:`psframe.optim.kernels.step_rows`), else with a sparse gradient
of each table; and one step of each dynamic table part's own optimizer. It
notes what each step changed in the store's
:class:`~psframe.ps.store.changes.ChangeLog` and counts it in the store's
:class:`~psframe.ps.store.counters.StoreCounts`: the variables' version moves
on even for a step that failed halfway (it may have changed some), a push
counts once it went through.

Not thread-safe: the store calls them under its lock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from psframe.memory import Memory
from psframe.optim import OptimizerSpec, kernels
from psframe.optim.schedule_clock import ScheduleClock
from psframe.ps.store.counters import PUSHES, StoreCounts
from psframe.tables.rows import RowPush

if TYPE_CHECKING:  # both hold OptimizedVariables: imported for their types only
    from psframe.ps.store.changes import ChangeLog
    from psframe.ps.store.store_model import StoreModel


class OptimizedVariables:
    """Variables by name, plus the optimizer over them (None when there are no variables).

    Args:
        variables: the tensors, used as they are (the store made them).
        optimizer: what optimizer to build over them.
        per_parameter: run the optimizer's per-parameter kernels (sparse
            gradients have no multi-tensor form); see :func:`psframe.optim.kernels.build`.
        previous: the group these variables were held in before (a live re-layout's: some
            parts stay, some go, some come). Where it ran the same optimizer, its optimizer is
            taken over (:meth:`_hand_over`): only the variables new to it cost a build; it
            is not used afterwards.
        schedule: the optimizer's learning-rate schedule, which brings it to the global step's
            rate before each step (:mod:`psframe.ps.store.schedules`); None: none.
    """

    def __init__(
        self,
        variables: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec | None,
        *,
        per_parameter: bool = False,
        previous: OptimizedVariables | None = None,
        schedule: ScheduleClock | None = None,
    ) -> None:
        self._variables = dict(variables)
        self.spec, self.per_parameter = optimizer, per_parameter
        self.schedule, self._scheduled = schedule, -1  # the schedule's version the optimizer is at
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepped = False  # a step went through (a stateless optimizer's state is then complete)
        # The optimizer's states as many as were last put where the memory keeps state: torch
        # makes a variable's state at its first step, and only a step that made some places it.
        self._states_placed = -1
        if not self._variables or optimizer is None:
            return
        if (
            previous is not None
            and previous.optimizer is not None
            and (previous.spec, previous.per_parameter) == (optimizer, per_parameter)
        ):
            self.optimizer = previous._hand_over(list(self._variables.values()))
            self.stepped = previous.stepped
        else:
            self.optimizer = optimizer.build(list(self._variables.values()), per_parameter=per_parameter)

    def _hand_over(self, variables: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """This group's optimizer, changed in place to run over ``variables`` instead, for a group
        that takes it over; this one holds none afterwards.

        The variables it ran over already (the same tensors) keep their place and their state
        as they are. Those it no longer runs over leave it, with their state. Those new to it
        join in parameter groups of their own, built as a new optimizer over them would be
        (:meth:`OptimizerSpec.build`: its multi-tensor groups, the state some optimizers make
        when built). A re-layout then costs what it moves, not what a task holds.
        """
        optimizer = self.optimizer
        assert optimizer is not None and self.spec is not None
        wanted = {id(v) for v in variables}
        groups: list[dict[str, Any]] = []
        held: set[int] = set()
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in wanted]  # by identity: == compares values
            held.update(id(p) for p in group["params"])
            if group["params"]:
                groups.append(group)
        optimizer.param_groups = groups
        for param in [p for p in optimizer.state if id(p) not in wanted]:
            del optimizer.state[param]
        new = [v for v in variables if id(v) not in held]
        if new:
            joining = self.spec.build(new, per_parameter=self.per_parameter)
            optimizer.param_groups.extend(joining.param_groups)
            optimizer.state.update(joining.state)
        self.optimizer = None
        return optimizer

    def __contains__(self, name: object) -> bool:
        return name in self._variables

    def __iter__(self) -> Iterator[str]:
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def get(self, name: str) -> torch.Tensor | None:
        """The variable ``name``; None if this group does not hold it."""
        return self._variables.get(name)

    def state_of(self, variable: torch.Tensor) -> dict[str, Any] | None:
        """The live optimizer state of one of these variables; None before torch made any."""
        return self.optimizer.state.get(variable) if self.optimizer is not None else None

    def set_state(self, variable: torch.Tensor, state: dict[str, Any]) -> None:
        """Make ``state`` the optimizer state of one of these variables."""
        if self.optimizer is None:
            raise ValueError(f"no optimizer holds state here: there are no variables (got state {sorted(state)})")
        self.optimizer.state[variable] = state

    def step(self, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], memory: Memory) -> None:
        """One optimizer step of ``variables`` (some of these) with ``grads``, which are only read.

        State torch makes at the step (a variable's first) goes where ``memory``
        keeps it. The gradients are detached from the variables again, even on failure.
        """
        optimizer = self.optimizer
        if optimizer is None:
            raise ValueError(f"no optimizer to step {len(variables)} variables with: this group holds none")
        if self.schedule is not None:
            self._scheduled = self.schedule.apply(optimizer, self._scheduled)
        for variable, grad in zip(variables, grads):
            variable.grad = grad
        try:
            kernels.step(optimizer, rows=self.per_parameter)  # per-parameter: a table's sparse rows
            self.stepped = True
            state = optimizer.state
            if len(state) != self._states_placed:  # some variable's first step: torch made its state
                for variable in variables:  # placing state placed already leaves it as it is
                    memory.place_state(state.get(variable))
                self._states_placed = len(state)
        finally:
            for variable in variables:
                variable.grad = None

    def step_rows(self, work: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
        """The step of some of these tables on pushed rows, ``(table, ids, gradient rows)``, taken
        on them directly where the optimizer's row kernel takes it (:func:`psframe.optim.kernels.step_rows`).

        Returns:
            True if taken; False if nothing changed (:meth:`step` takes it, with sparse gradients).
        """
        if self.optimizer is None:
            return False
        if self.schedule is not None:
            self._scheduled = self.schedule.apply(self.optimizer, self._scheduled)
        if not kernels.step_rows(self.optimizer, work):
            return False
        self.stepped = True
        return True

    def nbytes(self) -> int:
        """Bytes of the variables plus the optimizer's tensor state."""
        total = sum(v.numel() * v.element_size() for v in self._variables.values())
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        total += value.numel() * value.element_size()
        return total


class ModelUpdates:
    """The steps of ``model``'s optimizers, state made in ``memory``, noted in ``changes``, counted in ``counts``."""

    def __init__(self, model: StoreModel, memory: Memory, changes: ChangeLog, counts: StoreCounts) -> None:
        self._model = model
        self._memory = memory
        self._changes = changes
        self._counts = counts
        # The change log's stamps of dense variables; None where they are not kept (decided once).
        self._dense_stamps = changes.dense_stamps if changes.complete else None

    def step(self, group: OptimizedVariables, variables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """One step of ``group``'s optimizer with these gradients; counts a push."""
        if group is not self._model.dense:
            self._step_tables(group, variables, grads)
            return
        try:
            group.step(variables, grads, self._memory)
        finally:
            self._counts.version += 1  # even a step that failed halfway may have changed some
            stamps = self._dense_stamps
            if stamps is not None:  # a dict write per variable: no call on the way of every push
                epoch = self._changes.epoch
                for variable in variables:
                    stamps[id(variable)] = epoch
        self._counts.array[PUSHES] += 1

    def _step_tables(
        self, group: OptimizedVariables, tables: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> None:
        """:meth:`step` of the fixed tables, with sparse gradients: it notes the rows changed,
        or the whole of a table whose optimizer state the step made."""
        stateless = [t for t in tables if not group.state_of(t)]
        try:
            group.step(tables, grads, self._memory)
        finally:
            self._counts.version += 1
            self._changes.stepped_tables(group, tables, grads, stateless)
        self._counts.array[PUSHES] += 1

    def rows(self, rows: Sequence[RowPush]) -> None:
        """One step of the table optimizer with the gradients of these rows, ``(table, ids, rows)``
        (checked, one at least); counts a push."""
        parts = self._model.table_parts
        dynamic_names = parts.dynamic_names
        dynamic = [row for row in rows if row[0] in dynamic_names]
        fixed = [row for row in rows if row[0] not in dynamic_names]
        if fixed and not self._step_rows(fixed):
            tables, grads = parts.sparse_gradients(fixed)
            self.step(parts.fixed, tables, grads)
        if dynamic:
            try:
                parts.apply_dynamic(dynamic)
            finally:
                self._counts.version += 1
            if not fixed:
                self._counts.array[PUSHES] += 1

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
                self._counts.version += 1
                self._changes.stepped_rows(rows)
        if taken:
            self._counts.array[PUSHES] += 1
        return taken

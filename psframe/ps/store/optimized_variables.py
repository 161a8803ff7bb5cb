"""Named variables and the one ``torch.optim`` optimizer that updates them, with its state.

The model a ps task holds (:class:`~psframe.ps.store.store_model.StoreModel`) has
two such groups: its dense variables, which gradients update whole, and its
fixed embedding tables (:mod:`psframe.ps.store.table_parts`), whose optimizer takes
sparse gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from psframe.memory import Memory
from psframe.optim import OptimizerSpec, kernels
from psframe.optim.schedule_clock import ScheduleClock


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

        State torch makes at the step goes where ``memory`` keeps it. The
        gradients are detached from the variables again, even on failure.
        """
        if self.optimizer is None:
            raise ValueError(f"no optimizer to step {len(variables)} variables with: this group holds none")
        if self.schedule is not None:
            self._scheduled = self.schedule.apply(self.optimizer, self._scheduled)
        for variable, grad in zip(variables, grads):
            variable.grad = grad
        try:
            kernels.step(self.optimizer, rows=self.per_parameter)  # per-parameter: a table's sparse rows
            self.stepped = True
            state = self.optimizer.state
            for variable in variables:  # torch makes some state at a variable's first step
                memory.place_state(state.get(variable))
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

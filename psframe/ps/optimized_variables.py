"""Named variables and the one ``torch.optim`` optimizer that updates them, with its state.

The model a ps task holds (:class:`~psframe.ps.store_model.StoreModel`) has
two such groups: its dense variables, which gradients update whole, and its
fixed embedding tables (:mod:`psframe.ps.table_parts`), whose optimizer takes
sparse gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from psframe import optimizer_kernels
from psframe.memory import Memory
from psframe.optim import OptimizerSpec


class OptimizedVariables:
    """Variables by name, plus the optimizer over them (None when there are no variables).

    Args:
        variables: the tensors, used as they are (the store made them).
        optimizer: what optimizer to build over them.
        per_parameter: run the optimizer's per-parameter kernels (sparse
            gradients have no multi-tensor form); see :func:`psframe.optimizer_kernels.build`.
    """

    def __init__(
        self,
        variables: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec | None,
        *,
        per_parameter: bool = False,
    ) -> None:
        self._variables = dict(variables)
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepped = False  # a step went through (a stateless optimizer's state is then complete)
        if self._variables and optimizer is not None:
            self.optimizer = optimizer.build(list(self._variables.values()), per_parameter=per_parameter)

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
        for variable, grad in zip(variables, grads):
            variable.grad = grad
        try:
            optimizer_kernels.step(self.optimizer)
            self.stepped = True
            state = self.optimizer.state
            for variable in variables:  # torch makes some state at a variable's first step
                memory.place_state(state.get(variable))
        finally:
            for variable in variables:
                variable.grad = None

    def step_rows(self, work: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
        """The step of some of these tables on pushed rows, ``(table, ids, gradient rows)``, taken
        on them directly where the optimizer's row kernel takes it (:func:`psframe.optimizer_kernels.step_rows`).

        Returns:
            True if taken; False if nothing changed (:meth:`step` takes it, with sparse gradients).
        """
        if self.optimizer is None or not optimizer_kernels.step_rows(self.optimizer, work):
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

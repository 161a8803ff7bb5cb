"""The model a ps task holds: its variables by name, grouped by the optimizer that updates them.

What the chief creates on a :class:`~psframe.ps.store.VariableStore`, made
in one go and replaced whole when the store makes its variables anew: the
dense variables with their optimizer
(:class:`~psframe.ps.store.optimized_variables.OptimizedVariables`), the embedding
tables with theirs (:class:`~psframe.ps.store.table_parts.TableParts`), and the
order the variables were created in. The store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy
import torch

from psframe.errors import ClusterMismatchError, UnknownVariableError
from psframe.memory import Memory
from psframe.optim import OptimizerSpec
from psframe.ps.store.optimized_variables import OptimizedVariables
from psframe.ps.store.schedules import ModelSchedules
from psframe.ps.store.table_parts import DynamicPart, TableParts

VariableKey = tuple[str, tuple[int, ...], str]  # name, shape, dtype: what two tasks must agree on


class StoreModel:
    """Variables by name, in two groups, plus the dynamic tables' parts.

    Args:
        task_name: the task name used in error messages, e.g. ``/job:ps/task:0``.
        variables: the store's own tensors, by name, used as they are.
        optimizer: the dense variables' optimizer.
        tables: the variables that are embedding tables, updated by ``table_optimizer``.
        table_optimizer: the tables' optimizer, one that takes sparse gradients.
        dynamic: the parts of dynamic tables, which start empty.
        memory, version_count, versions: see :class:`~psframe.ps.store.table_parts.TableParts`.
        previous: the model these variables were held in before, whose optimizers this one
            takes over (a live re-layout's; see :class:`~psframe.ps.store.optimized_variables.OptimizedVariables`).
        global_step: the store's global step (a one-element array), which the optimizers'
            learning-rate schedules follow (:mod:`psframe.ps.store.schedules`).

    Raises:
        UnknownVariableError: a table is not among ``variables``.
        ClusterMismatchError: tables without a table optimizer.
        OptimizerConfigError: a schedule cannot run here (its function cannot be imported).
    """

    def __init__(
        self,
        task_name: str,
        variables: Mapping[str, torch.Tensor] | None = None,
        optimizer: OptimizerSpec | None = None,
        tables: Sequence[str] = (),
        table_optimizer: OptimizerSpec | None = None,
        dynamic: Mapping[str, DynamicPart] | None = None,
        memory: Memory | None = None,
        version_count: numpy.ndarray | None = None,
        versions: Mapping[str, torch.Tensor] | None = None,
        previous: StoreModel | None = None,
        global_step: numpy.ndarray | None = None,
        lock: Any = None,
    ) -> None:
        variables = variables or {}
        unknown = sorted(set(tables) - set(variables))
        if unknown:
            raise UnknownVariableError(f"{task_name}: tables {unknown} are not among the variables created")
        if (tables or dynamic) and table_optimizer is None:
            raise ClusterMismatchError(
                f"{task_name}: embedding tables {sorted([*tables, *(dynamic or ())])} need a table optimizer"
            )
        self.task_name = task_name
        self.optimizer_spec = optimizer
        self.names = tuple(variables)  # dense and fixed tables, in the order created
        fixed = set(tables)
        self.schedules = ModelSchedules(optimizer, table_optimizer if tables or dynamic else None, global_step)
        self.table_parts: TableParts = TableParts(
            task_name,
            {n: variables[n] for n in tables},
            dynamic,
            table_optimizer,
            memory,
            version_count,
            versions,
            previous=None if previous is None else previous.table_parts.fixed,
            schedule=self.schedules.tables,
            lock=lock,
        )
        self.dense: OptimizedVariables = OptimizedVariables(
            {n: v for n, v in variables.items() if n not in fixed},
            optimizer,
            previous=None if previous is None else previous.dense,
            schedule=self.schedules.dense,
        )

    @property
    def groups(self) -> tuple[OptimizedVariables, OptimizedVariables]:
        """The dense variables and the fixed tables, each with its optimizer."""
        return self.dense, self.table_parts.fixed

    def variables(self) -> dict[str, torch.Tensor]:
        """The variables, dense and fixed tables, by name: the tensors themselves."""
        return {name: self.variable(name) for name in self.names}

    def get(self, name: str) -> torch.Tensor | None:
        """The variable ``name``; None if there is none."""
        variable = self.dense.get(name)
        return variable if variable is not None else self.table_parts.fixed.get(name)

    def variable(self, name: str) -> torch.Tensor:
        """The variable ``name``.

        Raises:
            UnknownVariableError: naming the variables held.
        """
        variable = self.dense.get(name)
        if variable is None:
            variable = self.table_parts.fixed.get(name)
            if variable is None:
                names = self.names
                raise UnknownVariableError(
                    f"{self.task_name} holds no variable {name!r}; it holds {len(names)}: "
                    f"{', '.join(names[:8])}{'...' if len(names) > 8 else ''}"
                )
        return variable

    def group_of(self, name: str) -> OptimizedVariables:
        """The group of variable ``name`` (one the model holds)."""
        return self.dense if name in self.dense else self.table_parts.fixed

    def state_of(self, name: str) -> dict[str, Any] | None:
        """The live optimizer state of variable ``name``; None before torch made any."""
        return self.group_of(name).state_of(self.variable(name))

    def set_state(self, name: str, state: dict[str, Any]) -> None:
        """Make ``state`` the optimizer state of variable ``name``."""
        self.group_of(name).set_state(self.variable(name), state)

    def nbytes(self) -> int:
        """Bytes of the variables, the tables' parts and the optimizers' tensor state."""
        return self.dense.nbytes() + self.table_parts.nbytes()

    def check_same(
        self,
        values: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec,
        tables: Sequence[str],
        table_optimizer: OptimizerSpec | None,
        dynamic: Mapping[str, DynamicPart],
    ) -> None:
        """Raise unless a chief's model is this one: the same variables (by name,
        shape and dtype), tables, dynamic tables and optimizers.

        Raises:
            ClusterMismatchError: naming what differs.
        """
        expected = {_key(name, value) for name, value in values.items()}
        held = {_key(name, self.variable(name)) for name in self.names}
        if expected != held:
            raise ClusterMismatchError(
                f"{self.task_name} already holds a different model: {len(values)} variables expected, "
                f"{len(self.names)} held; (name, shape, dtype) expected but not held: "
                f"{sorted(expected - held)[:4]}, held but not expected: {sorted(held - expected)[:4]} "
                f"(every worker must build the same model with the same placement options)"
            )
        parts = self.table_parts.dynamic_parts()
        if dict(dynamic) != parts:
            raise ClusterMismatchError(f"{self.task_name} holds dynamic tables {parts}, not {dict(dynamic)}")
        if optimizer != self.optimizer_spec:
            raise ClusterMismatchError(f"{self.task_name} already runs {self.optimizer_spec!r}, not {optimizer!r}")
        held_tables, table_spec = self.table_parts.fixed_names, self.table_parts.optimizer_spec
        if frozenset(tables) != held_tables or ((tables or dynamic) and table_optimizer != table_spec):
            raise ClusterMismatchError(
                f"{self.task_name} holds embedding tables {sorted(held_tables)} updated by "
                f"{table_spec!r}, not {sorted(tables)} by {table_optimizer!r}"
            )


def _key(name: str, value: torch.Tensor) -> VariableKey:
    return name, tuple(value.shape), str(value.dtype).removeprefix("torch.")

"""How a store makes its models: variables placed in its memory, and wired to its counters.

A store (:class:`~psframe.ps.store.VariableStore`) holds one model at a time
(:class:`~psframe.ps.store.store_model.StoreModel`), made anew when the chief
creates the variables, when a serving process attaches to the owner's, and after
a re-layout. :class:`ModelMaker` makes them the same way each time:

- each value becomes a variable in the store's :class:`psframe.memory.Memory`
  (a copy, or the tensor itself where it was made there already:
  :func:`placed`). After a live re-layout's cut the store let go of its
  model; a value that is a variable of that model (the same memory, shape,
  strides and dtype: :func:`memory_key`) is that variable again, so that
  the optimizers of that model carry on over it and a re-layout's step
  costs the parts that move, not all;
- the optimizers' state is looked after by the same memory;
- the fixed rows' versions count from the store's count, and the
  learning-rate schedules follow its global step (both in the counters
  that the processes serving one task share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psframe.memory import Memory
from psframe.optim import OptimizerSpec
from psframe.ps.store.counters import StoreCounts
from psframe.ps.store.store_model import StoreModel
from psframe.ps.store.table_parts import DynamicPart

MemoryKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


class ModelMaker:
    """Makes a store's models in ``memory``, wired to ``counts``.

    Args:
        task_name: the task name used in error messages, e.g. ``/job:ps/task:0``.
        memory: where the variables and their optimizer state live.
        counts: the store's counts: the global step the schedules follow, and the count
            the fixed rows' versions are stamped from.
        lock: the store's lock.
    """

    def __init__(self, task_name: str, memory: Memory, counts: StoreCounts, lock: Any = None) -> None:
        self.task_name = task_name
        self._memory = memory
        self._counts = counts
        self._lock = lock  # the store's: its dynamic tables' disk tiers spill ahead under it

    def empty(self) -> StoreModel:
        """A model of no variables (a store before the chief creates them, or after :meth:`clear`)."""
        return StoreModel(self.task_name)

    def created(
        self,
        values: Mapping[str, torch.Tensor],
        optimizer: OptimizerSpec,
        tables: Sequence[str],
        table_optimizer: OptimizerSpec | None,
        dynamic: Mapping[str, DynamicPart],
        *,
        copy: bool,
        let_go: StoreModel | None,
    ) -> StoreModel:
        """The model the chief creates (see :meth:`VariableStore.create`): the variables of ``values``
        placed in memory (:func:`placed`), the optimizers of ``let_go`` carried on where some are its.

        Raises:
            ClusterMismatchError, UnknownVariableError: see :class:`StoreModel`.
        """
        variables, previous = placed(values, self._memory, copy=copy, let_go=let_go)
        return self._held(
            StoreModel(
                self.task_name,
                variables,
                optimizer,
                tables,
                table_optimizer,
                dynamic,
                self._memory,
                self._counts.row_version_cell,
                previous=previous,
                global_step=self._counts.global_step_cell,
                lock=self._lock,
            )
        )

    def attached_shared(
        self,
        values: Mapping[str, torch.Tensor],
        states: Mapping[str, Mapping[str, Any]],
        optimizer: OptimizerSpec,
        tables: Sequence[str],
        table_optimizer: OptimizerSpec | None,
        row_versions: Mapping[str, torch.Tensor] | None,
    ) -> StoreModel:
        """The model of variables, optimizer state and rows' versions that live elsewhere (shared
        memory), used as they are (see :meth:`VariableStore.attach_shared`)."""
        model = self._held(
            StoreModel(
                self.task_name,
                {name: trainable(value) for name, value in values.items()},
                optimizer,
                tables,
                table_optimizer,
                memory=self._memory,
                version_count=self._counts.row_version_cell,
                versions=row_versions,
                global_step=self._counts.global_step_cell,
            )
        )
        # After the memory looks after new optimizer state: shared state is taken as it is.
        for name, state in states.items():
            if state:
                model.set_state(name, dict(state))
        return model

    def _held(self, model: StoreModel) -> StoreModel:
        """``model``, its optimizers' state looked after by the memory."""
        for group in model.groups:
            self._memory.back_state(group.optimizer)
        return model


def memory_key(tensor: torch.Tensor) -> MemoryKey:
    """What a tensor is, as memory: two with the same key are views of the same bytes, alike."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def trainable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, requiring gradients where its dtype can have them (floating point, complex)."""
    return tensor.requires_grad_(tensor.is_floating_point() or tensor.is_complex())


def placed(
    values: Mapping[str, torch.Tensor], memory: Memory, *, copy: bool, let_go: StoreModel | None
) -> tuple[dict[str, torch.Tensor], StoreModel | None]:
    """The variables of ``values``, in ``memory``: copies with ``copy``; without, a variable of
    ``let_go`` (the model the store let go of) where a value is one, else the value itself.

    Returns:
        The variables by name, and ``let_go`` if some of them are its variables (its
        optimizers carry on over them), else None.
    """
    held = {}
    if let_go is not None and not copy:  # an empty tensor has no memory of its own to know it by
        held = {memory_key(v): v for v in let_go.variables().values() if v.numel()}
    variables = {}
    for name, value in values.items():
        if copy:
            variable = memory.copy_in(value)
        elif value.numel() and memory_key(value) in held:
            variable = held[memory_key(value)]  # kept across a re-layout: the one its optimizer knows
        else:  # made by copy_in or empty already, or a tensor of the request
            variable = value.detach().to("cpu").contiguous()
            memory.keep(variable)
        variables[name] = trainable(variable)
    return variables, let_go if held else None

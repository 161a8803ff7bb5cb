"""The state of a store's model taken whole and put back: snapshots, restores, the optimizers' state.

Free functions over a :class:`~psframe.ps.store.store_model.StoreModel` (and
the :class:`psframe.memory.Memory` its state lives in), for what a ps task
does with its state as a whole rather than a step at a time:

- :func:`copies` of the variables and their optimizer state, for a
  checkpoint, a live re-layout's copies, or a delta's changed variables;
  :func:`row_copies` of some rows of a fixed table;
- :func:`restore` of variables and state from a checkpoint;
- :func:`optimizer_state`, every variable's, complete or not at all;
- :func:`share_state`: the optimizers' state moved into the store's memory
  (shared memory, for a task served from several processes).

The store (:class:`~psframe.ps.store.VariableStore`) calls them under its
lock, after its checks, and counts what they change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psframe.checkpoint.deltas import RowChanges
from psframe.memory import Memory
from psframe.ps.store.store_model import StoreModel


def copies(
    model: StoreModel, names: Sequence[str] | None = None, *, clone: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Copies of ``model``'s variables (``names``, or all) and of each one's optimizer state, by name;
    without ``clone``, the tensors themselves (detached)."""
    names = model.names if names is None else names

    def copied(x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone() if clone else x.detach()

    values = {name: copied(model.variable(name)) for name in names}
    states = {
        name: {k: copied(x) if isinstance(x, torch.Tensor) else x for k, x in (model.state_of(name) or {}).items()}
        for name in names
    }
    return values, states


def row_copies(model: StoreModel, name: str, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Copies of rows ``rows`` of fixed table part ``name`` and of their optimizer state
    (element-wise state by row; any other state whole)."""
    changes = RowChanges.of(rows, model.variable(name), model.state_of(name) or {})
    return changes.value, dict(changes.state)


def restore(
    model: StoreModel,
    memory: Memory,
    values: Mapping[str, torch.Tensor],
    states: Mapping[str, Mapping],
    *,
    copy: bool = True,
) -> None:
    """Overwrite variables ``values`` (checked against them already) and the optimizer state
    ``states`` of ``model``'s variables; state goes where ``memory`` keeps it. Without ``copy``
    the state tensors are taken as they are (nothing else holds them)."""
    for name, value in values.items():
        with torch.no_grad():
            model.variable(name).copy_(value)
    for name, state in states.items():
        if not copy:
            model.set_state(name, dict(state))
            memory.place_state(model.state_of(name))
            continue
        model.set_state(
            name,
            {k: memory.copy_state(x) if isinstance(x, torch.Tensor) else x for k, x in state.items()},
        )


def optimizer_state(model: StoreModel) -> dict[str, dict[str, Any]] | None:
    """Each variable's live optimizer state (empty for a stateless optimizer such as
    plain SGD); None while some variable has none yet, before its first update."""
    state = {name: model.state_of(name) for name in model.names}
    for group in model.groups:  # the dense variables' optimizer, and the tables'
        made = [state[name] for name in group]
        # No state at all is stateless only once an update went through without making any.
        if not all(made) and (any(made) or not group.stepped):
            return None
    return {name: dict(s or {}) for name, s in state.items()}


def share_state(model: StoreModel, memory: Memory) -> None:
    """Move ``model``'s optimizer state where ``memory`` keeps state (shared memory), in place:
    the optimizers go on with the same values, now where other processes map them.

    State already there stays. The private memory of each variable's state is given back to the
    OS once moved (:func:`psframe.memory.malloc.trim`): the heap would keep it resident, and the
    task would hold its state twice.
    """
    for name in model.names:
        memory.place_state(model.state_of(name))

"""The state of a :class:`psframe.ps.store.VariableStore` taken as a whole (its base class).

What checkpoints and serving processes need of a store, beside its hot
path: the bytes it holds, a consistent copy of everything (a checkpoint's
shard) and putting one back, and moving the optimizer's state into shared
memory or adopting variables and state that live there. These methods use
the store's variables, lock, counters and optimizers; they live here to
keep each file about one thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from psframe import allocator, huge_pages
from psframe.ps.table_rows import TableRows


class StoreState(TableRows):
    """Accounting, snapshots and shared memory for a :class:`~psframe.ps.store.VariableStore`."""

    def optimizer_state(self) -> dict[str, dict[str, Any]] | None:
        """Each variable's live optimizer state (empty for a stateless optimizer such as
        plain SGD); None while some variable has none yet, before its first update."""
        with self.lock:
            self._require_ready()
            state = {name: self._optimizer_of(name).state.get(v) for name, v in self._variables.items()}
            # No state at all is stateless only once an update went through without making any.
            if not all(state.values()) and (any(state.values()) or not self._stepped):
                return None
            return {name: dict(s or {}) for name, s in state.items()}

    def _place_state(self, state: dict[str, Any] | None) -> None:
        """Put the state torch just made for a variable where the store keeps its memory.

        Torch makes a variable's state in private memory at its first step.
        Where the store's memory is shared (a task served from several
        processes), each variable's new state moves there at once, so the
        first step never holds the whole model's state twice, privately and
        shared, before :meth:`share_state`; elsewhere large state goes onto
        huge pages (:func:`psframe.huge_pages.back`). Tensors already there are left.
        """
        if not state:
            return
        if self._allocate is None:
            huge_pages.back(state.values())
            return
        moved = False
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not value.is_shared():
                state[key] = self._allocate(value.dtype, tuple(value.shape)).copy_(value)
                moved = True
        if moved:  # give the private copy back: tune_malloc keeps freed memory resident for reuse
            allocator.trim()

    def share_state(self) -> None:
        """Move the optimizer's state into memory made by ``allocate`` (shared memory),
        in place: the optimizer goes on with the same values, now where other processes map them.

        State already there (see :meth:`_place_state`) stays. The private
        memory of each variable's state is given back to the OS once moved
        (:func:`psframe.allocator.trim`): the heap would keep it resident, and
        the task would hold its state twice.
        """
        with self.lock:
            for name, variable in self._variables.items():
                self._place_state(self._optimizer_of(name).state.get(variable))

    # ---- accounting

    def nbytes(self) -> int:
        """Bytes of the variables plus the optimizer's tensor state."""
        with self.lock:
            total = sum(v.numel() * v.element_size() for v in self._variables.values())
            for optimizer in self._optimizers():
                for state in optimizer.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            total += value.numel() * value.element_size()
            return total + sum(rows.nbytes() for rows in self._dynamic.values())

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor], dict[str, dict]]:
        """Copies of the global step, the variables and each one's optimizer state."""
        with self.lock:
            self._require_ready()
            values = {name: v.detach().clone() for name, v in self._variables.items()}
            states = {
                name: {
                    k: x.clone() if isinstance(x, torch.Tensor) else x
                    for k, x in self._optimizer_of(name).state.get(v, {}).items()
                }
                for name, v in self._variables.items()
            }
            return self.global_step, values, states

    def restore(self, values: Mapping[str, torch.Tensor], states: Mapping[str, Mapping], global_step: int) -> None:
        """Overwrite variables, optimizer state and global step (from a checkpoint).

        Everything is checked before anything changes.

        Raises:
            UnknownVariableError, ShapeMismatchError, DtypeMismatchError.
        """
        with self.lock:
            self._check_gradients(values)  # same rules: known name, same shape and dtype
            self.version += 1
            for name, value in values.items():
                with torch.no_grad():
                    self._variables[name].copy_(value)
            for name, state in states.items():
                variable = self._variable(name)
                self._optimizer_of(name).state[variable] = {
                    k: huge_pages.copy(x) if isinstance(x, torch.Tensor) else x for k, x in state.items()
                }
            self.global_step = global_step

"""Where a ps task keeps its tensors: the memory policy a store is given.

A :class:`psframe.ps.store.VariableStore` (and each dynamic table's
:class:`psframe.tables.dynamic_rows.DynamicRows`) makes, copies and places its
variables and optimizer state through one of these, and names no memory of
its own:

* :class:`Memory`: this process's memory, plain torch (the default);
* :class:`HugePageMemory`: the same, large tensors on transparent huge pages
  (:mod:`psframe.memory.huge_pages`): what a ps task's service gives its store;
* :class:`psframe.ps.serving.store_memory.SharedStoreMemory`: memory shared by the
  serving processes of one ps task.

Beside the policies: :mod:`psframe.memory.huge_pages` (transparent huge
pages for large tensors) and :mod:`psframe.memory.malloc` (glibc malloc
settings for a process that moves tensors every step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from psframe.memory import huge_pages


class Memory:
    """This process's memory: plain torch tensors, nothing moved."""

    def empty(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Uninitialised memory for a variable."""
        return torch.empty(tuple(shape), dtype=dtype)

    def full(self, shape: Sequence[int], value: float | bool, dtype: torch.dtype) -> torch.Tensor:
        """Memory for a variable or a state tensor, filled with ``value``."""
        return self.empty(dtype, shape).fill_(value)

    def copy_in(self, value: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``value`` on the host, in this memory."""
        return self.empty(value.dtype, value.shape).copy_(value.detach())

    def keep(self, variable: torch.Tensor) -> None:
        """Take a variable made elsewhere (by :meth:`empty`, or a request's tensor) as it is."""

    def copy_state(self, value: torch.Tensor) -> torch.Tensor:
        """A private copy of a state tensor read from a checkpoint (:meth:`place_state` may move it later)."""
        return value.detach().clone()

    def back_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Look after an optimizer's state tensors, which torch makes itself (some at
        the optimizer's build, some at its variable's first step)."""

    def place_state(self, state: dict[str, Any] | None) -> None:
        """Put the state torch just made for one variable where this memory keeps state."""


class HugePageMemory(Memory):
    """This process's memory, large tensors on transparent huge pages.

    A ps task reads and writes its large variables a few rows at a time (an
    embedding table) or all of them every step; on 4 KiB pages either costs
    a TLB miss per page touched. See :mod:`psframe.memory.huge_pages`.
    """

    def empty(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return huge_pages.empty(shape, dtype)

    def keep(self, variable: torch.Tensor) -> None:
        huge_pages.back([variable])

    def copy_state(self, value: torch.Tensor) -> torch.Tensor:
        return huge_pages.copy(value)

    def back_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        huge_pages.back_state(optimizer)

    def place_state(self, state: dict[str, Any] | None) -> None:
        if state:
            huge_pages.back(state.values())


__all__ = ["HugePageMemory", "Memory"]

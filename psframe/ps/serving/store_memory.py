"""Memory shared by the serving processes of one ps task, as a store's memory policy.

A ps task served from several processes gives its store a
:class:`SharedStoreMemory` (:mod:`psframe.ps.serving.shared_store` makes its ``allocate``):
variables are made by it, and each variable's optimizer state moves there as
soon as torch makes it, so every process updates the same bytes. Private
copies (state read from a checkpoint, before it moves) stay on huge pages,
as in a task served from one process (:class:`psframe.memory.HugePageMemory`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from psframe.memory import HugePageMemory, malloc

Allocate = Callable[[torch.dtype, tuple[int, ...]], torch.Tensor]


class SharedStoreMemory(HugePageMemory):
    """Variables and optimizer state in memory made by ``allocate(dtype, shape)``."""

    def __init__(self, allocate: Allocate) -> None:
        self.allocate = allocate

    def empty(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return self.allocate(dtype, tuple(shape))

    def place_state(self, state: dict[str, Any] | None) -> None:
        """Move the state torch just made for a variable into shared memory.

        Torch makes a variable's state in private memory at its first step;
        each variable's new state moves at once, so the first step never
        holds the whole model's state twice, privately and shared. Tensors
        already shared are left.
        """
        if not state:
            return
        moved = False
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not value.is_shared():
                state[key] = self.allocate(value.dtype, tuple(value.shape)).copy_(value)
                moved = True
        if moved:  # give the private copy back: tune_malloc keeps freed memory resident for reuse
            malloc.trim()

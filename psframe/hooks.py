"""Hooks: code that runs around a trainer's steps (TF's ``SessionRunHook``).

Subclass :class:`Hook` and override what you need; pass instances to
``Trainer(hooks=[...])``. A hook asks training to stop with
``trainer.request_stop()``::

    class StopWhenGood(psframe.hooks.Hook):
        def after_step(self, trainer, global_step, loss):
            if loss is not None and loss.item() < 0.01:
                trainer.request_stop()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from psframe.trainer import Trainer


class Hook:
    """Base class: every method is a no-op."""

    def begin(self, trainer: Trainer) -> None:
        """Called once the trainer is connected and the model is ready."""

    def before_step(self, trainer: Trainer) -> None:
        """Called at the start of every ``trainer.step``."""

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        """Called after every step with the new global step and the step's loss."""

    def end(self, trainer: Trainer) -> None:
        """Called once when the trainer closes (also after an error)."""


class StopAtStepHook(Hook):
    """Stops training at a global step (TF's ``StopAtStepHook``).

    Args:
        last_step: stop once the global step reaches this value.
        num_steps: or stop after this many more global steps from ``begin``.

    Raises:
        ValueError: unless exactly one of the two is given, as a positive int.
    """

    def __init__(self, last_step: int | None = None, num_steps: int | None = None) -> None:
        if (last_step is None) == (num_steps is None):
            raise ValueError("give exactly one of last_step and num_steps")
        value = last_step if last_step is not None else num_steps
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"the step count must be a non-negative int, got {value!r}")
        self.last_step = last_step
        self._num_steps = num_steps

    def begin(self, trainer: Trainer) -> None:
        if self._num_steps is not None:
            self.last_step = trainer.global_step + self._num_steps
        if trainer.global_step >= self.last_step:
            trainer.request_stop()

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        if global_step >= self.last_step:
            trainer.request_stop()

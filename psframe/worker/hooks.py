"""Hooks: code that runs around a trainer's steps (TF's ``SessionRunHook``).

Subclass :class:`Hook` and override what you need; pass instances to
``Trainer(hooks=[...])``. A hook asks training to stop with
``trainer.request_stop()``::

    class StopWhenGood(psframe.worker.hooks.Hook):
        def after_step(self, trainer, global_step, loss):
            if loss is not None and loss.item() < 0.01:
                trainer.request_stop()
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from psframe.errors import NanLossError, PsframeError

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from psframe.worker.trainer import Trainer

log = logging.getLogger("psframe.hooks")  # the public name of these hooks


class Hook:
    """Base class: every method is a no-op."""

    def begin(self, trainer: Trainer) -> None:
        """Called once the trainer is connected and the model is ready."""

    def before_step(self, trainer: Trainer) -> None:
        """Called at the start of every ``trainer.step``."""

    def before_push(self, trainer: Trainer, loss: torch.Tensor | None) -> None:
        """Called after backward, before the gradients are sent; raising sends nothing."""

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
        ValueError: unless exactly one of the two is given, as a non-negative int.
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
        if trainer.global_step >= self._last():
            trainer.request_stop()

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        if global_step >= self._last():
            trainer.request_stop()

    def _last(self) -> int:
        """The step to stop at (known once ``begin`` has run)."""
        if self.last_step is None:
            raise PsframeError("StopAtStepHook(num_steps=...) knows its last step only once training begins")
        return self.last_step


class CheckpointSaverHook(Hook):
    """Saves a checkpoint every N global steps or S seconds, and at the end (chief only);
    in between, if asked, a delta checkpoint every n steps or s seconds.

    ``Trainer(checkpointing=psframe.Checkpointing(...))`` adds one on the chief; add it yourself
    only to change when it saves.

    Args:
        save_steps: save when the global step has advanced this much.
        save_secs: or when this many seconds have passed.
        delta_steps: commit a delta (:meth:`Trainer.save_delta`) when the
            global step has advanced this much since the last checkpoint;
        delta_secs: or when this many seconds have passed (neither: no deltas).
    """

    def __init__(
        self,
        save_steps: int | None = None,
        save_secs: float | None = None,
        delta_steps: int | None = None,
        delta_secs: float | None = None,
    ) -> None:
        if (save_steps is None) == (save_secs is None):
            raise ValueError("give exactly one of save_steps and save_secs")
        if (save_steps is not None and save_steps < 1) or (save_secs is not None and save_secs <= 0):
            raise ValueError(f"save_steps must be >= 1 and save_secs > 0, got {save_steps}, {save_secs}")
        if delta_steps is not None and delta_secs is not None:
            raise ValueError("give at most one of delta_steps and delta_secs")
        if (delta_steps is not None and delta_steps < 1) or (delta_secs is not None and delta_secs <= 0):
            raise ValueError(f"delta_steps must be >= 1 and delta_secs > 0, got {delta_steps}, {delta_secs}")
        self.save_steps = save_steps
        self.save_secs = save_secs
        self.delta_steps = delta_steps
        self.delta_secs = delta_secs
        self._last_step = 0
        self._last_time = 0.0
        self._last_delta_step = 0
        self._last_delta_time = 0.0

    def begin(self, trainer: Trainer) -> None:
        self._last_step, self._last_time = trainer.global_step, time.monotonic()
        self._last_delta_step, self._last_delta_time = self._last_step, self._last_time

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        if not trainer.is_chief:
            return
        now = time.monotonic()
        if self.save_steps is not None:
            due = global_step - self._last_step >= self.save_steps
        else:
            due = now - self._last_time >= (self.save_secs or 0.0)
        if due:
            trainer.save_checkpoint()
            self._last_step, self._last_time = global_step, now
        elif self.delta_steps is not None:
            due = global_step - self._last_delta_step >= self.delta_steps
        elif self.delta_secs is not None:
            due = now - self._last_delta_time >= self.delta_secs
        if not due:
            return
        if global_step != self._last_step:  # not just saved whole
            trainer.save_delta()
        self._last_delta_step, self._last_delta_time = global_step, now

    def end(self, trainer: Trainer) -> None:
        if trainer.is_chief and trainer.global_step not in (self._last_step, trainer.stats.last_checkpoint_step):
            trainer.save_checkpoint()


class LoggingHook(Hook):
    """Logs the loss, the global step and global steps per second every N local steps.

    Args:
        every_n_steps: log every this many local steps.
        logger: where to log; defaults to the ``psframe.hooks`` logger.
    """

    def __init__(self, every_n_steps: int = 100, logger: logging.Logger | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.log = logger or log
        self._start = (0, 0.0)

    def begin(self, trainer: Trainer) -> None:
        self._start = (trainer.global_step, time.monotonic())

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        local_step = trainer.stats.local_step
        if local_step % self.every_n_steps:
            return
        step0, time0 = self._start
        now = time.monotonic()
        rate = (global_step - step0) / max(now - time0, 1e-9)
        loss_text = f"{loss.item():.4f}" if loss is not None else "n/a"
        self.log.info(
            "worker %d: global step %d, local step %d, loss %s, %.1f global steps/s",
            trainer.task_index,
            global_step,
            local_step,
            loss_text,
            rate,
        )
        self._start = (global_step, now)


class NanGuardHook(Hook):
    """Stops training when the loss is NaN or infinite (TF's ``NanTensorHook``).

    It looks at the loss before the gradients are sent, so a bad step never
    reaches the ps tasks (nor a later checkpoint).

    Args:
        fail_on_nan: raise :class:`NanLossError` (the default), or else log,
            drop the step's gradients and request a stop.
    """

    def __init__(self, fail_on_nan: bool = True) -> None:
        self.fail_on_nan = fail_on_nan

    def before_push(self, trainer: Trainer, loss: torch.Tensor | None) -> None:
        if loss is None or bool(torch.isfinite(loss.detach()).all()):
            return
        message = (
            f"worker {trainer.task_index}: loss is {loss.item()} at global step "
            f"{trainer.global_step}; its gradients were not sent"
        )
        if self.fail_on_nan:
            raise NanLossError(message)
        log.error("%s; stopping", message)
        for param in trainer.model.parameters():
            param.grad = None
        trainer.request_stop()


class TensorBoardHook(Hook):
    """Writes loss and global steps/s to TensorBoard (chief only), via ``torch.utils.tensorboard``;
    in asynchronous training also a histogram of how many steps ahead of the slowest live worker
    the chief's steps of each interval found it (``stats.steps_ahead``: see :class:`psframe.BoundedStaleness`).

    Needs the ``tensorboard`` package (``pip install psframe[tensorboard]``).

    Args:
        log_dir: the folder for event files.
        every_n_steps: write every this many local steps.
    """

    def __init__(self, log_dir: str, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.log_dir = log_dir
        self.every_n_steps = every_n_steps
        self._writer: SummaryWriter | None = None
        self._start = (0, 0.0)
        self._ahead_written: dict[int, int] = {}  # the trainer's stats.steps_ahead at the last write

    def begin(self, trainer: Trainer) -> None:
        if not trainer.is_chief:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoardHook needs the tensorboard package: pip install 'psframe[tensorboard]'"
            ) from e
        self._writer = SummaryWriter(self.log_dir)
        self._start = (trainer.global_step, time.monotonic())

    def after_step(self, trainer: Trainer, global_step: int, loss: torch.Tensor | None) -> None:
        if self._writer is None or trainer.stats.local_step % self.every_n_steps:
            return
        step0, time0 = self._start
        now = time.monotonic()
        if loss is not None:
            self._writer.add_scalar("loss", loss.item(), global_step)
        self._writer.add_scalar("global_steps_per_sec", (global_step - step0) / max(now - time0, 1e-9), global_step)
        self._start = (global_step, now)
        counts = dict(trainer.stats.steps_ahead)
        new = [ahead for ahead, n in counts.items() for _ in range(n - self._ahead_written.get(ahead, 0))]
        if new:
            self._writer.add_histogram("steps_ahead", torch.tensor(new, dtype=torch.float32), global_step)
        self._ahead_written = counts

    def end(self, trainer: Trainer) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

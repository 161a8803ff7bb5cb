"""In-graph replication: one worker process drives several replicas of the model.

TF's other replication mode, for a host with several GPUs (or several CPU
replicas): one client holds a replica per device, against the same ps tasks,
instead of one worker process per device (between-graph replication). The
first replica is the trainer's model, the one that talks to the ps tasks; the
others are copies of it on their devices, given its values after every pull.

A step takes one loss per replica; their backward passes run at once (a
thread each: autograd releases the GIL, and each GPU works on its own). Then:

- **synchronous training**: the replicas' gradients are averaged in the
  process (summed in replica order, divided by their number: deterministic)
  and pushed once, as this worker's gradient for the round -- the same as
  one worker training on the replicas' batches put together;
- **asynchronous training**: each replica's gradient is pushed as a step of
  its own, one after the other, each applied by the ps tasks as it comes
  (every one was computed on the values of the step's start, as any
  asynchronous worker's may be stale).

:func:`replicate` gives a trainer its replicas: :class:`InGraphReplicas`, or
:class:`OneReplica` (the model alone) without ``replica_devices``. Either says once, as
the trainer connects, what a step does with the losses it is given (``steps``): one
replica's loss goes straight to the trainer's own step, which passes nothing here; in-graph
replicas take theirs first. The trainer has no branch of its own.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from psframe.worker.model.staging import resolve_device

Losses = torch.Tensor | Sequence[torch.Tensor] | None
# What a step does with the losses given to Trainer.step: the global step after it.
Steps = Callable[[Losses], int]


class Push(Protocol):
    """One step of the trainer: backward on ``loss`` (one tensor, or None: the gradients are
    there) unless not ``run_backward``, the first replica's gradients sent, the values taken.

    Returns:
        The global step after it.

    Raises:
        TypeError: ``loss`` is a list of losses.
    """

    def __call__(self, loss: Losses, run_backward: bool = True) -> int: ...


def replicate(
    model: torch.nn.Module,
    device: torch.device,
    replica_devices: Sequence[torch.device] | None,
    *,
    tables: bool,
    overlap_backward: bool,
) -> OneReplica | InGraphReplicas:
    """A trainer's replicas: ``model`` (on ``device``, the first of ``replica_devices``) and a copy
    on each further device; ``model`` alone without ``replica_devices``.

    Raises:
        ValueError: replicas of a model with embedding ``tables``, or with ``overlap_backward``.
    """
    if replica_devices is None:
        return OneReplica(model)
    if tables:
        raise ValueError("in-graph replication (replica_devices) takes models without embedding tables")
    if overlap_backward:
        raise ValueError("in-graph replication (replica_devices) does not overlap backward with the push")
    return InGraphReplicas(model, [device, *(resolve_device(model, d, None) for d in replica_devices[1:])])


class OneReplica:
    """No in-graph replication: the trainer's model alone, one loss a step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.models = [model]

    def steps(self, push: Push, *, sync: bool, recorded: Callable[[], None]) -> Steps:
        """What a step does with its loss: ``push`` it, as it is."""
        return push

    def share_values(self) -> None:
        """Nothing to share: one replica."""

    def close(self) -> None:
        """Nothing to release."""


class InGraphReplicas:
    """A worker's replicas of the model, the first of them the trainer's own.

    Args:
        model: the first replica (on its device already).
        devices: one device per replica, the first the model's.

    Raises:
        ValueError: fewer than two devices.
    """

    def __init__(self, model: torch.nn.Module, devices: Sequence[torch.device]) -> None:
        if len(devices) < 2:
            raise ValueError(f"in-graph replication needs two devices or more, got {list(devices)}")
        self.devices = list(devices)
        self.models = [model, *(copy.deepcopy(model).to(device) for device in self.devices[1:])]
        self._params = [[p for p in m.parameters() if p.requires_grad] for m in self.models]
        self._pool = ThreadPoolExecutor(len(self.models), thread_name_prefix="psframe-replica")

    def __len__(self) -> int:
        return len(self.models)

    def steps(self, push: Push, *, sync: bool, recorded: Callable[[], None]) -> Steps:
        """What a step does with its losses: :meth:`step` them (``sync``, ``recorded``: as there)."""
        return functools.partial(self.step, push=push, sync=sync, recorded=recorded)

    def step(self, loss: Losses, push: Push, *, sync: bool, recorded: Callable[[], None]) -> int:
        """One step of every replica, each with its loss (a list; None: the gradients are there):
        every backward at once; ``sync``: their mean gradient pushed once; asynchronous: each
        replica's pushed as a step of its own (``recorded`` after each: a batch read in ranges is
        recorded with the first push alone). Then every replica takes the values.

        Raises:
            TypeError: one loss, not a list.
        """
        if loss is None:
            return push(None, True)
        if isinstance(loss, torch.Tensor):
            raise TypeError(
                f"this trainer drives {len(self)} replicas (replica_devices): give step() one loss per "
                f"replica, as a list"
            )
        losses = list(loss)
        self.backward(losses)
        try:
            if sync:
                self.average_into_first()
                return push(self.mean_loss(losses), False)
            global_step = 0
            for i, one in enumerate(losses):
                self.gradient_into_first(i)
                global_step = push(self.mean_loss([one]), False)
                recorded()
            return global_step
        finally:
            self.share_values()
            self.clear_gradients()

    def backward(self, losses: Sequence[torch.Tensor]) -> None:
        """Run each replica's backward pass, all at once.

        Raises:
            ValueError: not one loss per replica.
        """
        if len(losses) != len(self.models):
            raise ValueError(f"step() takes one loss per replica: {len(self.models)}, got {len(losses)}")
        for future in [self._pool.submit(loss.backward) for loss in losses]:
            future.result()

    def average_into_first(self) -> None:
        """The replicas' mean gradient, as the first replica's (summed in replica order: deterministic)."""
        first = self.devices[0]
        with torch.no_grad():
            for j, param in enumerate(self._params[0]):
                grads = [_grad(params[j]).to(first) for params in self._params]
                total = grads[0] + grads[1]
                for grad in grads[2:]:
                    total.add_(grad)
                param.grad = total.div_(len(grads))

    def gradient_into_first(self, replica: int) -> None:
        """Replica ``replica``'s gradient, as the first replica's (for a push of its own)."""
        first = self.devices[0]
        with torch.no_grad():
            for param, other in zip(self._params[0], self._params[replica]):
                param.grad = _grad(other).to(first)

    def share_values(self) -> None:
        """Give every other replica the first one's values (after a pull)."""
        with torch.no_grad():
            for params in self._params[1:]:
                for param, value in zip(params, self._params[0]):
                    param.copy_(value)

    def clear_gradients(self) -> None:
        for params in self._params:
            for param in params:
                param.grad = None

    def mean_loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The replicas' losses averaged, on the first device (what hooks see of the step)."""
        return torch.stack([loss.detach().to(self.devices[0]) for loss in losses]).mean()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _grad(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)

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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


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

"""Where a worker's replica lives, and how its tensors reach the wire.

The codec reads and writes CPU memory only. A CPU replica hands it its
tensors as they are; a CUDA replica goes through pinned host buffers, made
once per tensor and reused every step.
"""

from __future__ import annotations

import torch


def resolve_device(
    model: torch.nn.Module, device: str | torch.device | None, gpu_memory_fraction: float | None
) -> torch.device:
    """The device of a worker's replica: ``device``, or where the model already is.

    A CUDA device without an index becomes the current one (the first of
    ``CUDA_VISIBLE_DEVICES``); ``gpu_memory_fraction`` caps this process's
    share of it.

    Raises:
        ValueError: CUDA asked for but not available, a fraction outside
            (0, 1], or a device type other than cpu and cuda.
    """
    if device is None:
        first = next(model.parameters(), None)
        resolved = first.device if first is not None else torch.device("cpu")
    else:
        resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {resolved} asked for, but CUDA is not available on this host")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        if gpu_memory_fraction is not None:
            if not 0.0 < gpu_memory_fraction <= 1.0:
                raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
            torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction, resolved)
    elif resolved.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {resolved}")
    return resolved


class HostStaging:
    """Moves tensors between a CUDA replica and the wire through pinned host buffers.

    On a CPU replica every method is a pass-through. Pinned buffers are
    allocated once per shape and reused every step.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
            self._buffers[key] = buf
        return buf

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if self.cuda else tensor

    def grads_to_host(self, grads: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if not self.cuda:
            return grads
        staged = []
        for name, grad in grads:
            buf = self._buffer(("grad", name), grad)
            buf.copy_(grad, non_blocking=True)
            staged.append((name, buf))
        torch.cuda.current_stream().synchronize()
        return staged

    def to_device(self, target: torch.Tensor, value: torch.Tensor) -> None:
        if self.cuda:
            buf = self._buffer(("param", target.data_ptr()), value)
            buf.copy_(value)
            target.copy_(buf, non_blocking=True)
        else:
            target.copy_(value)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

"""How a worker's variables are cut into the messages of a step.

Placement (:mod:`psframe.cluster.placement`) decides which ps task holds
each shard; this module decides which message carries it, and in which
order the messages of a step go. It is pure: shards in, a plan out; no
tensors are copied and nothing touches the network.

- :class:`Slot` binds a stored shard to the local parameter it mirrors.
- :func:`batches` groups each ps task's slots, in order, into messages of
  at most ``max_bytes`` (at least one slot each).
- :class:`StepPlan` holds the requests of one training step and of a pull
  of every variable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from psframe.cluster.placement import Shard


@dataclass(frozen=True, slots=True)
class Slot:
    """One stored variable as seen from the worker: the part of a local parameter it mirrors.

    What a step asks of it is worked out once, as attributes: its ``name`` (the shard's),
    whether it is the ``whole`` parameter, and else the ``part`` of dim 0 it holds.
    """

    shard: Shard
    param: torch.Tensor  # a model's parameter, or a dynamic table's row template
    name: str = field(init=False, compare=False)
    whole: bool = field(init=False, compare=False)  # the whole parameter: ``rows`` is the tensor itself
    part: slice = field(init=False, compare=False, repr=False)  # else its rows of dim 0

    def __post_init__(self) -> None:
        shard = self.shard
        object.__setattr__(self, "name", shard.name)
        object.__setattr__(self, "whole", not shard.partitioned)
        object.__setattr__(self, "part", slice(shard.row_start, shard.row_end, shard.row_stride))

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (shaped like the parameter) this shard holds: a view
        (not contiguous for a table part shared out by id modulo its parts)."""
        return tensor if self.whole else tensor[self.part]


@dataclass(frozen=True, eq=False, slots=True)
class Request:
    """One message of a step to one ps task.

    ``eq=False``: a request is its own identity, so a client can keep what it
    prepared for it (e.g. an encoded header) keyed by the request itself.
    """

    ps_task: int
    push: tuple[Slot, ...]  # gradients sent
    pull: tuple[Slot, ...]  # values asked back, after the update
    end_of_step: bool  # the worker's last request of the step to this ps task


def batches(slots: Sequence[Slot], num_ps: int, max_bytes: int) -> list[tuple[int, tuple[Slot, ...]]]:
    """Each ps task's slots, in order, grouped into messages of at most ``max_bytes``.

    A slot larger than ``max_bytes`` gets a message of its own.

    Returns:
        ``(ps_task, slots)`` pairs, ps task by ps task.
    """
    out: list[tuple[int, tuple[Slot, ...]]] = []
    for ps_task in range(num_ps):
        current: list[Slot] = []
        size = 0
        for slot in slots:
            if slot.shard.ps_task != ps_task:
                continue
            if current and size + slot.shard.nbytes > max_bytes:
                out.append((ps_task, tuple(current)))
                current, size = [], 0
            current.append(slot)
            size += slot.shard.nbytes
        if current:
            out.append((ps_task, tuple(current)))
    return out


@dataclass(frozen=True)
class StepPlan:
    """The requests of one training step (``step``) and of a full pull (``pull``).

    Async, and sync when a ps task's variables fit one message: each
    request pushes a batch and pulls it back. Sync with several messages to
    a ps task: the ps must have all of them before the step can complete, so
    all but the last only push (the ps answers at once), the last pushes and
    waits for the update, and then the rest are pulled; a stream never waits
    on a message queued behind it.
    """

    step: tuple[Request, ...]
    pull: tuple[Request, ...]

    @classmethod
    def make(cls, slots: Sequence[Slot], num_ps: int, max_bytes: int, sync: bool) -> StepPlan:
        grouped = batches(slots, num_ps, max_bytes)
        by_ps: dict[int, list[tuple[Slot, ...]]] = {}
        for ps_task, batch in grouped:
            by_ps.setdefault(ps_task, []).append(batch)
        step: list[Request] = []
        for ps_task, group in by_ps.items():
            if not sync or len(group) == 1:
                step += [Request(ps_task, b, b, i == len(group) - 1) for i, b in enumerate(group)]
            else:
                *first, last = group
                step += [Request(ps_task, b, (), False) for b in first]
                step.append(Request(ps_task, last, last, True))
                step += [Request(ps_task, (), b, False) for b in first]
        pull = tuple(Request(ps_task, (), batch, False) for ps_task, batch in grouped)
        return cls(tuple(step), pull)

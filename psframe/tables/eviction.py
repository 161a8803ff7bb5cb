"""Which rows a dynamic table part evicts: the ages of its rows, and its eviction's rules over them.

A part (:class:`~psframe.tables.dynamic_rows.DynamicRows`) keeps three ages
of the row in each of its slots: the update of the part that last touched
it, how many updates touched it, and when it was last seen (looked up for
training or updated, wall-clock seconds). :class:`EvictionPolicy` holds
them, with the part's count of updates (its clock), and names the rows its
:class:`~psframe.tables.spec.Eviction` evicts:

- to stay under a cap (``max_rows``), the least recently (``"lru"``) or
  least frequently (``"lfu"``) updated first, never one a request uses;
- past an age in the part's updates (``max_age``), swept every eighth of it;
- not seen for ``ttl_seconds``, swept every eighth of it;
- updated to an L2 norm below ``min_norm``.

It holds no row and no id: the part evicts the slots it names. Checkpoints
keep the ages (:meth:`EvictionPolicy.export`). Not thread-safe: the part's
holder serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from psframe.tables.spec import Eviction

_NEVER = torch.iinfo(torch.int64).max


class EvictionPolicy:
    """The ages of a dynamic table part's rows, slot by slot, and which of them ``eviction`` evicts.

    Args:
        eviction: the table's eviction.
        slots: the part's slots at first (see :meth:`grow`).
        wall_clock: the time in seconds, for ``ttl_seconds``.
    """

    def __init__(self, eviction: Eviction, slots: int, wall_clock: Callable[[], float]) -> None:
        self.eviction = eviction
        self.timed = eviction.ttl_seconds is not None  # whether seeing a row counts (it is kept)
        self._wall_clock = wall_clock
        self.clock = 0  # updates of the part so far
        self._updated = torch.zeros(slots, dtype=torch.int64)  # the update that last touched the row
        self._updates = torch.zeros(slots, dtype=torch.int64)  # how many updates touched it
        self._seen = torch.zeros(slots, dtype=torch.float64)  # when it was last looked up or updated (seconds)
        self._next_sweep = 0.0  # wall-clock time of the next sweep for rows not seen for ttl_seconds

    def grow(self, grown: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The part's slots grew: each age becomes ``grown(ages)`` (the ages, then room for more)."""
        self._updated, self._updates, self._seen = grown(self._updated), grown(self._updates), grown(self._seen)

    def made(self, slots: torch.Tensor) -> None:
        """New rows at ``slots``: as recent as the last update, updated never, seen now."""
        self._updated[slots] = self.clock
        self._updates[slots] = 0
        self._seen[slots] = self._wall_clock()

    def updated(self, slots: torch.Tensor) -> None:
        """One more update of the part, which touched the rows of ``slots``."""
        self.clock += 1
        self._updated.index_fill_(0, slots, self.clock)
        self._updates[slots] += 1

    def columns(self) -> dict[str, torch.Tensor]:
        """The ages, one per slot, by name: a disk tier moves them with their rows."""
        return {"updated": self._updated, "updates": self._updates, "seen": self._seen}

    def updates(self, slots: torch.Tensor) -> torch.Tensor:
        """How many updates touched each row of ``slots`` (int64)."""
        return self._updates.index_select(0, slots)

    def excess(self, held: int, new: int) -> int:
        """How many of ``held`` rows must go for ``new`` more to fit under the cap (0 or less: none)."""
        cap = self.eviction.max_rows
        return held + new - cap if cap is not None else 0

    def victims(self, excess: int, used: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
        """The ``excess`` rows ranked lowest among ``used`` slots, never those of ``keep``;
        None when fewer than ``excess`` may go."""
        if self.eviction.policy == "lru":
            score = self._updated.clone()
        else:  # fewest updates first, the oldest among equals
            score = self._updates * (self.clock + 1) + self._updated
        score[~used] = _NEVER
        score[keep] = _NEVER
        if int((score < _NEVER).sum()) < excess:
            return None
        return torch.topk(score, excess, largest=False).indices

    def aged_out(self, used: torch.Tensor) -> torch.Tensor | None:
        """The ``used`` slots not updated in ``max_age`` updates, at every eighth of it; else None."""
        max_age = self.eviction.max_age
        if max_age is None or self.clock % max(1, max_age // 8):
            return None  # swept every eighth of max_age updates: a row lives max_age to 1.125 * max_age updates
        return torch.nonzero(used & (self._updated < self.clock - max_age)).squeeze(1)

    def saw(self, slots: torch.Tensor, used: torch.Tensor) -> torch.Tensor | None:
        """Mark the rows of ``slots`` seen now (where :attr:`timed`); then, once in a while, the
        ``used`` slots not seen for ``ttl_seconds`` (else None)."""
        ttl = self.eviction.ttl_seconds
        if ttl is None:
            return None
        now = self._wall_clock()
        self._seen[slots] = now
        if now < self._next_sweep:
            return None
        self._next_sweep = now + ttl / 8  # a row lives ttl to 1.125 * ttl seconds since last seen
        return torch.nonzero(used & (self._seen < now - ttl)).squeeze(1)

    def too_small(self, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Those of ``slots`` whose row of ``weight`` has an L2 norm below ``min_norm``; None without one."""
        min_norm = self.eviction.min_norm
        if min_norm is None or not slots.numel():
            return None
        norms = weight.detach().index_select(0, slots).flatten(1).float().norm(dim=1)
        return slots[norms < min_norm]

    def export(self, slots: torch.Tensor) -> dict[str, Any]:
        """What a checkpoint keeps of the ages of ``slots``' rows, and the clock."""
        return {
            "updated": self._updated[slots],
            "updates": self._updates[slots],
            "clock": self.clock,
            "seen": self._seen[slots],
        }

    def load(self, slots: torch.Tensor, saved: Any) -> None:
        """Take the ages of ``slots``' rows and the clock as :meth:`export` gave them."""
        self._updated[slots] = saved["updated"]
        self._updates[slots] = saved["updates"]
        self.clock = int(saved["clock"])
        # Saved before rows were timed (or by an older psframe): seen now, so a TTL starts from the restore.
        seen = saved.get("seen")
        self._seen[slots] = seen.to(torch.float64) if seen is not None else self._wall_clock()

"""What changed in a dynamic table part's rows, for delta checkpoints.

A part (:class:`~psframe.tables.dynamic_rows.DynamicRows`) stamps each of
its slots with the *epoch* the row last changed in (made, updated, or seen
where the eviction keeps when rows were seen; all of them when the
optimizer made their state), and keeps the ids evicted in each epoch: a
delta checkpoint from a snapshot takes the rows stamped after the
snapshot's epoch and the ids evicted since (:mod:`psframe.ps.store.changes`).

Not thread-safe: the part's holder serialises calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ChangeStamps:
    """The epoch of the row in each slot of a dynamic table part, and the ids it evicted.

    Args:
        slots: the part's slots at first (see :meth:`grow`).
    """

    def __init__(self, slots: int) -> None:
        self.epoch = 1  # what changes now is stamped with this; the store moves it on at each snapshot
        self._epochs = torch.zeros(slots, dtype=torch.int64)
        self._deleted: list[tuple[int, torch.Tensor]] = []  # (epoch, ids evicted in it)

    def grow(self, grown: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The part's slots grew: each stamp becomes ``grown(stamps)`` (the stamps, then room for more)."""
        self._epochs = grown(self._epochs)

    def columns(self) -> dict[str, torch.Tensor]:
        """The stamps, one per slot, by name: a disk tier moves them with their rows."""
        return {"epoch": self._epochs}

    def made(self, slots: torch.Tensor, *, restored: bool = False) -> None:
        """New rows at ``slots``; ``restored``: as the snapshot holds them (no epoch)."""
        self._epochs[slots] = 0 if restored else self.epoch

    def updated(self, slots: torch.Tensor) -> None:
        """The rows of ``slots`` changed (an update): this epoch."""
        self._epochs.index_fill_(0, slots, self.epoch)

    def changed(self, slots: torch.Tensor) -> None:
        """What a checkpoint keeps of the rows of ``slots`` (indices or a mask) changed, not their
        values (seen, or their optimizer state made): this epoch."""
        self._epochs[slots] = self.epoch

    def removed(self, ids: torch.Tensor) -> None:
        """Ids ``ids`` were evicted in this epoch."""
        if ids.numel():
            self._deleted.append((self.epoch, ids.clone()))

    def changed_since(self, since: int, used: torch.Tensor) -> torch.Tensor:
        """The ``used`` slots whose row changed after epoch ``since``."""
        return torch.nonzero(used & (self._epochs > since)).squeeze(1)

    def removed_since(self, since: int) -> torch.Tensor:
        """The ids evicted after epoch ``since`` (sorted, each once)."""
        deleted = [ids for epoch, ids in self._deleted if epoch > since]
        return torch.unique(torch.cat(deleted)) if deleted else torch.zeros(0, dtype=torch.int64)

    def close_epoch(self, oldest: int) -> None:
        """Move on to the next epoch (a snapshot was taken); forget evictions no delta after ``oldest`` needs."""
        self.epoch += 1
        self._deleted = [(epoch, ids) for epoch, ids in self._deleted if epoch > oldest]

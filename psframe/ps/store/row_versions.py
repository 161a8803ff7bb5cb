"""The versions of a ps task's fixed table rows: one stamp read by delta checkpoints and re-layouts.

Every update of some rows of a fixed table part gives them the next
*version*: a count of row updates, from a base of the wall clock in ns
(a ps task that restarts counts past every version it gave before). One
stamp per row serves both of its readers:

- a delta checkpoint takes the rows whose version is past the *mark* (the
  count) its parent's snapshot recorded (:mod:`psframe.ps.store.changes`);
- a re-layout's cut sends of a part copied ahead only the rows whose version
  is past the copy's mark (:mod:`psframe.ps.elastic.precopy`).

Where a ps task is served from several processes, the versions live in the
store's memory (shared: :mod:`psframe.ps.serving.shared_store`) and the count in
its shared counters, so that every process stamps and reads the same ones;
the store's lock, one ``flock`` across them, orders the stamps.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy
import torch

from psframe.memory import Memory


class RowVersions:
    """The version of every row of some fixed table parts, and the count they are stamped from.

    Args:
        rows: each table part's rows, by name.
        count: a one-element int64 array holding the count (shared with other processes,
            or this store's own); 0: not started, started here from the wall clock.
        memory: where the versions are made (shared memory, for a task served from several processes).
        versions: versions made elsewhere (a serving process maps the owner's): used as they are.
    """

    def __init__(
        self,
        rows: Mapping[str, int],
        count: numpy.ndarray | None = None,
        memory: Memory | None = None,
        versions: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self._count = count if count is not None else numpy.zeros(1, dtype=numpy.int64)
        if versions is not None:
            self._versions = dict(versions)
            return
        if not self._count[0]:
            self._count[0] = time.time_ns()
        base = int(self._count[0])
        memory = memory if memory is not None else Memory()
        self._versions = {name: memory.full((n,), base, torch.int64) for name, n in rows.items()}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The versions, by table part (for other processes to map)."""
        return dict(self._versions)

    def mark(self) -> int:
        """The count now: a row changed after this moment will have a higher version."""
        return int(self._count[0])

    def touch(self, name: str, rows: torch.Tensor) -> None:
        """Rows ``rows`` (int64) of table part ``name`` changed."""
        self._count[0] += 1
        self._versions[name].index_fill_(0, rows, int(self._count[0]))

    def touch_whole(self, name: str) -> None:
        """Every row of table part ``name`` changed (its optimizer state was made)."""
        self._count[0] += 1
        self._versions[name].fill_(int(self._count[0]))

    def touch_all(self) -> None:
        """Every row of every table part changed (a restore)."""
        self._count[0] += 1
        for versions in self._versions.values():
            versions.fill_(int(self._count[0]))

    def changed_since(self, name: str, mark: int) -> torch.Tensor:
        """The rows of table part ``name`` changed after ``mark`` (int64, ascending)."""
        return torch.nonzero(self._versions[name] > mark).squeeze(1)

"""A worker's row cache: rows of an embedding table kept between steps, with their versions.

Click logs follow a power law: a few ids are in almost every batch. Without
a cache, a worker pulls their rows at every lookup; with one
(``Trainer(row_cache=psframe.RowCaching(...))``), it names the version of
each row it holds, and a ps task sends back only the rows that moved more
than ``max_lag`` versions past it (:func:`psframe.tables.rows.to_refresh`),
with every row's current version. A row's version on a ps task counts the
changes of its table part when it was last made or updated, so
``max_lag=0`` gives exactly the ps task's rows (a row not changed since
it was cached does not travel); a larger ``max_lag`` lets a hot row lag that
many of the part's updates behind.

:class:`RowCache` holds one table's rows: any int64 ids (a fixed table's row
numbers, a dynamic table's ids), found in bulk in an
:class:`~psframe.tables.id_index.IdIndex`, up to ``max_rows`` of them; past it,
the rows used longest ago make room.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.tables.id_index import IdIndex
from psframe.tables.rows import NOT_CACHED

_INITIAL_SLOTS = 1024


class RowCache:
    """One table's rows a worker keeps between steps, with their versions on the ps tasks.

    Args:
        row_shape: the shape of a row.
        dtype: the rows' dtype.
        max_rows: the most rows kept; past it, those used longest ago go.
        max_lag: how many versions (updates) a cached row may lag behind the ps task's copy before
            the ps task sends it again; 0: exact.
    """

    def __init__(self, row_shape: Sequence[int], dtype: torch.dtype, max_rows: int, max_lag: int) -> None:
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.max_rows = max_rows
        self.max_lag = max_lag
        slots = min(_INITIAL_SLOTS, max_rows)
        self._index = IdIndex()
        self._rows = torch.empty((slots, *self.row_shape), dtype=dtype)
        self._versions = torch.zeros(slots, dtype=torch.int64)
        self._ids = torch.zeros(slots, dtype=torch.int64)
        self._used_at = torch.zeros(slots, dtype=torch.int64)  # the lookup that last used each slot
        self._next = 0  # slots from here on were never used
        self._lookups = 0
        self.looked_up = 0  # rows asked of the cache
        self.received = 0  # rows that came from the ps tasks

    def __len__(self) -> int:
        return len(self._index)

    def versions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot of each id (-1: not held) and the version of its row held (:data:`NOT_CACHED`: none)."""
        slots = self._index.find(ids)
        versions = torch.full_like(ids, NOT_CACHED)
        held = slots >= 0
        versions[held] = self._versions.index_select(0, slots[held])
        return slots, versions

    def fill(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        versions: torch.Tensor,
        refresh: torch.Tensor,
        fresh: torch.Tensor,
    ) -> torch.Tensor:
        """The rows of ``ids``: held ones from the cache, ``fresh`` ones (those ``refresh`` picks,
        in order) from the ps tasks, which the cache keeps with their ``versions``.

        Args:
            ids: distinct ids, as :meth:`versions` was asked.
            slots: what :meth:`versions` gave for them.
            versions: each id's row version on its ps task.
            refresh: which ids the ps tasks sent rows of.
            fresh: those rows.
        """
        self._lookups += 1
        self.looked_up += ids.numel()
        self.received += fresh.shape[0]
        # Index tensors rather than boolean masks: a gather and a scatter each, no mask passes.
        fresh_at = torch.nonzero(refresh).squeeze(1)
        kept_at = torch.nonzero(~refresh).squeeze(1)
        kept_slots = slots.index_select(0, kept_at)
        rows = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        rows.index_copy_(0, kept_at, self._rows.index_select(0, kept_slots))
        rows.index_copy_(0, fresh_at, fresh.to(self.dtype))
        self._used_at.index_fill_(0, kept_slots, self._lookups)
        self._store(
            ids.index_select(0, fresh_at),
            slots.index_select(0, fresh_at),
            versions.index_select(0, fresh_at),
            fresh,
            in_use=kept_slots,
        )
        return rows

    def _store(
        self, ids: torch.Tensor, slots: torch.Tensor, versions: torch.Tensor, rows: torch.Tensor, in_use: torch.Tensor
    ) -> None:
        """Keep ``rows`` of ``ids`` (at ``slots``, -1 for ids not held yet), never evicting those ``in_use``
        (rows of ids beyond what ``max_rows`` leaves room for are not kept)."""
        new = slots < 0
        protected = torch.cat([in_use, slots[~new]])
        room = max(0, self.max_rows - protected.numel())
        if int(new.sum()) > room:  # one lookup of more new ids than fit: keep the first that do
            keep = ~new | (torch.cumsum(new.long(), 0) <= room)
            ids, slots, versions, rows, new = ids[keep], slots[keep], versions[keep], rows[keep], new[keep]
        count = int(new.sum())
        if count:
            slots = slots.clone()
            slots[new] = self._free_slots(count, protected)
            self._index.add(ids[new], slots[new])
            self._ids[slots[new]] = ids[new]
        self._rows.index_copy_(0, slots, rows.to(self.dtype))
        self._versions.index_copy_(0, slots, versions)
        self._used_at.index_fill_(0, slots, self._lookups)

    def _free_slots(self, count: int, in_use: torch.Tensor) -> torch.Tensor:
        """``count`` slots for new rows: never used ones (growing up to ``max_rows``), then
        those of the rows used longest ago (never one ``in_use``)."""
        while self._next + count > self._rows.shape[0] and self._rows.shape[0] < self.max_rows:
            self._grow()
        fresh = min(count, self._rows.shape[0] - self._next)
        taken = torch.arange(self._next, self._next + fresh)
        self._next += fresh
        if fresh == count:
            return taken
        age = self._used_at[: self._next].clone()
        age[in_use] = torch.iinfo(torch.int64).max  # this lookup's rows stay
        age[taken] = torch.iinfo(torch.int64).max
        evicted = torch.topk(age, count - fresh, largest=False).indices
        self._index.remove(self._ids.index_select(0, evicted))
        return torch.cat([taken, evicted])

    def _grow(self) -> None:
        old = self._rows.shape[0]
        size = min(2 * old, self.max_rows)

        def grown(tensor: torch.Tensor, fill: int) -> torch.Tensor:
            out = torch.full((size, *tensor.shape[1:]), fill, dtype=tensor.dtype)
            out[:old] = tensor
            return out

        self._rows = torch.cat([self._rows, torch.empty((size - old, *self.row_shape), dtype=self.dtype)])
        self._versions, self._ids = grown(self._versions, 0), grown(self._ids, 0)
        self._used_at = grown(self._used_at, 0)

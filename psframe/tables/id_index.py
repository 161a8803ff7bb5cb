"""Where each int64 id's slot is: a sorted index searched in bulk.

A dynamic table's part (:class:`~psframe.tables.dynamic_rows.DynamicRows`)
holds rows in slots and finds a batch's ids' slots in an :class:`IdIndex`.
Plain torch and numpy; not thread-safe (its holder serialises calls).
"""

from __future__ import annotations

import numpy
import torch


class IdIndex:
    """Where each id's row is: sorted tensors of ids searched in bulk.

    Looking ids up one by one in a dict costs a Python call per id, several
    times a step; here a batch's ids are found with ``searchsorted`` over
    sorted ids, in two parts: the bulk, and the ids added since it was last
    merged (kept sorted, merged with each batch added in one linear pass).
    Once there are :data:`MERGE_AT` recent ids, they are merged into the
    bulk. A removed id keeps its place, marked -1, until its part is merged.
    About 16 bytes per id, against a dict's ~100.
    """

    MERGE_AT = 1 << 15

    def __init__(self) -> None:
        self._ids = torch.zeros(0, dtype=torch.int64)  # the bulk, sorted
        self._slots = torch.zeros(0, dtype=torch.int64)  # -1: removed
        self._recent_ids = torch.zeros(0, dtype=torch.int64)  # added since the bulk was merged, sorted
        self._recent_slots = torch.zeros(0, dtype=torch.int64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def nbytes(self) -> int:
        """Bytes of both sorted parts."""
        return 16 * (self._ids.numel() + self._recent_ids.numel())

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it has none."""
        slots = _search(self._ids, self._slots, ids)
        if self._recent_ids.numel():
            missing = torch.nonzero(slots < 0).squeeze(1)
            if missing.numel():
                slots[missing] = _search(self._recent_ids, self._recent_slots, ids[missing])
        return slots

    def add(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Index ``ids`` (distinct, none of them held) at ``slots``."""
        self._recent_ids, self._recent_slots = _merged(self._recent_ids, self._recent_slots, ids, slots)
        self._count += ids.numel()
        if self._recent_ids.numel() >= self.MERGE_AT:
            self._ids, self._slots = _merged(self._ids, self._slots, self._recent_ids, self._recent_slots)
            self._recent_ids, self._recent_slots = self._recent_ids[:0], self._recent_slots[:0]

    def remove(self, ids: torch.Tensor) -> None:
        """Forget ``ids`` (all of them held)."""
        self._count -= ids.numel()
        for keys, slots in ((self._recent_ids, self._recent_slots), (self._ids, self._slots)):
            if keys.numel() and ids.numel():
                at = torch.from_numpy(numpy.searchsorted(keys.numpy(), ids.numpy())).clamp_(max=keys.numel() - 1)
                hit = (keys.index_select(0, at) == ids) & (slots.index_select(0, at) >= 0)
                slots[at[hit]] = -1
                ids = ids[~hit]  # each id is held in one part


def _search(keys: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The slot of each id among sorted ``keys`` (-1 where it is not there, or removed)."""
    if not keys.numel():
        return torch.full_like(ids, -1)
    # numpy's searchsorted is about 3 times torch's on CPU for int64 (a step's ~5,000 ids).
    at = torch.from_numpy(numpy.searchsorted(keys.numpy(), ids.numpy())).clamp_(max=keys.numel() - 1)
    return torch.where(keys.index_select(0, at) == ids, slots.index_select(0, at), -1)


def _merged(
    keys: torch.Tensor, slots: torch.Tensor, new_keys: torch.Tensor, new_slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ``keys`` (their removed entries dropped) and ``new_keys`` (none among them), merged in one pass."""
    held = slots >= 0
    if not bool(held.all()):
        keys, slots = keys[held], slots[held]
    new_keys, order = torch.sort(new_keys)
    new_slots = new_slots.index_select(0, order)
    # Two sorted runs, one after the other: a stable sort (timsort) finds the runs and merges them in one pass.
    both = numpy.concatenate([keys.numpy(), new_keys.numpy()])
    by_key = numpy.argsort(both, kind="stable")
    merged_slots = numpy.concatenate([slots.numpy(), new_slots.numpy()])[by_key]
    return torch.from_numpy(both[by_key]), torch.from_numpy(merged_slots)

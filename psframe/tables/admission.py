"""Which new ids a dynamic table gives a row: by count, in a counting Bloom filter, or by chance.

:class:`~psframe.tables.spec.Admission` says what a table
admits; :class:`AdmissionFilter` decides it for one part of the table
(:class:`psframe.tables.dynamic_rows.DynamicRows`), for ids the part does not hold.

- By count: each id hashes to three of ``counters`` one-byte counters. A
  lookup adds the id's occurrences to them, raising only those at the
  id's current minimum (the "conservative update", which keeps shared
  counters from running ahead), and the id is admitted once that minimum
  reaches ``min_count``. No row, no dict entry: the filter's memory is
  fixed whatever the number of ids.
- By chance: each lookup of the id admits it with ``probability``, drawn
  from a generator seeded by the table's seed, whose state checkpoints keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy
import torch

from psframe.tables.spec import Admission

_HASHES = 3
# Odd 64-bit multipliers, one per hash: an id times each, its top bits, gives three counters.
_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9)
_MAX_COUNT = 255


class AdmissionFilter:
    """One table part's admission of new ids (see the module).

    Args:
        admission: what the table admits.
        seed: the table's seed (its initializer's), for admission by chance.
    """

    def __init__(self, admission: Admission, seed: int = 0) -> None:
        self.admission = admission
        self._shift = numpy.uint64(64 - (admission.counters.bit_length() - 1))
        self._counts = torch.zeros(admission.counters, dtype=torch.uint8) if admission.min_count > 1 else None
        self._random: torch.Generator | None = None
        if admission.probability < 1:
            self._random = torch.Generator()
            self._random.manual_seed(seed & 0x7FFFFFFFFFFFFFFF)

    def admit(self, ids: torch.Tensor, occurrences: torch.Tensor) -> torch.Tensor:
        """Count a lookup of ``ids`` (distinct, none held) seen ``occurrences`` times each; which are admitted."""
        if self._counts is not None:
            return self._count(ids, occurrences) >= self.admission.min_count
        if self._random is not None:
            return torch.rand(ids.numel(), generator=self._random) < self.admission.probability
        return torch.ones(ids.numel(), dtype=torch.bool)

    def _count(self, ids: torch.Tensor, occurrences: torch.Tensor) -> torch.Tensor:
        assert self._counts is not None
        keys = ids.numpy().view(numpy.uint64)
        at = torch.stack(
            [torch.from_numpy((keys * numpy.uint64(m) >> self._shift).astype(numpy.int64)) for m in _MULTIPLIERS]
        )  # (hashes, ids): the counters of each id
        seen = self._counts[at].to(torch.int64).amin(0)
        count = (seen + occurrences).clamp_(max=_MAX_COUNT)
        # Conservative update: raise each counter to the new count, never above it (an id's
        # counters shared with another id keep the larger of the two).
        self._counts.scatter_reduce_(0, at.flatten(), count.repeat(_HASHES).to(torch.uint8), "amax")
        return count

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the counters and the generator's state (those in use)."""
        state: dict[str, Any] = {}
        if self._counts is not None:
            state["counts"] = self._counts.clone()
        if self._random is not None:
            state["random"] = self._random.get_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's counters and generator state; those of another size or kind are left as they are."""
        counts = state.get("counts")
        if self._counts is not None and isinstance(counts, torch.Tensor) and counts.shape == self._counts.shape:
            self._counts.copy_(counts)
        random = state.get("random")
        if self._random is not None and isinstance(random, torch.Tensor):
            self._random.set_state(random)

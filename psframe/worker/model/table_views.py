"""Each embedding table as the worker sees it: its module, the slots of its parts, and its lookups.

:class:`Table` is a fixed table (an ``nn.Embedding``/``nn.EmbeddingBag``
built with ``sparse=True``). While attached, its module's forward is
:meth:`Table.lookup`: the batch is looked up in the rows of its distinct ids
alone (numbered by their rank among them), never in the full weight, so a
step touches as much memory for a table of 10^7 rows as for one of 10^4. The
gradient is that of the pulled rows, summed per id as backward sums an
``nn.Embedding(sparse=True)``'s, in the weight's ``grad``
(:class:`~psframe.worker.model.row_gradient.RowGradient`), where the user's
clipping sees it. The pulled rows are also written into the
module's own weight, so that rows a batch looked up hold their last pulled
values there (:meth:`Table.held_ids`); the others keep whatever they had.
:meth:`Table.split` cuts ids by part, for pulls and for pushes.

:class:`DynamicTable` is a dynamic table
(:class:`~psframe.worker.model.dynamic.DynamicEmbedding`): no local weight,
one part per ps task (by id); :meth:`DynamicTable.pull` answers its
module's lookups and :meth:`DynamicTable.cut` shares its row gradients out
among the parts.

The set of a model's tables, and how they are hooked to the ps tasks, is
:class:`psframe.worker.model.tables.EmbeddingTables`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from psframe.errors import RowIdError
from psframe.tables.row_math import part_of
from psframe.tables.rows import RowPush
from psframe.worker.model.dynamic import DynamicEmbedding
from psframe.worker.model.row_gradient import RowGradient
from psframe.worker.model.row_pulls import Pull, pull_parts
from psframe.worker.plan.step_plan import Slot

EmbeddingModule = torch.nn.Embedding | torch.nn.EmbeddingBag  # what a table of a model is


@dataclass
class Prefetched:
    """The rows of a coming lookup, pulled ahead (:mod:`psframe.worker.model.prefetch`), and its ids
    numbered as :meth:`Table.lookup` numbers them."""

    ids: torch.Tensor  # the lookup's ids, as given
    distinct: torch.Tensor  # torch.unique of them, on their device
    position: torch.Tensor  # each id's rank among the distinct ones
    host_ids: torch.Tensor  # the distinct ids, int64, on the host
    rows: torch.Tensor  # their rows

    def matches(self, ids: torch.Tensor) -> bool:
        """Whether a lookup of ``ids`` is the one prefetched."""
        mine = self.ids
        return (
            ids.shape == mine.shape and ids.dtype == mine.dtype and ids.device == mine.device and torch.equal(ids, mine)
        )


@dataclass
class Table:
    """One embedding table as the worker sees it: its module and the slots of its parts."""

    name: str
    module: EmbeddingModule
    slots: list[Slot]  # by part index
    _starts: torch.Tensor = field(init=False)
    prefetched: list[Prefetched] = field(init=False, default_factory=list)  # rows pulled ahead for lookups to come
    # The rows of the local weight a lookup wrote (a bool per row; None: none yet): trainer.pull() refreshes them.
    held: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._starts = torch.tensor([s.shard.row_start for s in self.slots], dtype=torch.int64)

    def lookup(
        self,
        rows_of: Callable[[torch.Tensor], torch.Tensor],
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The module's forward over the rows of the batch's distinct ids only (``rows_of(ids)`` pulls them)."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"embedding table {self.name!r} was called without a tensor of ids")
        module, weight = self.module, self.param
        prefetched = self.take_prefetched(ids)
        if prefetched is not None:  # numbered and pulled when the ids were named
            distinct, position, rows = prefetched.distinct, prefetched.position, prefetched.rows
            host_ids = prefetched.host_ids
        else:
            distinct, position = torch.unique(ids.detach(), return_inverse=True)
            host_ids = distinct.to("cpu", torch.int64)
            self.check_ids(host_ids)
            rows = rows_of(host_ids)
        rows = rows.to(weight.device, weight.dtype)
        with torch.no_grad():
            weight.index_copy_(0, distinct.to(weight.device, torch.int64), rows)
        if self.held is None:
            self.held = torch.zeros(self.rows, dtype=torch.bool)
        self.held[host_ids] = True
        if torch.is_grad_enabled() and weight.requires_grad:
            rows.requires_grad_(True)
            # Backward's gradient of these rows goes to the weight's grad (psframe.worker.model.row_gradient).
            rows.register_post_accumulate_grad_hook(functools.partial(RowGradient.reached, self.name, weight, host_ids))
        padding = None
        if module.padding_idx is not None:
            hit = torch.nonzero(torch.eq(distinct, module.padding_idx))
            padding = int(hit[0, 0]) if hit.numel() else None
        if isinstance(module, torch.nn.EmbeddingBag):
            return F.embedding_bag(
                position,
                rows,
                offsets,
                None,
                module.norm_type,
                module.scale_grad_by_freq,
                module.mode,
                True,
                per_sample_weights,
                module.include_last_offset,
                padding,
            )
        return F.embedding(position, rows, padding, None, module.norm_type, module.scale_grad_by_freq, True)

    @property
    def param(self) -> torch.Tensor:
        return self.module.weight

    @property
    def rows(self) -> int:
        return self.param.shape[0]

    def split(self, ids: torch.Tensor) -> list[tuple[Slot, torch.Tensor, torch.Tensor]]:
        """Sorted ids cut by part: ``(slot, positions in ids, row numbers within the part)`` per part."""
        parts = len(self.slots)
        if parts == 1:
            return [(self.slots[0], torch.arange(ids.numel()), ids)]
        if self.slots[0].shard.row_stride > 1:  # by id modulo the parts
            part_of = torch.remainder(ids, parts)
            local = torch.div(ids, parts, rounding_mode="floor")
        else:  # contiguous runs
            part_of = torch.searchsorted(self._starts, ids, right=True) - 1
            local = ids - self._starts[part_of]
        out = []
        for k, slot in enumerate(self.slots):
            positions = torch.nonzero(part_of == k).squeeze(1)
            out.append((slot, positions, local[positions]))
        return out

    def held_ids(self) -> torch.Tensor:
        """The ids (sorted, on the host) of the rows of the local weight a lookup wrote."""
        if self.held is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.nonzero(self.held).squeeze(1)

    def take_prefetched(self, ids: torch.Tensor) -> Prefetched | None:
        """What was prefetched for a lookup of exactly these ids (given up once taken), or None."""
        for k, prefetched in enumerate(self.prefetched):
            if prefetched.matches(ids):
                return self.prefetched.pop(k)
        return None

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise RowIdError, naming the table, unless every (sorted) id is a row of it."""
        if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= self.rows):
            bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
            raise RowIdError(f"id {bad} looked up in embedding table {self.name!r}, which has rows 0..{self.rows - 1}")


@dataclass
class DynamicTable:
    """A dynamic table as the worker sees it: its module and the slots of its parts (one per ps task)."""

    name: str
    module: DynamicEmbedding
    slots: list[Slot]  # by part index
    # Rows pulled ahead for lookups to come (psframe.worker.model.prefetch): their distinct ids, their rows.
    prefetched: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def split(self, ids: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        """Ids cut by part: ``(slot, positions in ids)`` per part."""
        part = part_of(ids, len(self.slots))
        return [(slot, torch.nonzero(part == k).squeeze(1)) for k, slot in enumerate(self.slots)]

    def pull(self, ids: torch.Tensor, create: bool, pull: Pull) -> torch.Tensor:
        """The rows of ``ids`` (distinct, int64, on the host), from the parts that hold them
        (or prefetched for a training lookup of these ids)."""
        if create:
            for k, (prefetched_ids, _) in enumerate(self.prefetched):
                if torch.equal(prefetched_ids, ids):
                    return self.prefetched.pop(k)[1]
        parts = [(slot, positions, ids[positions]) for slot, positions in self.split(ids)]
        return pull_parts(pull, parts, ids.numel(), self.module.row_template, create=create)

    def cut(
        self, pushes: dict[int, list[RowPush]], used: tuple[torch.Tensor, torch.Tensor] | None, every_table: bool
    ) -> None:
        """Add a step's row gradients (``used``: ids and gradients, or None) to ``pushes``, a part at
        a time (see :meth:`~psframe.worker.model.tables.EmbeddingTables.gradients`; every part is
        listed once the table has a gradient)."""
        if used is None and not every_table:
            return
        if used is None:
            used = (torch.zeros(0, dtype=torch.int64), self.module.row_template)
        ids, grads = used
        for slot, positions in self.split(ids):
            pushes.setdefault(slot.shard.ps_task, []).append((slot.name, ids[positions], grads[positions]))

"""A worker's embedding tables: the rows a batch looks up are pulled, the rows it touched are pushed.

Every ``nn.Embedding`` and ``nn.EmbeddingBag`` built with ``sparse=True`` is
an embedding table: its weight lives on the ps tasks in parts
(:mod:`psframe.tables.spec`) and never travels whole. The
trainer hooks each table's module: before its forward, the ids it is about
to look up are pulled from the ps tasks into the local weight (only those
rows); after backward, its sparse gradient (duplicates summed) is cut by
part and pushed as ids plus rows. Nothing changes in the model's code.

While attached, a table module's forward looks the batch up in the pulled
rows alone (its ids numbered by their rank among the batch's distinct ids),
never in its full weight: a step touches as much memory for a table of
10^7 rows as for one of 10^4. The gradient is that of the pulled rows,
summed per id as backward sums an ``nn.Embedding(sparse=True)``'s. The
pulled rows are also written into the module's own weight (on huge pages
when it is large, see :mod:`psframe.memory.huge_pages`), so that rows a
batch looked up hold their last pulled values there; the others keep
whatever they had. A table's weight must be used only through its
module's forward (not tied to another layer), since only those lookups are seen.

A dynamic table (:class:`~psframe.worker.model.dynamic.DynamicEmbedding`) has
no local weight: its lookups get the rows of their distinct ids from the
ps tasks (one part per ps task, by id), and its gradients are those rows'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from psframe.config.options import RowCaching
from psframe.errors import PsframeError, RowIdError
from psframe.memory import huge_pages
from psframe.tables.dynamic_rows import part_of
from psframe.tables.rows import CachedPull, FreshRows, RowPull, RowPush, to_refresh
from psframe.worker.model.dynamic import DynamicEmbedding, Lookup, lookup_gradients
from psframe.worker.model.row_cache import RowCache
from psframe.worker.plan.step_plan import Slot

TABLE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)

EmbeddingModule = torch.nn.Embedding | torch.nn.EmbeddingBag  # what a table of a model is

# pull(wanted, create, staleness) -> rows: per ps task, (part, ids) pairs in, their rows out
# (PsClient.pull_rows); `create`: dynamic tables make the rows of ids they lack; a CachedPull
# (a row cache's, with `staleness`) is answered with FreshRows.
Pull = Callable[
    [Mapping[int, Sequence[RowPull | CachedPull]], bool, int], Mapping[int, Sequence[torch.Tensor | FreshRows]]
]


def find_tables(model: torch.nn.Module) -> dict[str, EmbeddingModule]:
    """The model's embedding tables: parameter name -> module, for every
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` and a trainable weight.

    Raises:
        ValueError: a table with ``max_norm`` (its forward rewrites rows in
            place, which a ps cannot follow), or whose weight another module shares.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    tables: dict[str, EmbeddingModule] = {}
    for module in model.modules():
        if not isinstance(module, TABLE_MODULES) or not module.sparse or not module.weight.requires_grad:
            continue
        name = names[id(module.weight)]
        if module.max_norm is not None:
            raise ValueError(
                f"embedding table {name!r} has max_norm={module.max_norm}: its forward renormalises "
                f"rows in place, which the ps tasks cannot follow; use sparse=False or no max_norm"
            )
        if owners[id(module.weight)] > 1:
            raise ValueError(
                f"embedding table {name!r} shares its weight with another module (tied weights); "
                f"a table is pulled and pushed by rows, so only its own lookups may use it: "
                f"use sparse=False to train it as a whole variable"
            )
        tables[name] = module
    return tables


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
    cache: RowCache | None = None  # rows kept between steps (Trainer's row_cache)
    _starts: torch.Tensor = field(init=False)
    looked_up: list[Lookup] = field(init=False, default_factory=list)  # this step's lookups
    prefetched: list[Prefetched] = field(init=False, default_factory=list)  # rows pulled ahead for lookups to come

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
        if torch.is_grad_enabled() and weight.requires_grad:
            rows.requires_grad_(True)
            self.looked_up.append((host_ids, rows))
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


# What attach() gives a table module of its own, for as long as it is attached.
_ATTACHED = ("forward", "__getstate__")


def _own_state(module: torch.nn.Module) -> dict[str, object]:
    """The state pickling takes of an attached table module (pickle reads ``__getstate__`` off
    the instance): its own, without the lookup through the ps tasks, which holds the trainer's
    client; a model saved or copied while the trainer is connected is the user's model."""
    return {name: value for name, value in module.__dict__.items() if name not in _ATTACHED}


class EmbeddingTables:
    """The tables of a replica, with their lookups hooked while attached to the ps tasks.

    Args:
        tables: parameter name -> module (from :func:`find_tables`).
        slots: the slots of every table part (any order).
    """

    def __init__(
        self,
        tables: Mapping[str, EmbeddingModule],
        slots: Sequence[Slot],
        dynamic: Mapping[str, DynamicEmbedding] | None = None,
        caching: RowCaching | None = None,
    ) -> None:
        by_table: dict[str, list[Slot]] = {}
        for slot in slots:
            by_table.setdefault(slot.shard.variable, []).append(slot)

        def cache_of(like: torch.Tensor) -> RowCache | None:
            if caching is None:
                return None
            return RowCache(like.shape[1:], like.dtype, caching.max_rows, caching.staleness)

        self.tables = [
            Table(name, module, sorted(by_table[name], key=lambda s: s.shard.part_index), cache_of(module.weight))
            for name, module in tables.items()
        ]
        self.dynamic = [
            DynamicTable(
                name, module, sorted(by_table[name], key=lambda s: s.shard.part_index), cache_of(module.row_template)
            )
            for name, module in (dynamic or {}).items()
        ]

    def __bool__(self) -> bool:
        return bool(self.tables or self.dynamic)

    def attach(self, pull: Pull) -> None:
        """Have each table's forward look its batch up in rows pulled from the ps tasks, from now on."""
        self.detach()
        # The pulled rows are written into the local weights at random: on
        # huge pages, as on the ps tasks, a large table costs a step about what a small one does.
        huge_pages.back(table.param for table in self.tables)
        for table in self.tables:
            # This module's own forward, for as long as it is attached (detach() removes it); the
            # module pickles (torch.save, copy.deepcopy) as the user's own, without it.
            table.module.forward = functools.partial(  # type: ignore[method-assign]
                table.lookup, functools.partial(self._pull, table, pull)
            )
            table.module.__getstate__ = functools.partial(_own_state, table.module)  # type: ignore[method-assign]
        for dynamic in self.dynamic:
            dynamic.module.attach(functools.partial(dynamic.pull, pull=pull))

    def detach(self) -> None:
        """Give the table modules their own forward back (the local weights keep the rows last pulled)."""
        for table in self.tables:
            for name in _ATTACHED:
                table.module.__dict__.pop(name, None)
            table.looked_up = []
            table.prefetched = []
        for dynamic in self.dynamic:
            dynamic.module.attach(None)
            dynamic.prefetched = []

    def drop_prefetched(self) -> None:
        """Forget the rows pulled ahead that no lookup took."""
        for table in self.tables:
            table.prefetched = []
        for dynamic in self.dynamic:
            dynamic.prefetched = []

    def has_gradients(self) -> bool:
        """Whether backward reached the rows of a lookup since the last step."""
        return any(rows.grad is not None for table in self.tables for _, rows in table.looked_up) or any(
            table.module.has_gradients() for table in self.dynamic
        )

    def table_of(self, module: torch.nn.Module) -> Table | DynamicTable:
        """The table ``module`` is.

        Raises:
            TypeError: ``module`` is none of this model's tables (an
                ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True``,
                or a :class:`~psframe.worker.model.dynamic.DynamicEmbedding`).
        """
        for table in self.tables:
            if table.module is module:
                return table
        for dynamic in self.dynamic:
            if dynamic.module is module:
                return dynamic
        raise TypeError(
            f"rows can be prefetched for the model's nn.Embedding/nn.EmbeddingBag tables built with "
            f"sparse=True and its DynamicEmbeddings; {type(module).__name__} is not an embedding table of the model"
        )

    @staticmethod
    def _pull(table: Table, pull: Pull, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (distinct, sorted, on the host) from the parts that hold them (or the cache)."""
        if table.cache is not None:
            return pull_cached(pull, table.split(ids), ids, table.cache)
        return pull_parts(pull, table.split(ids), ids.numel(), table.param, create=True)

    def step_state(self) -> list[tuple[list, list]]:
        """Each table's lookups of this step and rows pulled ahead (fixed tables, then dynamic), for
        :meth:`take_over`."""
        return [(table.looked_up, table.prefetched) for table in self.tables] + [
            (dynamic.module.lookups, dynamic.prefetched) for dynamic in self.dynamic
        ]

    def take_over(self, before: EmbeddingTables, state: list[tuple[list, list]]) -> None:
        """Go on from ``before`` (the same model's tables as placed before a re-layout, detached), as
        its :meth:`step_state` was: this step's lookups, and rows pulled ahead, are these tables'. The
        lists are shared by both, not copied: a lookup under way on ``before`` (its pull found the
        layout changed) records its rows here too."""
        fixed = len(self.tables)
        for table, old, (looked_up, prefetched) in zip(self.tables, before.tables, state[:fixed]):
            table.looked_up = old.looked_up = looked_up
            table.prefetched = old.prefetched = prefetched
        for dynamic, old_dynamic, (looked_up, prefetched) in zip(self.dynamic, before.dynamic, state[fixed:]):
            dynamic.module.lookups = looked_up  # one module: the lookup under way appends here
            dynamic.prefetched = old_dynamic.prefetched = prefetched

    def rows_moved(self, before: EmbeddingTables, part: str, ids: torch.Tensor, pull: Pull) -> torch.Tensor:
        """The rows a lookup asked of part ``part`` of ``before`` (the same model's tables as placed
        before a re-layout), read from these tables' parts: ``ids`` as that part numbers its rows.

        Raises:
            PsframeError: ``part`` is no part of a fixed table of ``before``.
        """
        dynamic = next((d for d in before.dynamic for slot in d.slots if slot.name == part), None)
        if dynamic is not None:  # a dynamic part is asked by the ids themselves
            return next(d for d in self.dynamic if d.name == dynamic.name).pull(ids, True, pull)
        slot = next((slot for table in before.tables for slot in table.slots if slot.name == part), None)
        if slot is None:
            raise PsframeError(f"{part!r} is no part of an embedding table placed before the re-layout")
        whole = slot.shard.row_start + ids * max(1, slot.shard.row_stride)  # the ids of the table
        table = next(table for table in self.tables if table.name == slot.shard.variable)
        return pull_parts(pull, table.split(whole), whole.numel(), table.param, create=True)

    @property
    def names(self) -> list[str]:
        """Every table's name (its weight's parameter name), fixed tables first."""
        return [table.name for table in self.tables] + [table.name for table in self.dynamic]

    def gradients(
        self, every_table: bool = False, except_tables: frozenset[str] = frozenset()
    ) -> dict[int, list[RowPush]]:
        """Per ps task, the rows each table's backward touched and their gradients,
        as ``(part, ids within the part, rows)`` on the host, duplicates summed.

        Every part of a table that has a gradient is listed, with no rows if
        the batch touched none of its ids: its optimizer counts the step, as
        one process's would. With ``every_table`` (synchronous training,
        where an update waits for every variable of every member), a table
        without a gradient is listed too, with no rows; but for those of
        ``except_tables`` (applied at once, outside the rounds).

        Raises:
            PsframeError: a table's weight got a gradient (it was used
                outside its module's forward, which the ps tasks cannot follow).
        """
        return self.cut(self.take_row_gradients(), every_table, except_tables)

    def take_row_gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each table's rows this step's backward touched (ids of the whole table) and their
        gradients, duplicates summed; None for a table the batch did not use. Taken: the next
        step's lookups start afresh. :meth:`cut` shares them out among the parts.

        Raises:
            PsframeError: a table's weight got a gradient of its whole weight.
        """
        used: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for table in self.tables:
            if table.param.grad is not None:
                raise PsframeError(
                    f"embedding table {table.name!r} got a gradient of its whole weight: it was "
                    f"used outside its module's forward"
                )
            used[table.name] = lookup_gradients(table.looked_up)
            table.looked_up = []
        for dynamic in self.dynamic:
            used[dynamic.name] = dynamic.module.take_gradients()
        return used

    def cut(
        self,
        used: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None],
        every_table: bool = False,
        except_tables: frozenset[str] = frozenset(),
    ) -> dict[int, list[RowPush]]:
        """:meth:`gradients` of the row gradients :meth:`take_row_gradients` took (of these
        tables, or of the same model placed otherwise: a re-layout's), cut for these parts."""
        pushes: dict[int, list[RowPush]] = {}
        for table in self.tables:
            rows = used.get(table.name)
            if rows is None:
                if every_table and table.name not in except_tables:
                    for slot in table.slots:
                        pushes.setdefault(slot.shard.ps_task, []).append(
                            (
                                slot.name,
                                torch.zeros(0, dtype=torch.int64),
                                torch.zeros((0, *table.param.shape[1:]), dtype=table.param.dtype),
                            )
                        )
                continue
            ids, values = rows
            for slot, positions, local in table.split(ids):
                pushes.setdefault(slot.shard.ps_task, []).append((slot.name, local, values[positions]))
        for dynamic in self.dynamic:
            dynamic.cut(pushes, used.get(dynamic.name), every_table and dynamic.name not in except_tables)
        return pushes


@dataclass
class DynamicTable:
    """A dynamic table as the worker sees it: its module and the slots of its parts (one per ps task)."""

    name: str
    module: DynamicEmbedding
    slots: list[Slot]  # by part index
    cache: RowCache | None = None  # rows kept between steps (Trainer's row_cache)
    # Rows pulled ahead for lookups to come (psframe.worker.model.prefetch): their distinct ids, their rows.
    prefetched: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def split(self, ids: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
        """Ids cut by part: ``(slot, positions in ids)`` per part."""
        part = part_of(ids, len(self.slots))
        return [(slot, torch.nonzero(part == k).squeeze(1)) for k, slot in enumerate(self.slots)]

    def pull(self, ids: torch.Tensor, create: bool, pull: Pull) -> torch.Tensor:
        """The rows of ``ids`` (distinct, int64, on the host), from the parts that hold them
        (or prefetched for a training lookup of these ids, or kept in the row cache)."""
        if create:
            for k, (prefetched_ids, _) in enumerate(self.prefetched):
                if torch.equal(prefetched_ids, ids):
                    return self.prefetched.pop(k)[1]
        parts = [(slot, positions, ids[positions]) for slot, positions in self.split(ids)]
        if create and self.cache is not None:  # training's lookups; an evaluation's peeks ask the ps tasks
            return pull_cached(pull, parts, ids, self.cache)
        return pull_parts(pull, parts, ids.numel(), self.module.row_template, create=create)

    def cut(
        self, pushes: dict[int, list[RowPush]], used: tuple[torch.Tensor, torch.Tensor] | None, every_table: bool
    ) -> None:
        """Add a step's row gradients (``used``: ids and gradients, or None) to ``pushes``, a part at
        a time (see :meth:`EmbeddingTables.gradients`; every part is listed once the table has a gradient)."""
        if used is None and not every_table:
            return
        if used is None:
            used = (torch.zeros(0, dtype=torch.int64), self.module.row_template)
        ids, grads = used
        for slot, positions in self.split(ids):
            pushes.setdefault(slot.shard.ps_task, []).append((slot.name, ids[positions], grads[positions]))


Placed = list[tuple[int, torch.Tensor]]  # per part asked: its ps task, and where its rows go among the ids


def pull_parts(
    pull: Pull,
    parts: Sequence[tuple[Slot, torch.Tensor, torch.Tensor]],
    count: int,
    like: torch.Tensor,
    *,
    create: bool,
) -> torch.Tensor:
    """The rows of ``count`` ids, pulled from the parts that hold them, in the ids' order.

    Args:
        parts: ``(slot, positions among the ids, ids as the part knows them)`` per part.
        like: a tensor of the table's row shape (beyond dim 0) and dtype.
        create: dynamic tables make the rows of ids they lack.
    """
    wanted, placed = plan_parts(parts)
    pulled = cast(Mapping[int, Sequence[torch.Tensor]], pull(wanted, create, 0) if placed else {})  # no cache: rows
    return assemble_parts(pulled, placed, count, like)


def pull_cached(
    pull: Pull, parts: Sequence[tuple[Slot, torch.Tensor, torch.Tensor]], ids: torch.Tensor, cache: RowCache
) -> torch.Tensor:
    """As :func:`pull_parts` (training's lookups), through a row cache: each part is told the
    versions the cache holds, and sends only the rows that moved past them by more than its staleness."""
    slots, cached = cache.versions(ids)
    wanted: dict[int, list[RowPull | CachedPull]] = {}
    placed = []
    for slot, positions, part_ids in parts:
        if part_ids.numel():
            wanted.setdefault(slot.shard.ps_task, []).append(CachedPull(slot.name, part_ids, cached[positions]))
            placed.append((slot.shard.ps_task, positions))
    pulled = {ps_task: list(values) for ps_task, values in pull(wanted, True, cache.staleness).items()}
    versions = torch.empty_like(ids)
    refresh = torch.zeros(ids.numel(), dtype=torch.bool)
    fresh_at: list[torch.Tensor] = []
    fresh_rows: list[torch.Tensor] = []
    for ps_task, positions in placed:
        answer = pulled[ps_task].pop(0)
        if not isinstance(answer, FreshRows):
            raise PsframeError(f"ps task {ps_task} answered a pull through the row cache without row versions")
        versions[positions] = answer.versions
        picked = to_refresh(cached[positions], answer.versions, cache.staleness)
        refresh[positions[picked]] = True
        fresh_at.append(positions[picked])
        fresh_rows.append(answer.rows)
    rows = torch.empty((ids.numel(), *cache.row_shape), dtype=cache.dtype)
    if fresh_at:
        rows[torch.cat(fresh_at)] = torch.cat(fresh_rows).to(cache.dtype)
    return cache.fill(ids, slots, versions, refresh, rows[refresh])


def plan_parts(parts: Sequence[tuple[Slot, torch.Tensor, torch.Tensor]]) -> tuple[dict[int, list[RowPull]], Placed]:
    """What to ask each ps task for the rows of ``parts`` (see :func:`pull_parts`), and where their rows go."""
    wanted: dict[int, list[RowPull]] = {}
    placed = []
    for slot, positions, part_ids in parts:
        if part_ids.numel():
            wanted.setdefault(slot.shard.ps_task, []).append((slot.name, part_ids))
            placed.append((slot.shard.ps_task, positions))
    return wanted, placed


def assemble_parts(
    pulled: Mapping[int, Sequence[torch.Tensor]], placed: Placed, count: int, like: torch.Tensor
) -> torch.Tensor:
    """The rows of ``count`` ids from what each ps task answered to :func:`plan_parts`'s requests."""
    if not placed:
        return torch.empty((count, *like.shape[1:]), dtype=like.dtype)
    if len(placed) == 1:  # one part holds every id (in order): its rows as they arrived, not copied
        return pulled[placed[0][0]][0]
    remaining = {ps_task: list(values) for ps_task, values in pulled.items()}
    rows = torch.empty((count, *like.shape[1:]), dtype=like.dtype)
    for ps_task, positions in placed:
        rows[positions] = remaining[ps_task].pop(0)
    return rows

"""The rows of a dynamic embedding table: any int64 id, a row made on first touch.

A dynamic table (:class:`psframe.DynamicEmbedding`) has no size: it takes
any int64 id (a hashed feature, a user id) and makes that id's row the first
time it is looked up or updated, from the table's
:class:`~psframe.tables.spec.RowInitializer` (the same id always
gets the same row). Its memory follows the ids it holds, never the id
space. :class:`~psframe.tables.spec.Admission` may hold a new
id back until it was seen often enough (:mod:`psframe.tables.admission`), and
:class:`~psframe.tables.spec.Eviction` bounds the rows: a cap,
least recently or least frequently updated rows first; an age, in updates
or in wall-clock time, after which an untouched row is forgotten; a norm
below which an updated row is dropped.

:class:`DynamicRows` holds one part of such a table: on a ps task (one part
per ps task, :func:`~psframe.tables.spec.place_dynamic`), or
the whole table in one process (:class:`psframe.worker.model.dynamic.DynamicTables`).
Rows live in the slots of one tensor that doubles when full, with the
table optimizer's per-row state beside them; an id's slot is found in a
sorted index (:class:`~psframe.tables.id_index.IdIndex`). A row evicted frees
its slot for the next new id, whose values and optimizer state start fresh.

Beside the rows, a part keeps what the rules over them read, each in a
module of its own: the rows' ages, by which its eviction picks the rows to
forget (:mod:`psframe.tables.eviction`), and what changed, for delta
checkpoints (:mod:`psframe.tables.change_stamps`).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from psframe.errors import InvalidGradientError, RowIdError
from psframe.memory import Memory
from psframe.optim import OptimizerSpec, kernels
from psframe.optim.gathered_step import widen_row_state
from psframe.optim.row_state import fresh_row_state, is_row_state
from psframe.optim.schedule_clock import ScheduleClock
from psframe.tables.admission import AdmissionFilter
from psframe.tables.change_stamps import ChangeStamps
from psframe.tables.compact import compact_step, storage_dtype
from psframe.tables.disk_tier import DiskTier, ram_rows_of, slot_bytes
from psframe.tables.eviction import EvictionPolicy
from psframe.tables.id_index import IdIndex
from psframe.tables.row_math import initial_rows, row_gradient, rows_between, summed_by_id
from psframe.tables.spec import DynamicTableSpec

INITIAL_SLOTS = 1024
COUNTS = ("admitted", "filtered", "evicted")  # what became of new ids, kept in status and checkpoints


class DynamicRows:
    """One part of a dynamic table: the ids it holds, their rows and the table optimizer's state of them.

    Not thread-safe: a ps task calls it under its store's lock.

    Args:
        name: the part's name, for error messages.
        row_shape: the shape of a row (``(embedding_dim,)``).
        dtype: the rows' dtype.
        spec: the table's initializer and eviction.
        optimizer: the table optimizer (one that takes sparse gradients); None
            for rows that are only read (a reference, a loaded checkpoint).
        slots: rows to make room for at first (doubled as ids arrive).
        memory: where the rows' optimizer state and grown slots live
            (:class:`psframe.memory.Memory`); plain torch by default.
        wall_clock: the time in seconds, for ``ttl_seconds`` eviction (default:
            ``time.time``, which checkpoints keep meaning across restarts).
        schedule: the table optimizer's learning-rate schedule, which brings it to the global
            step's rate before each step (:mod:`psframe.optim.schedule_clock`); None: none.
        disk_folder: where the rows beyond the table's ``ram_budget`` go
            (:mod:`psframe.tables.disk_tier`); None: the system's temporary folder.
        lock: the lock this part is used under, if any, which the disk tier's spills ahead take.
    """

    def __init__(
        self,
        name: str,
        row_shape: Sequence[int],
        dtype: torch.dtype,
        spec: DynamicTableSpec,
        optimizer: OptimizerSpec | None = None,
        *,
        slots: int = INITIAL_SLOTS,
        memory: Memory | None = None,
        wall_clock: Callable[[], float] = time.time,
        schedule: ScheduleClock | None = None,
        disk_folder: str | None = None,
        lock: Any = None,
    ) -> None:
        self.name = name
        self._schedule, self._scheduled = schedule, -1  # the schedule's version the optimizer is at
        self._memory = memory if memory is not None else Memory()
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.spec = spec
        self.optimizer_spec = optimizer
        slots = max(1, slots)
        # Compact rows (spec.storage): the rows are kept in fewer bytes than the table's dtype, and
        # read, written and checkpointed in the table's dtype (mod:`psframe.tables.compact`).
        storage = storage_dtype(spec.storage) if spec.storage is not None else dtype
        self.compact = storage != dtype
        self.weight = torch.zeros((slots, *self.row_shape), dtype=storage, requires_grad=True)
        self.optimizer = optimizer.build([self.weight], per_parameter=True) if optimizer is not None else None
        if self.compact and self.optimizer is not None:
            widen_row_state(self.optimizer, self.weight, self._memory.full)  # state stays float32
        self._fresh = fresh_row_state(optimizer.name, dict(optimizer.kwargs)) if optimizer is not None else {}
        self._compact_step = functools.partial(
            compact_step, fresh=self._fresh, full=self._memory.full, seed=spec.initializer.seed
        )
        self._index = IdIndex()
        self._id_of = torch.zeros(slots, dtype=torch.int64)
        self._used = torch.zeros(slots, dtype=torch.bool)
        self._free: list[int] = []  # slots whose row was evicted
        self._next = 0  # slots from here on were never used
        self._admission = AdmissionFilter(spec.admission, spec.initializer.seed)
        self._eviction = EvictionPolicy(spec.eviction, slots, wall_clock)  # the rows' ages
        self._stamps = ChangeStamps(slots)  # what changed, for delta checkpoints
        self._state_keys: set[str] = set()  # the optimizer's state keys as of the last stamp
        self.admitted = 0  # ids given a row (a restore's rows aside)
        self.filtered = 0  # training lookups' ids refused a row by the admission
        self.evicted = 0  # rows evicted, for any reason
        self.tier: DiskTier | None = None  # the rows beyond the table's ram_budget, on local disk
        if spec.ram_budget is not None:
            row_state = [v for v in self._state().values() if self._per_row(v)]
            slot = slot_bytes(self.weight, row_state, self.optimizer is not None)
            self.tier = DiskTier(name, ram_rows_of(spec.ram_budget, slot), disk_folder, lock)
            weakref.finalize(self, self.tier.close)

    def __len__(self) -> int:
        return len(self._index) + (len(self.tier) if self.tier is not None else 0)

    @property
    def clock(self) -> int:
        """Updates of this part so far."""
        return self._eviction.clock

    @property
    def epoch(self) -> int:
        """What changes now is stamped with (:mod:`psframe.tables.change_stamps`); the store sets it."""
        return self._stamps.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._stamps.epoch = value

    @property
    def slots(self) -> int:
        """The rows there is memory for (a power of two times the initial slots)."""
        return self.weight.shape[0]

    def nbytes(self) -> int:
        """Bytes of the slots (rows, per-row optimizer state, bookkeeping) and of the id index."""
        total = self.weight.numel() * self.weight.element_size()
        for value in self._state().values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
        return total + self.slots * (5 * 8 + 1) + self._index.nbytes()  # id, 4 int64/float64 stamps, used

    # ---- reading and updating

    def read(self, ids: torch.Tensor, *, create: bool = True) -> torch.Tensor:
        """A copy of the rows of ``ids`` (1-d int64, any values, distinct or not).

        With ``create`` (a training lookup) an id not held is given its row,
        if the table's admission lets it in, and counts against the cap;
        without (an evaluation's lookup), nothing is kept. An id with no row
        reads as its initial row.

        Raises:
            RowIdError: making the new rows would evict rows this read uses
                (more distinct new ids than the cap allows).
        """
        if create:
            slots = self._slots(ids, admit=True)  # first: making rows may grow the weight
            if not self.spec.admission.filters:
                rows = self.weight.detach().index_select(0, slots).to(self.dtype)
                self._saw(slots)
                return rows
        else:
            slots = self._index.find(ids)  # nothing moves in from disk: _rows_of reads rows there
        rows = self._rows_of(ids, slots)
        if create:
            self._saw(slots[slots >= 0])
        return rows

    def _rows_of(self, ids: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Copies of the rows of ``ids`` at ``slots``; the initial row where the slot is -1."""
        held = slots >= 0
        if bool(held.all()):
            return self.weight.detach().index_select(0, slots).to(self.dtype)
        rows = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        rows[held] = self.weight.detach().index_select(0, slots[held]).to(self.dtype)
        made = initial_rows(self.spec.initializer, ids[~held], self.row_shape, self.weight.dtype)
        if self.tier is not None:
            self.tier.read_into(made, ids[~held])  # rows on disk stay there
        rows[~held] = made.to(self.dtype)  # as the row would be made: in the rows' storage
        return rows

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One step of the table optimizer with these rows' gradients (an id
        may repeat: its gradients are summed); an id not held is made first,
        unless the table admits new ids by count or chance: then its lookup
        did not admit it, and its gradient is dropped.
        With no ids, the optimizer still counts a step, as for a batch that used the table.

        Raises:
            InvalidGradientError: this part holds rows only to read (it has no optimizer).
        """
        if self.optimizer is None:
            raise InvalidGradientError(
                f"dynamic table part {self.name!r} holds rows only to read: it has no optimizer to apply "
                f"gradients with; nothing was applied"
            )
        ids, grads = summed_by_id(ids, grads)  # in an order of the ids, never of their slots
        if self.spec.admission.filters:
            # Ids the admission refused at their lookup have no row: their gradients are dropped.
            slots = self._lookup(ids)
            held = slots >= 0
            if not bool(held.all()):
                slots, grads = slots[held], grads[held]
        else:
            slots = self._slots(ids)
        grad = row_gradient(slots, grads, self.weight.shape)
        if self._schedule is not None:
            self._scheduled = self._schedule.apply(self.optimizer, self._scheduled)
        touched = grad.indices()[0]
        if self.compact:
            ids_touched, steps = self._id_of[touched], self._eviction.updates(touched)
            self._compact_step(self.optimizer, self.weight, touched, grad.values(), ids_touched, steps)
        else:
            self.weight.grad = grad
            try:
                kernels.step(self.optimizer, rows=True)
                self._memory.back_state(self.optimizer)  # state torch made at this step (SparseAdam's first)
            finally:
                self.weight.grad = None
        self._eviction.updated(touched)
        self._stamps.updated(touched)
        if self._state_keys != set(self._state()):  # state torch made at this step: every row's is new
            self._state_keys = set(self._state())
            self._stamps.changed(self._used)
        self._evict(self._eviction.aged_out(self._used))
        self._saw(touched)
        self._evict(self._eviction.too_small(touched, self.weight))

    # ---- checkpoints

    def export(self) -> dict[str, Any]:
        """What a checkpoint keeps: ids (sorted), their rows, per-row and other optimizer state, ages."""
        exported = self._export(torch.nonzero(self._used).squeeze(1))
        return self.tier.with_rows_on_disk(self, exported, None) if self.tier is not None else exported

    def export_changes(self, since: int) -> dict[str, Any]:
        """What a delta checkpoint keeps: as :meth:`export`, of the rows changed after epoch ``since``
        only, plus ``deleted``, the ids evicted after it (sorted; an id evicted and made again is in both)."""
        changed = self._export(self._stamps.changed_since(since, self._used))
        if self.tier is not None:
            changed = self.tier.with_rows_on_disk(self, changed, since)
        changed["deleted"] = self._stamps.removed_since(since)
        return changed

    def close_epoch(self, oldest: int) -> None:
        """Move on to the next epoch (a snapshot was taken); forget evictions no delta after ``oldest`` needs."""
        self._stamps.close_epoch(oldest)

    def _export(self, slots: torch.Tensor) -> dict[str, Any]:
        order = torch.argsort(self._id_of[slots])
        slots = slots[order]
        state = {}
        for key, value in self._state().items():
            if self._per_row(value):
                state[key] = value.index_select(0, slots)
            else:
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return {
            "ids": self._id_of[slots].clone(),
            "rows": self.weight.detach().index_select(0, slots).to(self.dtype),
            "state": state,
            **self._eviction.export(slots),
            "counts": self.counts(),
            "admission": self._admission.state_dict(),
        }

    def counts(self) -> dict[str, int]:
        """The ids this part admitted (gave a row), filtered (refused a row) and evicted so far."""
        return dict(zip(COUNTS, (self.admitted, self.filtered, self.evicted)))

    def load(self, saved: Mapping[str, Any]) -> None:
        """Take rows, state and ages as :meth:`export` gave them (this part must be empty); with a
        disk tier, a RAM tier's half at a time, the rows beyond it going to disk."""
        count = saved["ids"].numel()
        step = count if self.tier is None else max(1, self.tier.ram_rows // 2)
        for start in range(0, max(count, 1), max(step, 1)):
            self._load_rows(rows_between(saved, start, start + step), first=start == 0)
        counts = saved.get("counts") or {}  # absent in older files: counted from the restore
        self.admitted, self.filtered, self.evicted = (int(counts.get(k, 0)) for k in COUNTS)
        self._admission.load_state_dict(saved.get("admission") or {})
        self._state_keys = set(self._state())

    def _load_rows(self, saved: Mapping[str, Any], first: bool) -> None:
        """Take the rows of ``saved``; the ``first`` of a load makes the state it holds anew."""
        ids = saved["ids"]
        slots = self._slots(ids, fill=False)
        with torch.no_grad():
            self.weight.index_copy_(0, slots, saved["rows"].to(self.weight.dtype))
        if saved["state"] and self.optimizer is not None:
            state = self.optimizer.state[self.weight]
            for key, value in saved["state"].items():
                if is_row_state(value, (ids.numel(), *self.row_shape)):
                    if first or not self._per_row(state.get(key)):
                        shape = (self.slots, *value.shape[1:])
                        state[key] = self._memory.full(shape, self._fresh.get(key, 0.0), value.dtype)
                    state[key].index_copy_(0, slots, value)
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        self._eviction.load(slots, saved)

    # ---- the disk tier's view of the slots (psframe.tables.disk_tier.TieredPart)

    def columns(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor of a row, by name: the row, its per-row state, ages and stamps."""
        state = {f"state.{key}": value for key, value in self._state().items() if self._per_row(value)}
        return {"row": self.weight.detach(), **state, **self._eviction.columns(), **self._stamps.columns()}

    def held_in_ram(self) -> int:
        return len(self._index)

    def in_ram(self, ids: torch.Tensor) -> torch.Tensor:
        return self._index.find(ids) >= 0

    def used_slots(self) -> torch.Tensor:
        return self._used

    def release(self, slots: torch.Tensor) -> torch.Tensor:
        ids = self._id_of[slots]
        self._index.remove(ids)
        self._free.extend(slots.tolist())
        self._used[slots] = False
        return ids

    def occupy(self, ids: torch.Tensor) -> torch.Tensor:
        slots = self._take_slots(ids.numel())
        self._index.add(ids, slots)
        self._id_of[slots] = ids
        self._used[slots] = True
        return slots

    # ---- slots

    def _state(self) -> dict[str, Any]:
        return self.optimizer.state.get(self.weight, {}) if self.optimizer is not None else {}

    def _per_row(self, value: Any) -> bool:
        return is_row_state(value, self.weight.shape)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it has none; rows of ``ids`` on disk are brought back first."""
        slots = self._index.find(ids)
        if self.tier is not None:
            missing = slots < 0
            if len(self.tier) and bool(missing.any()):
                self.tier.bring_in(self, torch.unique(ids[missing]), keep=slots[~missing])
                slots[missing] = self._index.find(ids[missing])
            self.tier.touch(self, slots[slots >= 0])
            self.tier.wake(self)
        return slots

    def _slots(self, ids: torch.Tensor, *, fill: bool = True, admit: bool = False) -> torch.Tensor:
        """The slots of ``ids``, making those not held (their initial rows and fresh state, unless not ``fill``).

        With ``admit`` (a training lookup) the table's admission decides which
        new ids get a row; the slot of an id refused is -1.
        """
        slots = self._lookup(ids)
        missing = slots < 0
        if not bool(missing.any()):
            return slots
        wanted = ids[missing]
        new_ids, occurrences = torch.unique(wanted, return_counts=True)
        if admit and self.spec.admission.filters:
            admitted = self._admission.admit(new_ids, occurrences)
            self.filtered += int(new_ids.numel() - int(admitted.sum()))
            new_ids = new_ids[admitted]
            if not new_ids.numel():
                return slots
        self._make_room(new_ids.numel(), keep=slots[~missing])
        new_slots = self._take_slots(new_ids.numel())
        self._index.add(new_ids, new_slots)
        self._id_of[new_slots] = new_ids
        self._used[new_slots] = True
        self._eviction.made(new_slots)
        if self.tier is not None:
            self.tier.touch(self, new_slots)
        self._stamps.made(new_slots, restored=not fill)  # a restored row is as the snapshot holds it
        if fill:
            with torch.no_grad():
                self.weight.index_copy_(
                    0, new_slots, initial_rows(self.spec.initializer, new_ids, self.row_shape, self.weight.dtype)
                )
            for key, value in self._state().items():
                if self._per_row(value):
                    value.index_fill_(0, new_slots, self._fresh.get(key, 0.0))
            self.admitted += new_ids.numel()
        at = torch.searchsorted(new_ids, wanted).clamp_(max=new_ids.numel() - 1)
        slots[missing] = torch.where(new_ids[at] == wanted, new_slots[at], -1)
        return slots

    def _take_slots(self, count: int) -> torch.Tensor:
        """``count`` unused slots: evicted rows' first, then never used ones (growing as needed)."""
        reused = self._free[len(self._free) - min(count, len(self._free)) :]
        del self._free[len(self._free) - len(reused) :]
        fresh = count - len(reused)
        while self._next + fresh > self.slots:
            self._grow()
        self._next += fresh
        return torch.cat(
            [torch.tensor(reused, dtype=torch.int64), torch.arange(self._next - fresh, self._next, dtype=torch.int64)]
        )

    def _grow(self) -> None:
        """Double the slots (up to the RAM tier's rows); rows and optimizer state keep their slots."""
        old = self.slots
        new = 2 * old if self.tier is None else max(old + 1, min(2 * old, self.tier.ram_rows))

        def doubled(tensor: torch.Tensor, fill: float | bool = 0) -> torch.Tensor:
            grown = self._memory.full((new, *tensor.shape[1:]), fill, tensor.dtype)
            grown[:old] = tensor
            return grown

        for key, value in self._state().items():
            if self._per_row(value):
                self._state()[key] = doubled(value, self._fresh.get(key, 0.0))
        with torch.no_grad():
            self.weight.data = doubled(self.weight.detach())
        self._id_of, self._used = doubled(self._id_of), doubled(self._used, False)
        self._eviction.grow(doubled)
        self._stamps.grow(doubled)

    def _make_room(self, new: int, keep: torch.Tensor) -> None:
        """Evict rows (never those in ``keep``) until ``new`` more fit under the cap; spill rows to
        disk until they fit in the RAM tier."""
        if self.tier is not None:
            self.tier.room(self, new, keep)
        excess = self._eviction.excess(len(self), new)
        if excess <= 0:
            return
        victims = self._eviction.victims(excess, self._used, keep)
        if victims is None:
            raise RowIdError(
                f"dynamic table {self.name!r} keeps at most {self.spec.eviction.max_rows} rows on its ps task, "
                f"but one request uses {int(keep.unique().numel()) + new} of them; raise its max_rows"
            )
        self._evict(victims)

    def _saw(self, slots: torch.Tensor) -> None:
        """Mark the rows of ``slots`` seen now, where the eviction times rows; once in a while,
        evict those not seen for ``ttl_seconds``."""
        if self._eviction.timed:
            self._stamps.changed(slots)
            self._evict(self._eviction.saw(slots, self._used))

    def _evict(self, slots: torch.Tensor | None) -> None:
        """Forget the rows of ``slots`` (None: no row): their ids go, their slots wait for new ids."""
        if slots is None or not slots.numel():
            return
        ids = self._id_of[slots]
        self._stamps.removed(ids)
        if self.tier is not None:
            self.tier.forget(ids)  # a stale copy on disk must not bring the row back
        self._index.remove(ids)
        self._free.extend(slots.tolist())
        self._used[slots] = False
        self.evicted += slots.numel()

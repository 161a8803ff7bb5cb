"""A dynamic table part's disk tier: the rows beyond its RAM budget, on the ps host's local disk.

A part with a RAM budget (:class:`psframe.DynamicEmbedding`'s ``ram_budget``)
holds at most :attr:`DiskTier.ram_rows` rows in its slots. The rows used
longest ago (looked up or updated: the tier keeps its own clock of use, apart
from the ages eviction reads and checkpoints keep) go to disk with everything
a slot holds of them (the row, its per-row optimizer state, ages and change
stamps: one record each, :class:`~psframe.tables.disk_rows.RecordLayout`).
Where the part is used under a lock (a ps task's store), a thread of the
tier's spills ahead, between requests, while the RAM tier is fuller than
:data:`SPILL_SHARE` allows, so that a request rarely waits on a write; a
request that still finds no room spills itself, a sixteenth of the RAM tier
at once. A request for an id whose row is on disk reads the record back into
a slot, bit for bit: a row trains exactly as if it had never left RAM. The
record stays on disk as a stale copy (deleting it would cost more than the
read), overwritten when the row goes back; the row in RAM is the one that
counts, and a row evicted from RAM has its copy deleted with it.

The part tells the tier what its slots hold through :class:`TieredPart`;
the tier decides when and which rows move, and moves them through
:class:`~psframe.tables.disk_rows.DiskRows`. A prefetch of the next batch's
rows (``Trainer.prefetch``) reads them on the ps task while the worker
computes, so rows on disk come back off the step's critical path.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import numpy
import torch

from psframe.errors import PsframeError, RowIdError
from psframe.optim.row_state import is_row_state
from psframe.tables.disk_rows import DiskRows, RecordLayout

SPILL_SHARE = 16
"""The RAM tier is kept 1/SPILL_SHARE free ahead of requests; a request that must spill sends that much at once."""
SCAN_ROWS = 1 << 16  # rows on disk read at a time by an export
SPILL_CHUNK = 8192  # rows a spill ahead sends under one hold of the lock

log = logging.getLogger(__name__)
_NONE = torch.zeros(0, dtype=torch.int64)  # no slot to keep


class TieredPart(Protocol):
    """What a disk tier needs of its table part (:class:`~psframe.tables.dynamic_rows.DynamicRows`)."""

    name: str

    def columns(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor a row has (its row, per-row state, ages, stamps), by name."""
        ...

    def held_in_ram(self) -> int:
        """Rows in slots now."""
        ...

    def in_ram(self, ids: torch.Tensor) -> torch.Tensor:
        """Whether each of ``ids`` has its row in a slot."""
        ...

    @property
    def slots(self) -> int:
        """The part's slots (those holding rows and free ones)."""
        ...

    def used_slots(self) -> torch.Tensor:
        """Whether each slot holds a row (bool, one per slot)."""
        ...

    def release(self, slots: torch.Tensor) -> torch.Tensor:
        """Let go of the rows of ``slots`` (gone to disk, not evicted); their ids."""
        ...

    def occupy(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for ``ids`` (none held), indexed; their tensors are then written by the tier."""
        ...


class DiskTier:
    """The RAM bound of a dynamic table part and the rows beyond it, on local disk.

    Args:
        name: the part's name (for its folder and errors).
        ram_rows: the most rows the part keeps in its slots.
        folder: where the part's store goes (default: the system's temporary folder).
        lock: the lock the part is used under, which its spills ahead take; None: no spill ahead.
    """

    def __init__(self, name: str, ram_rows: int, folder: str | None = None, lock: Any = None) -> None:
        self.name = name
        self.ram_rows = max(1, ram_rows)
        self._share = max(1, self.ram_rows // SPILL_SHARE)
        self._used_at = torch.zeros(0, dtype=torch.int64)  # the tier's clock of use, per slot
        self._clock = 0
        self._lock = lock
        self._wanted = threading.Event()
        self._closed = False
        self._spiller: threading.Thread | None = None
        self.disk = DiskRows(name, folder)
        self._layout: RecordLayout | None = None
        self._signature: tuple | None = None
        self.spilled = 0  # rows sent to disk, in all
        self.brought_in = 0  # rows taken back from disk, in all
        self._copies = 0  # rows in RAM with a stale copy on disk

    def __len__(self) -> int:
        """Rows on disk only (not in RAM)."""
        return len(self.disk) - self._copies

    def close(self) -> None:
        """Stop spilling ahead (the thread ends at its next look); remove the rows on disk and their folder.

        Takes the part's lock, so that no spill is under way (a part dropped under its store's lock
        closes at once: the lock is reentrant)."""
        self._closed = True
        self._wanted.set()
        with self._lock if self._lock is not None else contextlib.nullcontext():
            self.disk.close()

    def touch(self, part: TieredPart, slots: torch.Tensor) -> None:
        """The rows of ``slots`` are used now (looked up, made or brought in)."""
        if self._used_at.numel() < part.slots:
            grown = torch.zeros(part.slots, dtype=torch.int64)
            grown[: self._used_at.numel()] = self._used_at
            self._used_at = grown
        self._clock += 1
        self._used_at.index_fill_(0, slots, self._clock)

    def room(self, part: TieredPart, new: int, keep: torch.Tensor) -> None:
        """Spill rows to disk (never those of ``keep``) until ``new`` more fit in the RAM tier.

        Raises:
            RowIdError: the rows of ``keep`` and ``new`` are more than the RAM tier holds.
        """
        held = part.held_in_ram()
        excess = held + new - self.ram_rows
        if excess <= 0:
            return
        victims = self._coldest(part, excess + self._share, keep)
        if victims.numel() < excess:
            raise RowIdError(
                f"dynamic table part {self.name!r} keeps {self.ram_rows} rows in RAM (its ram_budget), but one "
                f"request uses {held + new - victims.numel()} of them at once; raise its ram_budget"
            )
        self._spill(part, victims)

    def _coldest(self, part: TieredPart, count: int, keep: torch.Tensor) -> torch.Tensor:
        """At most ``count`` slots holding rows, never those of ``keep``, used longest ago first."""
        score = torch.zeros(part.slots, dtype=torch.int64)
        score[: self._used_at.numel()] = self._used_at[: part.slots]
        never = torch.iinfo(torch.int64).max
        score[~part.used_slots()] = never
        score[keep] = never
        count = min(count, int((score < never).sum()))
        return torch.topk(score, count, largest=False).indices if count else keep[:0]

    def _spill(self, part: TieredPart, victims: torch.Tensor) -> None:
        records = self.layout(part).pack(part.columns(), victims)
        ids = part.release(victims)
        added = self.disk.put(ids, records)  # the others overwrite their stale copies
        self._copies -= ids.numel() - added
        self.spilled += ids.numel()

    def wake(self, part: TieredPart) -> None:
        """Spill ahead (in the tier's thread, under the part's lock) if the RAM tier is fuller than
        its share of free room allows; call under that lock, at the end of a request."""
        if self._lock is None or self._closed or part.held_in_ram() <= self.ram_rows - self._share:
            return
        if self._spiller is None:
            self._spiller = threading.Thread(
                target=self._spill_ahead, args=(weakref.ref(part),), name=f"spill {self.name}", daemon=True
            )
            self._spiller.start()
        self._wanted.set()

    def _spill_ahead(self, ref: weakref.ReferenceType) -> None:
        """The tier's thread: on each wake, spill down to two shares of free room, a chunk a hold of the lock."""
        while not self._closed:
            if not self._wanted.wait(timeout=1.0):
                continue
            self._wanted.clear()
            try:
                while not self._closed:
                    part = ref()
                    if part is None:
                        return
                    with self._lock:
                        excess = part.held_in_ram() - (self.ram_rows - 2 * self._share)
                        if excess <= 0 or self._closed:
                            break
                        self._spill(part, self._coldest(part, min(excess, SPILL_CHUNK), _NONE))
                    del part
            except Exception:  # a request that finds no room spills itself; the next wake tries again
                log.exception("%s: spilling rows ahead failed", self.name)

    def bring_in(self, part: TieredPart, ids: torch.Tensor, keep: torch.Tensor) -> None:
        """Put the rows of those of ``ids`` (distinct, none in RAM) on disk back in slots, making
        room (never spilling ``keep``); an id on neither tier is left alone."""
        if not len(self) or not ids.numel():
            return
        found, records = self.disk.get(ids)  # ids not in RAM: what is found is no stale copy
        if not found.numel():
            return
        self.room(part, found.numel(), keep)  # may refuse: nothing has moved yet
        slots = part.occupy(found)
        self.layout(part).unpack_into(part.columns(), slots, records)
        self._copies += found.numel()
        self.brought_in += found.numel()

    def forget(self, ids: torch.Tensor) -> None:
        """The rows of ``ids`` (in RAM) were evicted: their stale copies on disk go too."""
        if self._copies:
            self._copies -= self.disk.delete(ids)

    def read_into(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Overwrite the rows of ``rows`` (one per id of ``ids``) whose id's row is on disk with it,
        leaving it there (an evaluation's lookup: nothing moves)."""
        found, records = self.disk.get(torch.unique(ids))  # sorted ids: those found come sorted
        if not found.numel() or self._layout is None:
            return
        at = torch.searchsorted(found, ids).clamp_(max=found.numel() - 1)
        hit = found[at] == ids
        rows[hit] = self._layout.unpack(records)["row"].index_select(0, at[hit]).to(rows.dtype)

    def scan(self, part: TieredPart, count: int) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """The rows on disk only (no stale copy of a row in RAM), sorted by id, in batches of at most
        ``count`` records read: ids and their tensors by column."""
        if self._layout is None:
            return
        for ids, records in self.disk.scan(count):
            only = ~part.in_ram(ids)
            yield ids[only], {name: t[only] for name, t in self._layout.unpack(records).items()}

    def with_rows_on_disk(self, part: TieredPart, exported: dict[str, Any], since: int | None) -> dict[str, Any]:
        """``exported`` (a part's export of its rows in RAM) with the rows on disk (those changed after
        epoch ``since``; all if None) among them, sorted by id."""
        if not len(self):
            return exported
        keys = ("ids", "rows", "updated", "updates", "seen")
        pieces: dict[str, list[torch.Tensor]] = {key: [exported[key]] for key in keys}
        state_pieces = {key: [v] for key, v in exported["state"].items() if is_row_state(v, exported["rows"].shape)}
        dtype = exported["rows"].dtype
        for ids, columns in self.scan(part, SCAN_ROWS):
            chosen = columns["epoch"] > since if since is not None else torch.ones_like(ids, dtype=torch.bool)
            on_disk = {"ids": ids, "rows": columns["row"].to(dtype), **columns}
            for key in keys:
                pieces[key].append(on_disk[key][chosen])
            for key, held in state_pieces.items():
                held.append(columns[f"state.{key}"][chosen])
        order = torch.argsort(torch.cat(pieces["ids"]))
        merged = {key: torch.cat(values)[order] for key, values in pieces.items()}
        state = {**exported["state"], **{key: torch.cat(values)[order] for key, values in state_pieces.items()}}
        return {**exported, **merged, "state": state}

    def layout(self, part: TieredPart) -> RecordLayout:
        """The layout of the part's records, fixed at its first spill.

        Raises:
            PsframeError: the part's per-slot tensors changed while rows are on disk (an optimizer
                that makes its state at its first step, after rows were spilled).
        """
        columns = part.columns()
        signature = tuple((name, c.dtype, tuple(c.shape[1:])) for name, c in columns.items())
        if signature != self._signature:
            if len(self.disk):
                raise PsframeError(
                    f"dynamic table part {self.name!r} has rows on disk laid out as {self._signature}, but its "
                    f"slots now hold {signature}: its optimizer made per-row state after rows went to disk; give "
                    f"the table a larger ram_budget, or an optimizer that makes its state when built"
                )
            self._layout, self._signature = RecordLayout(columns), signature
        assert self._layout is not None
        return self._layout


def slot_bytes(weight: torch.Tensor, row_state: list[torch.Tensor], stepped: bool) -> int:
    """Bytes a slot of a part takes: its row of ``weight``, its ``row_state`` (the per-row state the
    optimizer made when built; where it made none and there is an optimizer (``stepped``), as much
    as Adam's two float32 moments), bookkeeping (an id, four stamps, a flag) and its id index entry."""
    row = weight[0].numel()
    state = sum(v[0].numel() * v.element_size() for v in row_state)
    if not row_state and stepped:
        state = 8 * row
    return row * weight.element_size() + state + 5 * 8 + 1 + 16


def ram_rows_of(budget: int, row_bytes: int) -> int:
    """The rows a RAM budget of ``budget`` bytes holds at ``row_bytes`` a slot (at least one)."""
    return max(1, int(numpy.floor(budget / max(1, row_bytes))))


__all__ = ["SPILL_CHUNK", "SPILL_SHARE", "DiskTier", "TieredPart", "ram_rows_of", "slot_bytes"]

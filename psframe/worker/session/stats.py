"""What a worker counts as it trains: :class:`Counters` its parts add to, and :class:`TrainerStats`,
the frozen snapshot of them that ``trainer.stats`` gives (hooks and training loops read it).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainerStats:
    """What a trainer counted, as it was when read (``trainer.stats``); its position is
    ``trainer.global_step``."""

    local_step: int = 0
    """Steps this worker took."""
    pushed_steps: int = 0
    """Steps whose gradients every ps task answered as applied (once, however often sent)."""
    dropped_steps: int = 0
    """Synchronous training: steps whose gradients came too late and were dropped; data read in
    ranges: steps whose range went to another worker."""
    skipped_steps: int = 0
    """Steps that pushed no gradient (e.g. ``NanGuardHook`` dropped them)."""
    sent_during_backward: int = 0
    """Requests sent before backward ended (``overlap_backward``)."""
    recoveries: int = 0
    """Times this worker waited for a lost ps task and went on."""
    relayouts: int = 0
    """The re-layouts (ps tasks added or drained) this worker followed to the layout they end on."""
    relayout_pauses: tuple[float, ...] = ()
    """The seconds each stage of the last re-layout this chief led paused training."""
    relayout_parts_moved: tuple[int, ...] = ()
    """The parts each stage of the last re-layout this chief led moved (those of
    :attr:`relayout_pauses`): the measure of a stage's pause is per part moved."""
    steps_ahead: Mapping[int, int] = field(default_factory=dict)
    """Asynchronous training: how many of this worker's steps found it 0, 1, 2... steps ahead of
    the slowest live worker (the most over the ps tasks; with :class:`psframe.BoundedStaleness`
    never above its bound)."""
    rows_pulled: int = 0
    """Rows of embedding tables this worker's lookups pulled from the ps tasks (each lookup's
    distinct ids), and those its prefetches pulled ahead."""
    last_checkpoint_step: int | None = None
    """The step of the last checkpoint (full or delta) this chief committed; None before its first."""


@dataclass
class Counters:
    """The counts of :class:`TrainerStats` as a worker's parts add to them (each its own)."""

    local_step: int = 0
    pushed_steps: int = 0
    dropped_steps: int = 0
    skipped_steps: int = 0
    sent_during_backward: int = 0
    recoveries: int = 0
    relayouts: int = 0
    relayout_pauses: list[float] = field(default_factory=list)
    relayout_parts_moved: list[int] = field(default_factory=list)
    steps_ahead: collections.Counter[int] = field(default_factory=collections.Counter)
    rows_pulled: int = 0

    def snapshot(self, last_checkpoint_step: int | None) -> TrainerStats:
        """The counts as they are now, frozen."""
        return TrainerStats(
            local_step=self.local_step,
            pushed_steps=self.pushed_steps,
            dropped_steps=self.dropped_steps,
            skipped_steps=self.skipped_steps,
            sent_during_backward=self.sent_during_backward,
            recoveries=self.recoveries,
            relayouts=self.relayouts,
            relayout_pauses=tuple(self.relayout_pauses),
            relayout_parts_moved=tuple(self.relayout_parts_moved),
            steps_ahead=dict(sorted(self.steps_ahead.items())),
            rows_pulled=self.rows_pulled,
            last_checkpoint_step=last_checkpoint_step,
        )

"""The chief's lead of live re-layouts (ps tasks added or drained while training goes on), as a hook.

A tool asks ps 0 for a re-layout (``psframe reshard``: ``relayout_calls.ask_reshard``). The chief
(worker 0) carries a :class:`RelayoutLeader` among its hooks (it ends with the chief). After a
step whose reply from ps 0 says a re-layout is pending (``PushPullReplyHeader.relayout_pending``,
read at no cost into the :class:`~psframe.worker.client.operations.RelayoutWord` the leader
holds), it asks ps 0 for the re-layout's status, and takes it a stage at a time
(:mod:`psframe.cluster.moves`). A stage is readied first (its tasks copy ahead the table parts
they take, :class:`psframe.worker.session.relayout.Readying`) in a thread while the chief trains
on, and cut at a step once ready (:func:`psframe.worker.session.relayout.lead`); the chief then
trains on the layout after it. :meth:`RelayoutLeader.reshard` takes a re-layout at once, every
stage of it (``Trainer.reshard``).

When the leader acts is read from plain attributes, so that a step with no re-layout in sight
calls nothing here: the trainer calls :meth:`RelayoutLeader.lead` after a step when ps 0's word
says one is pending, while the leader is :attr:`~RelayoutLeader.following` one, or, when no reply
of ps 0 was heard since the last step (ps 0 holds none of the parts a step sends or reads), once
its :attr:`~RelayoutLeader.next_poll` is due; it clears the word after each step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from psframe.cluster import ClusterSpec
from psframe.cluster.moves import MoveStage
from psframe.errors import RpcTimeoutError, TaskUnavailableError
from psframe.worker.client import relayout_calls
from psframe.worker.client.operations import RelayoutWord
from psframe.worker.hooks import Hook
from psframe.worker.session import relayout
from psframe.worker.session.session import Session
from psframe.worker.session.stats import Counters

if TYPE_CHECKING:
    from psframe.worker.trainer import Trainer

log = logging.getLogger(__name__)

# How often the chief asks ps 0 whether a re-layout waits where its steps did not reach ps 0
# (ps 0 holds none of the parts a step sends or reads, so no reply carries ps 0's word): the
# fallback, two small calls a second. A chief whose steps reach ps 0 asks only when told to.
RESHARD_POLL_SECONDS = 0.5


class RelayoutLeader(Hook):
    """The chief's part in live re-layouts, between two of its steps.

    Args:
        session: the chief's session (it switches to each stage's layout).
        counters: where the pause of each stage, and the parts it moved, are kept.
        word: what ps 0's replies say of re-layouts, written by the clients of every layout the
            chief trains on.
    """

    def __init__(self, session: Session, counters: Counters, word: RelayoutWord) -> None:
        self._session, self._counters = session, counters
        self.word = word
        self.next_poll = 0.0  # when ps 0 is asked again whether a re-layout waits, if no reply said
        self.following = False  # a re-layout is taken: ps 0 is asked again after every step
        self._readying: relayout.Readying | None = None  # the next stage, readied while training goes on

    def end(self, trainer: Trainer) -> None:
        if self._readying is not None:  # a stage readied, not cut: ps 0 keeps it asked for the next chief
            self._readying.cancel()
            self._readying = None

    def reshard(self, new: ClusterSpec) -> float:
        """Ask ps 0 for the re-layout to the ps tasks of ``new`` and take it now, every stage.

        Returns:
            The seconds training paused, all stages together.
        """
        relayout_calls.ask_reshard(self._session.client, new)
        self._counters.relayout_pauses.clear()
        self._counters.relayout_parts_moved.clear()
        for stage in self._session.layouts.plan(self._session.cluster, new):
            self._take_stage(stage)
        return sum(self._counters.relayout_pauses)

    def lead(self) -> None:
        """Between two steps (this one's lookups and pushes are done), when the module's rule says
        so: the re-layout ps 0 was asked for, if any, or the next stage of the one under way. A
        stage is readied first (its tasks copy the table parts they take ahead,
        :func:`relayout.get_ready`) in a thread while the chief trains on; it is cut at a step once
        ready. Until the re-layout is done, ps 0 is asked again at every step, but not while a
        stage readies (its thread says when it is done)."""
        if self._readying is not None and not self._readying.done:
            return  # looked at again at the next step
        session = self._session
        self.next_poll = time.monotonic() + RESHARD_POLL_SECONDS
        try:
            status = relayout_calls.layout_status(session.client)
        except (TaskUnavailableError, RpcTimeoutError):
            return  # asked again at the next poll; the step finds out what is wrong
        if status.moving:
            stage = status.stage
            assert stage is not None
            stage = MoveStage(stage.origin, stage.target, stage.stage + 1, stage.stages)
        elif status.cluster is not None and not status.moved and status.cluster != session.cluster:
            stage = session.layouts.plan(session.cluster, status.cluster)[0]
        else:
            self.following = False
            return
        self.following = True  # again at the next step: this stage (or the next) waits
        readying = self._readying
        if readying is None or readying.stage != stage:
            if readying is not None:
                readying.cancel()
            layout = session.layouts.of_stage(stage)
            self._readying = relayout.Readying(
                stage,
                layout,
                session.cluster,
                session.relayout_settings(session.sync),
                relayout.Moves.between(session.placement, layout.replica.placement),
            )
            return
        if not readying.done:
            return
        self._readying = None
        if stage.stage == 1:
            self._counters.relayout_pauses.clear()
            self._counters.relayout_parts_moved.clear()
        self._take_stage(stage, readying)
        if stage.done:
            self.following = False
            self.next_poll = time.monotonic() + RESHARD_POLL_SECONDS

    def _take_stage(self, stage: MoveStage, ready: relayout.Readying | None = None) -> None:
        """The chief's ``stage`` of a re-layout (:func:`relayout.lead`); then it trains on the layout
        after it. Its pause counts from the cut until the chief can step again (on the new
        layout's client, made before the cut). ``ready``: the stage readied while training went
        on; None: readied here first."""
        session = self._session
        begun = time.monotonic()
        layout = ready.result() if ready is not None else session.layouts.of_stage(stage)
        placed = layout.replica.placement
        moves = ready.moves if ready is not None else relayout.Moves.between(session.placement, placed)
        old, before = session.client, session.cluster
        cut_at = relayout.lead(
            old, before, layout, session.relayout_settings(session.sync), moves, stage, ready=ready is not None
        )
        # No pull: the parts moved as they were, and hold what this chief's last step was answered.
        session.switch_to(layout, pull=False, let_go=lambda: relayout.let_go(old, before, layout))
        paused = time.monotonic() - cut_at
        self._counters.relayout_pauses.append(paused)
        self._counters.relayout_parts_moved.append(moves.parts)
        log.info(
            "chief: re-layout to ps tasks %s, stage %d of %d: paused %.3f s (%d of %d parts moved; "
            "%.3f s between two steps), at global step %d",
            ClusterSpec.from_string(stage.target).job_tasks("ps"),
            stage.stage,
            stage.stages,
            paused,
            moves.parts,
            len(layout.replica.slots),
            time.monotonic() - begun,
            session.global_step,
        )

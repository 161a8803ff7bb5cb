"""The Save handler: a ps task's part of a checkpoint, or of a re-layout's cut.

A Save request is one of four modes:

- **hold** (``hold``): hold pushes back and say where this task is: each
  worker's steps begun here (asynchronous training,
  :class:`~psframe.ps.protocol.ledger_cut.LedgerCut`), or the round it is at
  (synchronous training: the rounds' cut,
  :class:`~psframe.ps.protocol.round_cut.RoundCut`, the aggregator's);
- **full** and **delta**: reach the cut the chief worked out from every
  task's hold (``targets``, or ``round_target`` with ``cut_rounds``), check it
  under the lock the snapshot is taken under, and write this task's shard
  (whole, or what changed since ``parent_step``);
- **the cut of a re-layout** (``move_to``): the same cut, then the parts
  snapshot into memory and the task moves
  (:meth:`~psframe.ps.service.relayout_participant.RelayoutParticipant.move`).

Whatever happens, the hold ends with the save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psframe import errors
from psframe.cluster import ClusterSpec
from psframe.ps import recovery
from psframe.ps.elastic.relayout import Relayout
from psframe.ps.protocol.cut import Cut
from psframe.ps.protocol.ledger_cut import LedgerCut, hold_seconds
from psframe.ps.service.place import TaskPlace
from psframe.ps.service.relayout_participant import RelayoutParticipant
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb


class SaveHandler:
    """The Save handler of ps task ``task_index``.

    Args:
        store, model: the variables and what goes with them (synchronous training: the rounds' cut
            is the aggregator's).
        cut: the ledger's cut (asynchronous training; synchronous training's is the aggregator's:
            both are a :class:`~psframe.ps.protocol.cut.Cut`).
        pushes: what a shard keeps of the pushes its values hold.
        relayout, participant: the re-layout state machine, and what the task does at a re-layout's cut.
        place: the task's cluster (the number of shards).
        checkpoint_dir: where shards go when the request names no folder.
        check_tool_or_worker: refuses a caller that is no worker or tool of the task's cluster.
    """

    def __init__(
        self,
        store: VariableStore,
        model: ServedModel,
        cut: LedgerCut,
        pushes: recovery.PushRecord,
        relayout: Relayout,
        participant: RelayoutParticipant,
        place: TaskPlace,
        *,
        task_index: int,
        checkpoint_dir: str | None,
        check_tool_or_worker: Callable[[pb.Caller], None],
    ) -> None:
        self._store, self._model, self._cut, self._pushes = store, model, cut, pushes
        self._relayout, self._participant, self._place = relayout, participant, place
        self._task_index = task_index
        self._task_name = ClusterSpec.task_name("ps", task_index)
        self._checkpoint_dir = checkpoint_dir
        self._check_tool_or_worker = check_tool_or_worker

    def save(self, request: pb.SaveRequest) -> pb.SaveReply:
        """Answer a Save request, in the mode it asks for (see the module)."""
        self._check_tool_or_worker(request.caller)
        relayout, model, store = self._relayout, self._model, self._store
        if not request.move_to:
            relayout.check_not_cutting(self._task_name)  # a checkpoint's cut would undo a re-layout's
        if request.hold:
            if request.move_to:  # the cut of a re-layout: no other cut may begin until it is taken
                relayout.cutting_for(hold_seconds(request.hold_seconds))
            return self._hold(request.hold_seconds)
        url = request.checkpoint_dir or self._checkpoint_dir or ""
        if not url and not request.move_to:
            raise errors.CheckpointError(f"{self._task_name} has no checkpoint_dir and the request named none")
        cut, point = self._cut_asked(request)
        # With a cut, the snapshot is the cut's: checked under the lock it is taken under.
        check = cut.check if cut is not None else None
        try:
            with model.lock:
                if request.move_to and relayout.took(request.move_to, request.move_stage):
                    return self._participant.moved_reply()  # the cut taken again after a lost one
                store.check_names([])  # NotReadyError before the model exists
                if cut is not None:
                    cut.reach(point)
                k, num_ps = self._task_index, self._place.cluster.num_ps
                if request.move_to:
                    self._participant.move(ClusterSpec.from_string(request.move_to), check, request.move_stage)
                    return self._participant.moved_reply()
                if request.delta:  # what changed since the parent only
                    record = recovery.save_delta_shard(
                        store, url, request.step, request.parent_step, k, num_ps, self._pushes, check
                    )
                else:
                    record = recovery.save_shard(
                        store, model.defs, model.sync_def, url, request.step, k, num_ps, self._pushes, check
                    )
        finally:
            if cut is not None:
                cut.release()
            elif model.aggregator is not None:  # a hold's, whether this save took its cut or not
                model.aggregator.cut.release()
        return pb.SaveReply(
            file=record.file, sha256=record.sha256, nbytes=record.nbytes, global_step=record.global_step
        )

    def _cut_asked(self, request: pb.SaveRequest) -> tuple[Cut[Any] | None, Any]:
        """The cut a save reaches, and its point: each worker's steps (``targets``, asynchronous
        training), or a round (``cut_rounds``: ``round_target``, synchronous); none without either."""
        aggregator = self._model.aggregator
        if request.cut_rounds and aggregator is not None:
            return aggregator.cut, request.round_target
        if request.targets:
            return self._cut, list(request.targets)
        return None, None

    def _hold(self, seconds: float) -> pb.SaveReply:
        """Hold pushes back (asynchronous training) and say each worker's steps begun here;
        or, in synchronous training, hold rounds back and say the round this task is at.

        The hold ends with the save that follows, or by itself after ``seconds`` (at most
        :data:`~psframe.ps.protocol.ledger_cut.MAX_HOLD_SECONDS`): a chief lost between the two
        never stalls training for long.
        """
        seconds = hold_seconds(seconds)
        store, model = self._store, self._model
        with store.lock:
            if not store.ready or not model.defs:
                return pb.SaveReply(holds=False)  # nothing to hold here
            if model.aggregator is not None:
                return pb.SaveReply(holds_rounds=True, global_step=model.aggregator.cut.hold(seconds))
            begun = self._cut.hold(seconds)
        return pb.SaveReply(holds=True, steps_begun=begun)

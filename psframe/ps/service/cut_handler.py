"""The cut's handlers: a ps task's part of a checkpoint, or of a re-layout's cut.

One cut for all ps tasks takes two calls to each:

- **HoldCut**: hold pushes back and say where this task is: each worker's
  steps begun here (asynchronous training,
  :class:`~psframe.ps.protocol.ledger_cut.LedgerCut`), or the round it is at
  (synchronous training: the rounds' cut,
  :class:`~psframe.ps.protocol.round_cut.RoundCut`, the aggregator's);
- then one of two, each of which reaches the cut the chief worked out from
  every task's hold (``CutPoint``: ``targets``, or ``round_target`` with
  ``rounds``) and checks it under the lock the snapshot is taken under:
  **SaveShard** writes this task's shard (whole, or what changed since
  ``parent_step``); **MoveCut** snapshots the parts into memory and moves the
  task to a re-layout's cluster
  (:meth:`~psframe.ps.service.relayout_participant.RelayoutParticipant.move`).

Whatever happens, the hold ends with the second call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


class CutHandler:
    """The HoldCut, SaveShard and MoveCut handlers of ps task ``task_index``.

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

    def hold_cut(self, request: pb.HoldCutRequest) -> pb.HoldCutReply:
        """Hold pushes (or rounds) back for a cut, and say where this task is (see the module).
        The hold of a re-layout's cut (``for_move``) lets no checkpoint's cut begin until it is taken."""
        self._check_tool_or_worker(request.caller)
        if request.for_move:
            self._relayout.cutting_for(hold_seconds(request.hold_seconds))
        else:
            self._relayout.check_not_cutting(self._task_name)  # a checkpoint's cut would undo a re-layout's
        return self._hold(request.hold_seconds)

    def save_shard(self, request: pb.SaveShardRequest) -> pb.SaveShardReply:
        """Reach the cut and write this task's shard of checkpoint ``request.step`` (a delta: what
        changed since ``parent_step``)."""
        self._check_tool_or_worker(request.caller)
        self._relayout.check_not_cutting(self._task_name)  # a checkpoint's cut would undo a re-layout's
        url = request.checkpoint_dir or self._checkpoint_dir or ""
        if not url:
            raise errors.CheckpointError(f"{self._task_name} has no checkpoint_dir and the request named none")
        store, model = self._store, self._model
        with self._at_cut(request.cut) as check:
            k, num_ps = self._task_index, self._place.cluster.num_ps
            if request.delta:  # what changed since the parent only
                record = recovery.save_delta_shard(
                    store, url, request.step, request.parent_step, k, num_ps, self._pushes, check
                )
            else:
                record = recovery.save_shard(
                    store, model.defs, model.sync_def, url, request.step, k, num_ps, self._pushes, check
                )
        return pb.SaveShardReply(
            file=record.file, sha256=record.sha256, nbytes=record.nbytes, global_step=record.global_step
        )

    def move_cut(self, request: pb.MoveCutRequest) -> pb.MoveCutReply:
        """Reach the cut, snapshot the parts into memory and move to ``request.cluster_spec``
        (of ``request.stage``); a cut taken already (asked again after a lost reply) is answered again."""
        self._check_tool_or_worker(request.caller)
        stage = request.stage if request.HasField("stage") else None
        cut, target = self._cut_asked(request.cut)
        try:
            with self._model.lock:
                if self._relayout.took(request.cluster_spec, stage):
                    return self._participant.moved_reply()
                self._store.check_names([])  # NotReadyError before the model exists
                if cut is not None:
                    cut.reach(target)
                check = cut.check if cut is not None else None
                self._participant.move(ClusterSpec.from_string(request.cluster_spec), check, stage)
                return self._participant.moved_reply()
        finally:
            self._release_hold(cut)

    @contextlib.contextmanager
    def _at_cut(self, point: pb.CutPoint) -> Iterator[Callable[[], None] | None]:
        """Under the model's lock, the cut ``point`` reached; yields its check (raises unless the
        cut still holds), for the snapshot to call under the lock it is taken under (None: no cut).
        The hold ends after, whatever happens."""
        cut, target = self._cut_asked(point)
        try:
            with self._model.lock:
                self._store.check_names([])  # NotReadyError before the model exists
                if cut is not None:
                    cut.reach(target)
                yield cut.check if cut is not None else None
        finally:
            self._release_hold(cut)

    def _release_hold(self, cut: Cut[Any] | None) -> None:
        """End the hold: the cut's reached, or else a synchronous hold's, whether a cut was taken or not."""
        if cut is not None:
            cut.release()
        elif self._model.aggregator is not None:
            self._model.aggregator.cut.release()

    def _cut_asked(self, point: pb.CutPoint) -> tuple[Cut[Any] | None, Any]:
        """The cut a call reaches, and its point: each worker's steps (``targets``, asynchronous
        training), or a round (``rounds``: ``round_target``, synchronous); none without either."""
        aggregator = self._model.aggregator
        if point.rounds and aggregator is not None:
            return aggregator.cut, point.round_target
        if point.targets:
            return self._cut, list(point.targets)
        return None, None

    def _hold(self, seconds: float) -> pb.HoldCutReply:
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
                return pb.HoldCutReply(holds=False)  # nothing to hold here
            if model.aggregator is not None:
                return pb.HoldCutReply(holds_rounds=True, round=model.aggregator.cut.hold(seconds))
            begun = self._cut.hold(seconds)
        return pb.HoldCutReply(holds=True, steps_begun=begun)

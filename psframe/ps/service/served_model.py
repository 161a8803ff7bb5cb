"""The model a ps task serves, as the service's handlers share it.

The store holds the variables and their optimizer state; this holds what
goes with them: the variables' definitions as the chief placed them, the
synchronous rounds (:class:`~psframe.ps.protocol.sync.SyncAggregator`, None
in asynchronous training) with their definition, and the checkpoint step
the model was restored from. Init makes it
(:mod:`~psframe.ps.service.model_init`); a checkpoint or a re-layout's parts
restore it (:meth:`ServedModel.take_restored`); a re-layout's cut lets it go
(:meth:`ServedModel.let_go`); the data plane, the cuts (SaveShard, MoveCut) and the status
report read it.
"""

from __future__ import annotations

import logging
import threading

from psframe.cluster import ClusterSpec
from psframe.errors import NotReadyError, PsframeError
from psframe.ps import recovery
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service.definitions import dynamic_parts
from psframe.ps.service.place import TaskPlace
from psframe.ps.store import VariableStore
from psframe.wire import messages
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


class ServedModel:
    """The model ps task ``task_index`` serves: definitions, synchronous rounds, step restored.

    Args:
        store: the variables.
        ledger, data: the record of each worker's pushes and of the data they consumed
            (a restored checkpoint brings both back).
        roster: the workers heard from and finished (rounds started late leave the finished out).
        place: the task's cluster and its connections to the other ps tasks.
        elastic: workers may join and leave: the rounds follow the live ones.

    Attributes:
        defs: the definitions of the variables held here, as the chief placed them.
        sync_def, aggregator: the synchronous rounds and their definition; None in asynchronous training.
        restored_step: the checkpoint step the model was restored from; -1 for none.
        lock: held by Init, TakeParts and the cuts (SaveShard, MoveCut), so that the model is made,
            restored, saved or moved by one at a time.
    """

    def __init__(
        self,
        store: VariableStore,
        ledger: PushLedger,
        data: RangeQueue,
        roster: WorkerRoster,
        place: TaskPlace,
        *,
        task_index: int,
        elastic: bool,
    ) -> None:
        self._store, self._ledger, self._data, self._roster, self._place = store, ledger, data, roster, place
        self._task_index = task_index
        self._task_name = ClusterSpec.task_name("ps", task_index)
        self._elastic = elastic
        self.defs: list[pb.VariableDef] = []
        self.sync_def: pb.SyncDef | None = None
        self.aggregator: SyncAggregator | None = None
        self.restored_step = -1
        self.lock = threading.Lock()

    def take_restored(
        self, restored: recovery.Restored, *, peers: bool = True, data: bool = True, take: bool = False
    ) -> None:
        """Become READY with a checkpoint's variables, optimizer state and step.

        The global step continues from the highest one among the other ps
        tasks that are training (they did not lose their updates; this shard
        rolls back to the checkpoint), so a sync cluster stays in lockstep.
        Without ``peers`` (a re-layout's parts, all of one cut) it is the restored one.
        Without ``data``, the data queues stay as they are (ps 0 across a re-layout: the
        leases out stay the workers'). With ``take``, the store takes the restored tensors as
        its own, not copies (nothing else holds them).
        """
        store = self._store
        global_step = max([restored.global_step, *(self._place.peers.global_steps() if peers else ())])
        # Under the store's lock, GetInfo sees the model whole or not at all: the
        # values, optimizer state, global step, definitions and barrier in one step.
        with store.lock:
            store.create(
                restored.values,
                restored.optimizer,
                copy=not take,
                tables=restored.tables,
                table_optimizer=restored.table_optimizer,
                dynamic=dynamic_parts(restored.defs),
            )
            store.restore({}, restored.states, global_step, copy=not take)
            store.schedules.load_state_dict(restored.schedules)  # they go on to the global step from there
            store.load_dynamic(restored.dynamic)
            if restored.pushes is not None:  # pushes the restored values hold are duplicates if sent again
                self._ledger.load_state_dict(restored.pushes)
                if data:
                    self._data.load_state_dict(restored.pushes)  # and what they consumed, consumed
            self.defs = list(restored.defs)
            self.restored_step = restored.step
            if restored.num_shards == self._place.cluster.num_ps:  # this task's shard as the chain holds it
                store.mark_snapshot(restored.step)
            if restored.sync is not None:
                self.start_sync(restored.sync)
        if restored.step >= 0:  # a checkpoint's (a re-layout's parts are logged as taken)
            log.info(
                "%s: restored %d variables from checkpoint step %d (its global step %d); going on at global step %d",
                self._task_name,
                len(restored.defs),
                restored.step,
                restored.global_step,
                global_step,
            )

    def start_sync(self, sync: pb.SyncDef) -> None:
        """Train synchronously from now on, in rounds of ``sync`` (called under the store's lock,
        with :attr:`defs` set): ps 0 decides each round's members, the others ask it."""
        cluster, roster = self._place.cluster, self._roster
        decide = None if self._task_index == 0 else self._place.peers.step_members
        self.aggregator = SyncAggregator(
            self._store,
            num_workers=sync.total_num_replicas or cluster.num_workers,
            replicas_to_aggregate=sync.replicas_to_aggregate,
            timeout=sync.timeout_seconds,
            decide=decide,
            required=messages.sync_from_def(sync).required if self._elastic else None,
            on_applied=self._data.record,
            async_parts=[d.name for d in self.defs if d.variable in set(sync.async_tables)],
        )
        for worker in roster.finished:
            self.aggregator.worker_finished(worker)
        if self._elastic:  # directly: the store's lock is held, and Membership takes its own lock before it
            self.aggregator.follow(set(roster.live()))
        self.sync_def = sync
        log.info("%s: synchronous training, %s", self._task_name, messages.describe_sync(sync))

    def let_go(self, refusal: PsframeError) -> None:
        """The model goes, at a re-layout's cut (under the store's lock, once its snapshot is taken):
        the pushes of the round under way get ``refusal`` (and are sent again to the new layout)."""
        if self.aggregator is not None:
            self.aggregator.abandon(refusal)
            self.aggregator, self.sync_def = None, None
        self._store.clear()
        self.defs = []

    # ---- the rounds follow the workers (psframe.ps.service.membership)

    def follow(self, live: set[int]) -> None:
        """Elastic clusters: the rounds wait for the ``live`` workers only."""
        if self.aggregator is not None:
            self.aggregator.follow(live)

    def worker_finished(self, worker: int) -> None:
        """A worker finished: the rounds no longer wait for it."""
        if self.aggregator is not None:
            self.aggregator.worker_finished(worker)

    def step_members(self, step: int) -> pb.StepMembersReply:
        """The workers counted as the members of ``step``'s round (ps 0 answers the other ps tasks).

        Raises:
            NotReadyError: the task is not training synchronously (yet).
        """
        if self.aggregator is None:
            raise NotReadyError(f"{self._task_name} is not training synchronously (yet)")
        return pb.StepMembersReply(step=step, workers=self.aggregator.members_of(step))

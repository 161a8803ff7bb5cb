"""The ps task's service: decodes requests, calls the store, encodes replies.

Handlers take a request and return a reply; :mod:`psframe.wire.transport`
serves them, and turns the psframe errors they raise into status codes.
Tensor-carrying methods (Init, PushPull) take and return raw bytes and use
:mod:`psframe.wire.codec`, so tensors are read in place from the request and
written once into the reply; the small methods use the generated classes.

The modules of this package are the service's parts:
:mod:`~psframe.ps.service.task_service` (what every task answers),
:mod:`~psframe.ps.service.push_pull_request` and
:mod:`~psframe.ps.service.fast_path` (a PushPull request read, and worked out
once per stream), :mod:`~psframe.ps.service.round_replies` (a synchronous
round's replies), :mod:`~psframe.ps.service.definitions` and
:mod:`~psframe.ps.service.incoming_model` (the chief's model, as it arrives).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy
import torch

from psframe import errors
from psframe.checkpoint.shard import OptimizerData, ShardData
from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.errors import (
    ClusterMismatchError,
    NotKeptHere,
    NotReadyError,
    PsframeError,
    SharedRegionError,
)
from psframe.memory import HugePageMemory, malloc
from psframe.optim import OptimizerSpec
from psframe.ps import recovery
from psframe.ps.elastic import precopy
from psframe.ps.elastic.peers import PsPeers
from psframe.ps.elastic.relayout import Relayout, copy_ahead, encode_shard, fetch_shards, ps_host, select, shard_chunks
from psframe.ps.elastic.relayout import prepare as relayout_prepare
from psframe.ps.protocol.data_ranges import DataSpec, RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import Change, WorkerRoster, check_max_workers
from psframe.ps.protocol.staleness import StalenessGate
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service.definitions import dynamic_parts
from psframe.ps.service.fast_path import CachedRequest, StreamCache
from psframe.ps.service.incoming_model import PendingModel
from psframe.ps.service.push_pull_request import PushPullRequest
from psframe.ps.service.round_replies import RoundReplies, outgoing
from psframe.ps.service.task_service import TaskService
from psframe.ps.store import VariableStore
from psframe.wire import codec, messages, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.same_host import SameHostRegion
from psframe.wire.transport.error_codec import encode_error

log = logging.getLogger(__name__)

# How often a ps task waiting for a silent chief says so.
CHIEF_LOG_EVERY_S = 5.0
# The longest a checkpoint's cut holds pushes back: a chief lost between hold and save, or a
# worker lost mid-step, never stalls training longer.
MAX_HOLD_SECONDS = 10.0
# A worker whose begun step the cut waits for, silent here this long (no call of its in progress),
# is taken for lost (killed, cut off): the cut gives up at once rather than hold everyone to the deadline.
CUT_SILENCE_SECONDS = 1.0
_HOLD_POLL_SECONDS = 0.001
# The longest a task of a new layout waits for the parts of one task before it (FetchParts).
MAX_FETCH_SECONDS = 120.0


class PushesHeld:
    """What a checkpoint keeps of the pushes its values hold: the ledger's counts, and what they consumed of data."""

    def __init__(self, ledger: PushLedger, data: RangeQueue) -> None:
        self._ledger, self._data = ledger, data

    def state_dict(self) -> dict[str, list[int]]:
        return {**self._ledger.state_dict(), **self._data.state_dict()}


class ParameterServerService(TaskService):
    """The servicer of a ps task over its :class:`VariableStore`.

    Args:
        cluster, task_index: the task.
        store: the variables; default: an empty store in huge pages where the system has them.
        worker_timeout: seconds after which a silent worker is presumed dead.
        checkpoint_dir: where this task restores its shard from, when it starts or loses its model.
        security: how it reaches the other ps tasks (sync rounds ask task 0 who is in them).
        chief_timeout: seconds to wait for the chief to create the variables; None: forever, logging.
        liveness: the keepalive of its connections to the other ps tasks.
        ledger, last_seen: the record of each worker's pushes and when each was last heard
            from, where other processes share them (:mod:`psframe.ps.serving.shared_service`); default: its own.
        keeps_data: this process keeps the task's queues of data ranges
            (:mod:`psframe.ps.protocol.data_ranges`): False in a serving process, which hands a push
            that carries data progress to the task's owner (:class:`NotKeptHere`).
        max_workers: the worker slots of an elastic cluster: workers beyond the cluster's
            (of a grown ``--worker_hosts``, with the same ps tasks) join up to this many, and
            sync rounds follow the live workers; None (or the cluster's workers): fixed.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        task_index: int,
        store: VariableStore | None = None,
        *,
        worker_timeout: float = 60.0,
        checkpoint_dir: str | None = None,
        security: Security | None = None,
        chief_timeout: float | None = None,
        liveness: Liveness | None = None,
        ledger: PushLedger | None = None,
        last_seen: numpy.ndarray | None = None,
        max_workers: int | None = None,
        keeps_data: bool = True,
    ) -> None:
        super().__init__(cluster, "ps", task_index)
        self.keeps_data = keeps_data
        # A live re-layout (psframe.ps.elastic.relayout): one asked for, or taken. Not where the task
        # serves from several processes (they share one layout: see shared_service).
        self.relayout = Relayout()
        self._copies = precopy.Copies()  # table parts copied ahead of a re-layout's next cut
        self.relayout_parts_copied_ahead = 0  # and taken at their cut with the rows changed since:
        self.relayout_rows_changed_since_copy = 0  # so many
        self.live_relayout = True
        self._security, self._liveness = security, liveness
        self.max_workers = check_max_workers(max_workers, cluster.num_workers)
        self.elastic = max_workers is not None  # given: workers may join and leave, even with no slot to spare
        self.worker_timeout = worker_timeout
        self.checkpoint_dir = checkpoint_dir
        self.restored_step = -1
        self.store = store if store is not None else VariableStore(self.task_name, memory=HugePageMemory())
        self._variable_defs: list[pb.VariableDef] = []
        self._init_lock = threading.Lock()
        self._pending: PendingModel | None = None  # the chief's initial values, while they arrive
        # Each worker's pushes applied once, whatever is sent again after a reconnect.
        self.ledger = ledger if ledger is not None else PushLedger(self.max_workers)
        self.roster = WorkerRoster(
            cluster.num_workers,
            worker_timeout,
            last_seen=last_seen,
            chief_timeout=chief_timeout,
            capacity=self.max_workers,
        )
        self._live: set[int] = set()  # elastic: the workers live when last looked (_follow_membership)
        self._membership_lock = threading.Lock()
        # Data read in ranges: what each worker's pushes consumed, recorded with them.
        self.data = RangeQueue(gone=lambda worker: worker not in self.roster.live(), lock=self.store.lock)
        self._pushes_held = PushesHeld(self.ledger, self.data)
        # Asynchronous training: how far ahead each step finds its worker, and bounded staleness.
        self.staleness = StalenessGate(self.ledger, self.roster, self.task_name)
        self._next_chief_log = 0.0
        self._sync_def: pb.SyncDef | None = None
        self.aggregator: SyncAggregator | None = None
        self._round_replies = RoundReplies(self.store)
        self._peers = PsPeers(cluster, task_index, security, liveness)
        self._old_peers: list[PsPeers] = []  # of the layouts before a re-layout
        # Where psframe may not tune malloc, freed message buffers are trimmed instead.
        self._memory = malloc.MemoryReturner(enabled=not malloc.malloc_tuned())
        if checkpoint_dir:
            restored = recovery.restore_own_shard(checkpoint_dir, task_index, cluster.num_ps)
            if restored is not None:
                self._adopt(restored)

    # ---- helpers

    def _check_caller(self, caller: pb.Caller, job_name: str = "worker") -> None:
        self.relayout.check_caller(caller)  # a worker of the layout before: refused, with where to go
        if job_name == "worker" and self._joins(caller):
            return
        if caller.cluster_fingerprint != self.cluster.fingerprint:
            raise ClusterMismatchError(
                f"{ClusterSpec.caller_name(caller.job_name, caller.task_index)} was started with a different "
                f"cluster (fingerprint {caller.cluster_fingerprint or 'none'}) than {self.task_name}, "
                f"whose cluster is {self.cluster.to_string()!r} (fingerprint {self.cluster.fingerprint}); "
                f"{messages.SAME_CLUSTER}"
            )
        if caller.job_name != job_name or not 0 <= caller.task_index < self.cluster.num_tasks(job_name):
            caller_name = ClusterSpec.caller_name(caller.job_name, caller.task_index)
            raise ClusterMismatchError(
                f"{self.task_name} expects this call from /job:{job_name}/task:0.."
                f"{self.cluster.num_tasks(job_name) - 1}, not {caller_name}"
            )

    def _joins(self, caller: pb.Caller) -> bool:
        """Whether an elastic task takes this worker: the same ps tasks, a slot it has."""
        return (
            self.elastic
            and caller.job_name == "worker"
            and caller.ps_fingerprint == self.cluster.ps_fingerprint
            and 0 <= caller.task_index < self.max_workers
        )

    def _same_cluster(self, caller: pb.Caller) -> bool:
        return (
            super()._same_cluster(caller)
            or (self.elastic and caller.ps_fingerprint == self.cluster.ps_fingerprint)
            or (caller.cluster_fingerprint == self.relayout.before)  # asks where the ps tasks went
        )

    def _accepts_worker(self, caller: pb.Caller) -> bool:
        return caller.job_name == "worker" and (
            caller.cluster_fingerprint == self.cluster.fingerprint or self._joins(caller)
        )

    def check_training_over(self) -> bool:
        """True once every worker finished, or once some finished and the
        others are presumed dead (a worker killed for good must not keep the
        ps alive forever; the chief is waited for longer: see :mod:`psframe.ps.protocol.roster`)."""
        if self.all_finished.is_set():
            return True
        if self.elastic:
            self._follow_membership()
        dead = self.roster.presumed_dead()
        if dead is None:
            self._log_waiting_for_chief()
            return False
        log.warning(
            "%s: workers %s finished; %s presumed dead (silent for over %gs, the chief %gs); training is over",
            self.task_name,
            self.roster.finished,
            dead,
            self.worker_timeout,
            self.roster.chief_timeout,
        )
        self.all_finished.set()
        return True

    def _log_waiting_for_chief(self) -> None:
        silent = self.roster.waiting_for_chief()
        now = time.monotonic()
        if silent is None or now < self._next_chief_log:
            return
        self._next_chief_log = now + CHIEF_LOG_EVERY_S
        log.warning(
            "%s: every other worker finished or is presumed dead; waiting for the chief (%s), "
            "silent for %.0fs, up to %gs (chief_timeout)",
            self.task_name,
            ClusterSpec.task_name("worker", 0),
            silent,
            self.roster.chief_timeout,
        )

    def _follow_membership(self) -> None:
        """Elastic clusters: record the workers presumed dead and those back, and let the
        sync rounds follow the live workers (called every tenth of a second by the server)."""
        with self._membership_lock:
            self._follow_membership_locked()

    def _follow_membership_locked(self) -> None:
        live = set(self.roster.live())
        if self.aggregator is not None:
            self.aggregator.follow(live)
        if live == self._live:
            return
        step = self.store.global_step
        finished = set(self.roster.finished)
        for worker in sorted(self._live - live - finished):
            self.roster.record(worker, Change.PRESUMED_DEAD, step)
            log.warning(
                "%s: worker %d silent for over %gs; presumed dead at step %d (taken back if it returns)",
                self.task_name,
                worker,
                self.worker_timeout,
                step,
            )
        for worker in sorted(live - self._live):
            if self._was_presumed_dead(worker):
                self.roster.record(worker, Change.RETURNED, step)
                log.info("%s: worker %d is back at step %d", self.task_name, worker, step)
        self._live = live

    def _was_presumed_dead(self, worker: int) -> bool:
        last = None
        for change in self.roster.changes:
            if change.worker == worker:
                last = change.change
        return last is Change.PRESUMED_DEAD

    def get_info(self, request: pb.InfoRequest) -> pb.TaskInfo:
        caller = request.caller
        if self._accepts_worker(caller):
            worker = caller.task_index
            if request.joining and self.elastic and self.roster.join(worker, self.store.global_step):
                log.info("%s: worker %d joined at step %d", self.task_name, worker, self.store.global_step)
            with self.roster.call(worker, self.store.global_step):  # a worker waiting for us is alive
                pass
            if self.elastic:
                self._follow_membership()
        return self.info()

    def info(self) -> pb.TaskInfo:
        info = super().info()
        store = self.store
        with store.lock:
            if self.all_finished.is_set():
                info.state = pb.TaskInfo.FINISHED
            elif not store.ready:
                info.state = pb.TaskInfo.WAITING_FOR_MODEL
            info.global_step = store.global_step
            info.variables.extend(self._variable_defs)
            info.bytes_held = store.nbytes()
            if store.optimizer_spec is not None:
                info.optimizer.CopyFrom(messages.optimizer_to_proto(store.optimizer_spec))
            if store.table_optimizer_spec is not None:
                info.table_optimizer.CopyFrom(messages.optimizer_to_proto(store.table_optimizer_spec))
            info.pushes = store.pushes
            info.rejected_pushes = store.rejected_pushes
            info.finished_workers.extend(self.roster.finished)
            if self._sync_def is not None:
                info.sync.CopyFrom(self._sync_def)
            if self.aggregator is not None:
                info.dropped_gradients = self.aggregator.dropped_gradients
            elif any(self.staleness.counts):
                info.steps_ahead_counts.extend(self.staleness.counts)
            info.restored_step = self.restored_step
            info.checkpoint_dir = self.checkpoint_dir or ""
            if self.elastic:
                info.max_workers = self.max_workers
            layout = self.relayout.reply()
            info.reshard_to, info.layout_version = layout.cluster_spec, layout.layout_version
            info.relayouts = self.relayout.relayouts
            if self.relayout.under_way:
                info.move_stage.CopyFrom(layout.stage)
            for name, counts in sorted(store.dynamic_counts().items()):
                info.dynamic_tables.add(name=name, **counts)
        out = self.data.ranges_out()
        for name, (consumed, total) in sorted(self.data.counts().items()):
            info.data_sets.add(name=name, consumed=consumed, total=total, ranges_out=out.get(name, 0))
        now = time.monotonic()
        for change in self.roster.changes:
            info.membership.add(
                worker=change.worker,
                kind=pb.MembershipChange.Kind.Value(change.change.name),
                global_step=change.global_step,
                seconds_ago=now - change.when,
            )
        for worker, seconds_ago, finished in self.roster.seen():
            info.workers.add(
                task_index=worker,
                seconds_ago=seconds_ago,
                finished=finished,
                applied_steps=self.ledger.applied_steps(worker),
                last_push_id=self.ledger.last_push(worker),
            )
        return info

    # ---- Init

    def init(self, data: bytes) -> bytes:
        header, tensors = codec.decode(data, pb.InitHeader)
        self._check_caller(header.caller)
        with self.roster.call(header.caller.task_index):
            return self._init(header, tensors)

    def _init(self, header: pb.InitHeader, tensors: list[torch.Tensor]) -> bytes:
        if header.caller.task_index != 0:
            raise ClusterMismatchError(
                f"only the chief ({ClusterSpec.task_name('worker', 0)}) creates variables, "
                f"not {ClusterSpec.caller_name('worker', header.caller.task_index)}"
            )
        optimizer = messages.optimizer_from_proto(header.optimizer)
        table_optimizer = (
            messages.optimizer_from_proto(header.table_optimizer) if header.HasField("table_optimizer") else None
        )
        defs = list(header.variables)
        messages.check_definitions(
            self.task_name,
            defs,
            header.sync if header.HasField("sync") else None,
            self.cluster.num_workers,
            elastic=self.elastic,
        )
        dynamic = dynamic_parts(defs)
        static = [d for d in defs if d.name not in dynamic]  # the variables with initial values
        tables = [d.name for d in static if d.table]
        sync = header.sync if header.HasField("sync") else None
        with self._init_lock:
            created = False
            if self.store.ready:
                # The store checks the variables and the optimizers are those it holds.
                self.store.create(
                    self._values_like(static),
                    optimizer,
                    tables=tables,
                    table_optimizer=table_optimizer,
                    dynamic=dynamic,
                )
                messages.check_same_sync(
                    f"the chief's model does not match what {self.task_name} holds", sync, self._sync_def
                )
            elif header.adopt_from:
                ledger = header.ledger if header.HasField("ledger") else None
                self._adopt_from_peers(
                    list(header.adopt_from), defs, optimizer, sync, table_optimizer, list(header.adopt_tasks), ledger
                )
                self._take_finished(header.finished_workers)
                if self.relayout.moved_to is None:  # new in this layout
                    before = ClusterSpec({"ps": list(header.adopt_from), "worker": self.cluster.job_tasks("worker")})
                    self.relayout.adopted(before, self.cluster, header.layout_version)
            elif self.relayout.snapshot is not None:  # moved, its new parts not taken: never made anew
                raise errors.LayoutChangedError(
                    f"{self.task_name} is in the middle of a re-layout (its parts of before are in the snapshots "
                    f"of the ps tasks before): the chief takes it up again (it asks ps 0) instead of making the model"
                )
            elif self._restore_for_chief(
                header.checkpoint_dir or self.checkpoint_dir, defs, optimizer, sync, table_optimizer
            ):
                pass
            else:
                if self._pending is None or static != self._pending.defs:  # a new (or restarted) chief: start over
                    self._pending = PendingModel(self.task_name, static, self.store)
                self._pending.add(header.tensors, tensors)
                if self._pending.complete:
                    # A chief past step 0 gives the values of its replica to a task that lost its
                    # own and has no checkpoint: training goes on from the step it had reached.
                    resumed = max([header.global_step, *self._peers.global_steps()]) if header.global_step else 0
                    # Under the store's lock, GetInfo sees the model whole or not at all:
                    # READY with the definitions, and the barrier, in one step.
                    with self.store.lock:
                        created = self.store.create(
                            self._pending.values(),
                            optimizer,
                            copy=False,
                            tables=tables,
                            table_optimizer=table_optimizer,
                            dynamic=dynamic,
                        )
                        self._variable_defs = defs
                        if resumed:
                            self.store.global_step = resumed
                        if sync is not None:
                            self._start_sync(sync)
                    self._pending = None
                    if resumed:
                        log.warning(
                            "%s: started again without a checkpoint to restore: took the values of the "
                            "chief's replica (at most a step old) for its %d variables and goes on at "
                            "global step %d; their optimizer state starts afresh (give the job a "
                            "checkpoint_dir to keep it)",
                            self.task_name,
                            len(defs),
                            resumed,
                        )
                    else:
                        log.info(
                            "%s: created %d variables (%d bytes) with %r",
                            self.task_name,
                            len(defs),
                            self.store.nbytes(),
                            optimizer,
                        )
            state = pb.TaskInfo.READY if self.store.ready else pb.TaskInfo.WAITING_FOR_MODEL
            reply = pb.InitReplyHeader(
                state=state,
                created=created,
                global_step=self.store.global_step,
                last_push_id=self.ledger.last_push(header.caller.task_index),
                layout_version=self.relayout.version,
            )
        return codec.encode(reply, ())

    # ---- checkpoints

    def _restore_for_chief(
        self,
        url: str | None,
        defs: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        table_optimizer: OptimizerSpec | None,
    ) -> bool:
        """Restore the variables the chief placed here from the latest checkpoint, if any."""
        if not url:
            return False
        restored = recovery.restore_onto(
            url, defs, optimizer, table_optimizer, keeps_data=self.task_index == 0 and self.keeps_data
        )
        if restored is None:
            return False
        restored.sync = sync
        self._adopt(restored)
        return True

    def _adopt(self, restored: recovery.Restored, *, peers: bool = True, data: bool = True, take: bool = False) -> None:
        """Become READY with a checkpoint's variables, optimizer state and step.

        The global step continues from the highest one among the other ps
        tasks that are training (they did not lose their updates; this shard
        rolls back to the checkpoint), so a sync cluster stays in lockstep.
        Without ``peers`` (a re-layout's parts, all of one cut) it is the restored one.
        Without ``data``, the data queues stay as they are (ps 0 across a re-layout: the
        leases out stay the workers'). With ``take``, the store takes the restored tensors as
        its own, not copies (nothing else holds them).
        """
        global_step = max([restored.global_step, *(self._peers.global_steps() if peers else ())])
        # Under the store's lock, GetInfo sees the model whole or not at all: the
        # values, optimizer state, global step, definitions and barrier in one step.
        with self.store.lock:
            self.store.create(
                restored.values,
                restored.optimizer,
                copy=not take,
                tables=restored.tables,
                table_optimizer=restored.table_optimizer,
                dynamic=dynamic_parts(restored.defs),
            )
            self.store.restore({}, restored.states, global_step, copy=not take)
            self.store.load_dynamic(restored.dynamic)
            if restored.pushes is not None:  # pushes the restored values hold are duplicates if sent again
                self.ledger.load_state_dict(restored.pushes)
                if data:
                    self.data.load_state_dict(restored.pushes)  # and what they consumed, consumed
            self._variable_defs = list(restored.defs)
            self.restored_step = restored.step
            if restored.num_shards == self.cluster.num_ps:  # this task's shard as the chain holds it
                self.store.mark_snapshot(restored.step)
            if restored.sync is not None:
                self._start_sync(restored.sync)
        if restored.step >= 0:  # a checkpoint's (a re-layout's parts are logged as taken)
            log.info(
                "%s: restored %d variables from checkpoint step %d (its global step %d); going on at global step %d",
                self.task_name,
                len(restored.defs),
                restored.step,
                restored.global_step,
                global_step,
            )

    def save(self, request: pb.SaveRequest) -> pb.SaveReply:
        self._check_tool_or_worker(request.caller)
        if not request.move_to:
            self.relayout.check_not_cutting(self.task_name)  # a checkpoint's cut would undo a re-layout's
        if request.hold:
            if request.move_to:  # the cut of a re-layout: no other cut may begin until it is taken
                self.relayout.cutting_for(min(max(request.hold_seconds, 0.1), MAX_HOLD_SECONDS))
            return self._hold(request.hold_seconds)
        url = request.checkpoint_dir or self.checkpoint_dir or ""
        if not url and not request.move_to:
            raise errors.CheckpointError(f"{self.task_name} has no checkpoint_dir and the request named none")
        # With targets (or a round's), the snapshot is the cut's: checked under the lock it is taken under.
        cut = self._check_cut if request.targets else None
        aggregator = self.aggregator if request.cut_rounds else None
        if aggregator is not None:
            cut = functools.partial(aggregator.check_cut, request.round_target)
        try:
            with self._init_lock:
                if request.move_to and self.relayout.took(request.move_to, request.move_stage):
                    return self._moved_reply()  # the cut taken again after a lost one
                self.store.check_names([])  # NotReadyError before the model exists
                if request.targets:
                    self._reach(list(request.targets))
                if aggregator is not None:
                    aggregator.reach(request.round_target)
                k, num_ps = self.task_index, self.cluster.num_ps
                if request.move_to:
                    self._move(ClusterSpec.from_string(request.move_to), cut, request.move_stage)
                    return self._moved_reply()
                if request.delta:  # what changed since the parent only
                    record = recovery.save_delta_shard(
                        self.store, url, request.step, request.parent_step, k, num_ps, self._pushes_held, cut
                    )
                else:
                    record = recovery.save_shard(
                        self.store,
                        self._variable_defs,
                        self._sync_def,
                        url,
                        request.step,
                        k,
                        num_ps,
                        self._pushes_held,
                        cut,
                    )
        finally:
            if request.targets:
                with self.store.lock:
                    self.ledger.release()
            if self.aggregator is not None:  # a hold's, whether this save took its cut or not
                self.aggregator.release()
        return pb.SaveReply(
            file=record.file, sha256=record.sha256, nbytes=record.nbytes, global_step=record.global_step
        )

    # ---- a live re-layout: ps tasks added or drained (psframe.ps.elastic.relayout)

    def _moved_reply(self) -> pb.SaveReply:
        """What a re-layout's cut answers: where this task stands after it."""
        snapshot = self.relayout.snapshot
        pushes = (snapshot.pushes if snapshot is not None else None) or {}
        return pb.SaveReply(
            global_step=self.store.global_step,
            layout_version=self.relayout.version,
            finished_workers=sorted(self.roster.finished),
            ledger=pb.PushLedger(last_push=pushes.get("last_push", ()), applied_steps=pushes.get("applied_steps", ())),
        )

    def reshard(self, request: pb.ReshardRequest) -> pb.ReshardReply:
        """Ask ps 0 for a re-layout to ``request.cluster_spec``; or, with none, say what is asked or taken
        (to anyone, as GetInfo: a worker started with the ps tasks of before asks where they went)."""
        if request.cluster_spec or request.done:
            self._check_tool_or_worker(request.caller)
        if request.cluster_spec:
            new = ClusterSpec.from_string(request.cluster_spec)
            self._check_relayout_possible()
            self.relayout.ask(self.cluster, new)
            log.info("%s: a re-layout to ps tasks %s is asked for", self.task_name, new.job_tasks("ps"))
        if request.done:  # the chief: every task of the new layout holds its parts
            self.relayout.release(request.caller.layout_version)
        if request.HasField("precopy"):  # the chief, before a stage's cut, to a task of the layout after it
            self._copy_ahead(request.caller, request.precopy)
        return self.relayout.reply()

    def _copy_ahead(self, caller: pb.Caller, request: pb.Precopy) -> None:
        """Before a stage's cut, while training goes on: make ready the optimizers this task will
        build, and copy the fixed table parts it takes at the cut from the tasks before that hold
        them (:mod:`psframe.ps.elastic.precopy`); kept until that stage's parts are taken.

        Raises:
            ClusterMismatchError: the caller is no worker or tool of the cluster after the stage,
                or that cluster has not this task at its index.
        """
        start = time.monotonic()
        after = ClusterSpec.from_string(request.cluster_spec)
        if (
            caller.job_name not in ("tool", "worker")
            or caller.cluster_fingerprint != after.fingerprint
            or self.task_index >= after.num_ps
            or after.task_address("ps", self.task_index) != self.cluster.task_address("ps", self.task_index)
        ):
            raise ClusterMismatchError(
                f"{self.task_name} copies parts ahead of a re-layout's cut for a worker or tool of the cluster "
                f"after it, where it is {self.task_name}; the caller has job {caller.job_name!r} and "
                f"fingerprint {caller.cluster_fingerprint or 'none'}, the cluster {request.cluster_spec!r}"
            )
        dense = {codec.dtype_from_name(d.dtype) for d in request.variables if not d.table}
        tables = {codec.dtype_from_name(d.dtype) for d in request.variables if d.table}
        ready = []
        if request.HasField("optimizer") and dense:
            ready.append((messages.optimizer_from_proto(request.optimizer), sorted(dense, key=str), False))
        if request.HasField("table_optimizer") and tables:
            ready.append((messages.optimizer_from_proto(request.table_optimizer), sorted(tables, key=str), True))
        relayout_prepare(ready)
        named = set(request.parts)
        held = {(d.name, d.row_start, tuple(d.shape)) for d in self._variable_defs}
        gained = [d for d in request.variables if d.name in named and (d.name, d.row_start, tuple(d.shape)) not in held]
        addresses = list(request.adopt_from)
        caller = pb.Caller(job_name="ps", task_index=self.task_index, cluster_fingerprint=self.cluster.fingerprint)
        own = self.task_index if self.task_index < len(addresses) else None  # a task kept keeps its index
        try:
            copies = copy_ahead(
                self._peers_at(addresses), gained, caller, MAX_FETCH_SECONDS, list(request.adopt_tasks), own
            )
        except errors.PsframeError as e:  # the copies only shorten the pause: the parts cross whole at the cut
            log.warning(
                "%s: could not copy table parts ahead of a re-layout's cut (%s): they cross at it", self.task_name, e
            )
            copies = {}
        self._copies.keep(addresses, copies)
        if copies:
            log.info(
                "%s: copied %d table parts (%d bytes with optimizer state) ahead of a re-layout's cut in %.3f s",
                self.task_name,
                sum(len(c.parts) for c in copies.values()),
                self._copies.nbytes(),
                time.monotonic() - start,
            )

    def _check_relayout_possible(self) -> None:
        """Refuse a re-layout this task cannot take live (see :mod:`psframe.ps.elastic.relayout`).

        Raises:
            ClusterSpecError: naming why, and what to do instead.
        """
        why = ""
        if self.task_index != 0:
            why = f"ask {ClusterSpec.task_name('ps', 0)}, which leads it, not {self.task_name}"
        elif not self.live_relayout:
            why = "the ps tasks serve from several processes (start them with --serving_processes 1)"
        elif not self.store.ready:
            why = "the ps tasks hold no model yet: start the job with the new ps tasks instead"
        if why:
            raise errors.ClusterSpecError(
                f"{self.task_name} cannot take this re-layout while training: {why}. Otherwise save a checkpoint, "
                f"stop the job and start it with the new --ps_hosts: it restores onto the new layout"
            )

    def _move(self, after: ClusterSpec, cut: Callable[[], None] | None, stage: pb.MoveStage | None = None) -> None:
        """Take a re-layout's cut (of ``stage``): snapshot the parts into memory and move to ``after``.

        Under the store's lock with the snapshot, before a push can apply: the variables go (the
        snapshot holds them), and a worker of the cluster before is refused from then on. A task
        ``after`` keeps takes its cluster, and waits for its new parts; one it lacks only hands over.
        """
        before = self.cluster

        row_versions: dict[str, torch.Tensor] = {}

        def stop_pushes() -> None:
            row_versions.update(self.store.row_versions())  # for the tasks that copied parts ahead
            self.relayout.move(before, after, stage)
            if self.aggregator is not None:  # the pushes of the round under way are refused, and sent again
                self.aggregator.abandon(self.relayout.refusal())
                self.aggregator, self._sync_def = None, None
            self.store.clear()
            self._variable_defs = []
            if self.task_index < after.num_ps and after != before:
                self.cluster = after
                # The connections before stay open (a round may be asking ps 0 on one); closed with the task.
                self._old_peers.append(self._peers)
                self._peers = PsPeers(after, self.task_index, self._security, self._liveness)

        snapshot = recovery.snapshot_shard(
            self.store,
            self._variable_defs,
            self._sync_def,
            self.task_index,
            before.num_ps,
            self._pushes_held,
            cut,
            then=stop_pushes,
            copy=False,  # the store lets go of its tensors under the same lock: the snapshot holds them
        )
        self.relayout.keep(snapshot, row_versions)
        kept = "keeps its index, and waits for its new parts" if self.task_index < after.num_ps else "is drained"
        log.info(
            "%s: took a re-layout's cut at global step %d (%d parts, %d bytes); it %s",
            self.task_name,
            snapshot.global_step,
            len(snapshot.variables),
            sum(v.value.nbytes for v in snapshot.variables),
            kept,
        )

    def _take_finished(self, workers: Iterable[int]) -> None:
        """The workers that had finished before a re-layout have finished here too (and leave its rounds)."""
        for worker in sorted({*workers, *self.roster.finished}):
            self.roster.finish(worker, self.store.global_step)
            self._worker_left(worker)

    def fetch_parts(self, data: bytes) -> bytes:
        """A task of the new layout reads the parts of some variables, as this task snapshot them at
        the cut (those it copied ahead: their rows changed since); or, ``live``, as they are now."""
        header, _ = codec.decode(data, pb.FetchPartsHeader)
        if header.live:
            return self._live_parts(header)
        moved_to = self.relayout.moved_to
        caller = header.caller
        if caller.job_name != "ps" or moved_to is None or caller.cluster_fingerprint != moved_to.fingerprint:
            raise ClusterMismatchError(
                f"{self.task_name} hands its parts over only to the ps tasks of the re-layout it took "
                f"({'none taken' if moved_to is None else moved_to.job_tasks('ps')}), not to "
                f"{ClusterSpec.caller_name(caller.job_name, caller.task_index)} of fingerprint "
                f"{caller.cluster_fingerprint or 'none'}"
            )
        return self.relayout.hand_over(shard_chunks(*self.relayout.parts_since(header)), header.same_host)

    def _live_parts(self, header: pb.FetchPartsHeader) -> bytes:
        """Copies of this task's fixed table parts that hold rows ``header`` wants, as they are now,
        with the mark of their rows' versions and the layout version: a task of a re-layout's next
        layout copies them ahead of the cut (:mod:`psframe.ps.elastic.precopy`)."""
        if header.caller.job_name != "ps":
            raise ClusterMismatchError(
                f"{self.task_name} hands its parts over only to ps tasks, not to "
                f"{ClusterSpec.caller_name(header.caller.job_name, header.caller.task_index)}"
            )
        with self.store.lock:  # the copies, their mark and the layout version of one instant
            held = [recovery.part_record(d) for d in self._variable_defs if precopy.copied_ahead(d)]
            wanted = select(held, list(header.variables), header.rows)
            values, states, mark = self.store.live_copies([p.name for p in wanted])
            version = self.relayout.version
            spec = self.store.table_optimizer_spec or self.store.optimizer_spec
        assert spec is not None  # the store holds a model: it was read
        parts = [dataclasses.replace(p, value=values[p.name], state=states[p.name]) for p in wanted]
        optimizer = OptimizerData(spec.name, dict(spec.kwargs))
        shard = ShardData(self.store.global_step, self.task_index, self.cluster.num_ps, optimizer, None, tuple(parts))
        return encode_shard(shard, mark=mark, layout_version=version)

    def _peers_at(self, addresses: list[str]) -> PsPeers:
        """The connections to the ps tasks at ``addresses`` (the layout before a re-layout's stage):
        those this task has of its cluster now or of one before, or new ones, kept for later stages."""
        for peers in [self._peers, *self._old_peers]:
            if peers.cluster.job_tasks("ps") == addresses:
                return peers
        before = ClusterSpec({"ps": addresses, "worker": self.cluster.job_tasks("worker")})
        peers = PsPeers(before, self.task_index, self._security, self._liveness)
        self._old_peers.append(peers)
        return peers

    def _adopt_from_peers(
        self,
        addresses: list[str],
        defs: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        table_optimizer: OptimizerSpec | None,
        tasks: list[int],
        ledger: pb.PushLedger | None = None,
    ) -> None:
        """Take the parts the chief placed here from the ps tasks of the layout before (their cut's
        snapshots): from ``tasks`` of them, or all.

        Every task of the new layout takes the push ledger of ps 0 at the cut (every task had
        applied the same steps of every worker then): ``ledger``, as ps 0 answered the cut; or,
        without, read from ps 0's snapshot (then ps 0 is among ``tasks``). ps 0, which a
        re-layout always keeps, keeps its data queues as they are.
        """
        start = time.monotonic()
        caller = pb.Caller(job_name="ps", task_index=self.task_index, cluster_fingerprint=self.cluster.fingerprint)
        # A task kept reads its own snapshot in place: no copy of the parts it keeps.
        own = (self.task_index, self.relayout) if self.relayout.snapshot is not None else None
        if tasks and ((ledger is None and 0 not in tasks) or not all(0 <= k < len(addresses) for k in tasks)):
            raise errors.ClusterMismatchError(
                f"{self.task_name} takes its parts from ps tasks {tasks} of the {len(addresses)} before the "
                f"re-layout: expected indices below {len(addresses)}, and ps 0 among them unless the chief "
                f"sends its push ledger"
            )
        copies = self._copies.take(addresses)
        host = ps_host(self.cluster, self.task_index)
        taken = fetch_shards(self._peers_at(addresses), defs, caller, MAX_FETCH_SECONDS, own, tasks, copies, host)
        shards = taken.shards
        fetched = time.monotonic() - start
        restored = recovery.restore_from_shards(
            shards, defs, optimizer, table_optimizer, source="the re-layout's snapshot"
        )
        if ledger is not None:
            restored.pushes = {"last_push": list(ledger.last_push), "applied_steps": list(ledger.applied_steps)}
        else:  # shards[0] is ps 0's: it is among the tasks read
            pushes = dict(shards[0].pushes or {})
            restored.pushes = {k: v for k, v in pushes.items() if k in ("last_push", "applied_steps")}
        restored.sync = sync
        # ps 0 is kept: its data queues stay, leases and all. The tensors restored are the
        # snapshot's own (nothing else writes them) or fresh: the store takes them as they are.
        self._adopt(restored, peers=False, data=False, take=True)
        log.info(
            "%s: took %d parts (%d bytes with optimizer state) from %d of the %d ps tasks before the re-layout "
            "in %.3f s (%.3f s reading them; %d parts copied ahead, %d of their rows changed since), at global step %d",
            self.task_name,
            len(defs),
            self.store.nbytes(),
            len(shards),
            len(addresses),
            time.monotonic() - start,
            fetched,
            taken.copied_parts,
            taken.changed_rows,
            self.store.global_step,
        )
        self.relayout_parts_copied_ahead += taken.copied_parts
        self.relayout_rows_changed_since_copy += taken.changed_rows

    # ---- a checkpoint's cut: every part holds the same steps of every worker

    def _hold(self, seconds: float) -> pb.SaveReply:
        """Hold pushes back (asynchronous training) and say each worker's steps begun here;
        or, in synchronous training, hold rounds back and say the round this task is at.

        The hold ends with the save that follows, or by itself after ``seconds``
        (at most :data:`MAX_HOLD_SECONDS`): a chief lost between the two never
        stalls training for long.
        """
        seconds = min(max(seconds, 0.1), MAX_HOLD_SECONDS)
        with self.store.lock:
            if not self.store.ready or not self._variable_defs:
                return pb.SaveReply(holds=False)  # nothing to hold here
            if self.aggregator is not None:
                return pb.SaveReply(holds_rounds=True, global_step=self.aggregator.hold(seconds))
            begun = self.ledger.hold(seconds)
        return pb.SaveReply(holds=True, steps_begun=begun)

    def _reach(self, targets: list[int]) -> None:
        """Let each worker's pushes through until its ``targets`` steps are applied here (the
        pushes of steps another ps task had begun), then hold the rest; within the hold's deadline.

        Raises:
            CheckpointError: the hold ended first (a worker died mid-step, say): the cut is lost.
        """
        with self.store.lock:
            self._check_held()
            self.ledger.set_targets(targets)
            while not self.ledger.reached():
                self._check_held()
                self._check_not_lost(targets)
                self._pause_lock()

    def _pause_lock(self) -> None:
        """Let go of the store's lock (held once) for a moment, so that pushes can apply, and take it back."""
        lock = self.store.lock
        lock.release()
        try:
            time.sleep(_HOLD_POLL_SECONDS)
        finally:
            lock.acquire()

    def _check_cut(self) -> None:
        """Raise unless the cut still holds: called under the store's lock, right before the snapshot."""
        self._check_held()
        if not self.ledger.reached():
            raise errors.CheckpointCutError(f"{self.task_name}: pushes went past the checkpoint's cut; save again")

    def _check_not_lost(self, targets: list[int]) -> None:
        """Raise if a worker the cut waits for has been silent here too long to be on its way."""
        for worker in range(min(self.ledger.num_workers, len(targets))):
            if self.ledger.applied_steps(worker) < targets[worker]:
                silent = self.roster.silent_for(worker)
                if silent > CUT_SILENCE_SECONDS:
                    raise errors.CheckpointCutError(
                        f"{self.task_name} could not take the checkpoint's cut: worker {worker} began a step on "
                        f"another ps task and has been silent here for {silent:.1f} s (lost, or cut off)"
                    )

    def _check_held(self) -> None:
        if not self.ledger.held():
            raise errors.CheckpointCutError(
                f"{self.task_name} could not take the checkpoint's cut: its hold ended (after at most "
                f"{MAX_HOLD_SECONDS:.0f} s) before the steps other ps tasks had begun arrived, or before the "
                f"save came; pushes went on, and the next save tries again"
            )

    def _values_like(self, defs: list[pb.VariableDef]) -> dict[str, torch.Tensor]:
        return {d.name: torch.empty(tuple(d.shape), dtype=codec.dtype_from_name(d.dtype), device="meta") for d in defs}

    # ---- PushPull

    def push_pull(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """PushPull on a long-lived stream: requests are answered in order, and
        a refused one gets the error's name in its reply; the stream goes on."""
        cache = StreamCache()
        for data in requests:
            yield self.answer_push_pull(data, cache)

    def answer_push_pull(self, data: bytes, cache: StreamCache | None = None) -> bytes:
        """The reply to one PushPull request: a refused one names the error, and the stream goes on.

        A request whose shared region cannot be used is answered with the
        reason in ``region_unusable``: nothing was applied, and the worker
        sends it again with its tensors in the message.

        ``cache`` holds the cached requests of the request's stream: an asynchronous request
        of a kind seen before on it takes the fast path (see :mod:`psframe.ps.service.fast_path`).
        Anything else (a bug) ends the stream, with the status the transport gives it.
        """
        try:
            return self._handle_push_pull(data, cache)
        except SharedRegionError as e:
            return codec.encode(pb.PushPullReplyHeader(region_unusable=str(e)), ())
        except PsframeError as e:
            name, message = encode_error(e)
            return codec.encode(pb.PushPullReplyHeader(error_class=name, error_message=message), ())

    def _handle_push_pull(self, data: bytes, cache: StreamCache | None = None) -> bytes:
        """Read one request and answer it by the one path its kind and the training take.

        =========  =================================================  =========================
        training   request                                            path
        =========  =================================================  =========================
        async      dense, of a kind cached on this stream             :meth:`_apply_cached`
        async      any other: dense or rows, pushing or pulling       :meth:`_apply_now`
        sync       pulls only: dense values, rows                     :meth:`_apply_now`
        sync       pushes: dense gradients, rows' gradients           :meth:`_join_round`
        =========  =================================================  =========================

        A cached request the model no longer fits (its variables were made
        anew) is dropped from the cache and takes the general path. Asynchronous
        pushes are applied at once; synchronous ones join their step's round,
        and a request that pulls (or ends the worker's step) is answered once
        the round is applied. A request's tensors may lie in the sender's shared
        region (a worker on this host): a reply on the fast path or of a round
        goes back there too.
        """
        self._memory.handled(len(data))
        envelope = codec.parse(data, pb.PushPullHeader)
        header = envelope.header
        region, refused = None, ""
        if cache is not None and header.push_id:
            cache.check_order(header.push_id)
        if header.HasField("same_host"):  # a worker on this host: its tensors may lie in a shared region
            envelope, region, refused = (cache if cache is not None else StreamCache()).open_region(envelope)
        if header.HasField("progress") and not self.keeps_data:
            raise NotKeptHere(header.progress.name)
        cached = (
            cache.find(header)
            if cache is not None and self.aggregator is None and not header.HasField("progress")
            else None
        )
        if cached is None:
            self._check_caller(header.caller)
        try:
            return self._answer(header, envelope, cache, cached, region, refused)
        except NotReadyError:
            self.relayout.check_caller(header.caller)  # the variables went at a re-layout's cut meanwhile
            raise

    def _answer(
        self,
        header: pb.PushPullHeader,
        envelope: codec.Envelope,
        cache: StreamCache | None,
        cached: CachedRequest | None,
        region: SameHostRegion | None,
        refused: str,
    ) -> bytes:
        """:meth:`_handle_push_pull` once the request is read and its caller checked."""
        with self.roster.call(header.caller.task_index):
            if cached is not None and cache is not None:
                reply = self._apply_cached(cached, header, envelope, region)
                if reply is not None:
                    self._bound_staleness(header)
                    return reply
                cache.drop(cached)
            request = PushPullRequest.decode(header, codec.tensors_of(envelope))
            if request.wire_dtype is not None:
                request.grads = self.store.widen(request.grads, request.wire_dtype)
            if request.rows_async:
                self._check_async_rows(request)
            if self.aggregator is None or not request.pushes or request.rows_async:
                reply = self._apply_now(request, header, cache, refused)
                self._bound_staleness(header)
                return reply
            return self._join_round(self.aggregator, request, region, refused)

    def _check_async_rows(self, request: PushPullRequest) -> None:
        """A push of rows applied at once in synchronous training carries rows of tables so
        declared (``SyncReplicas(async_tables=...)``) and nothing else.

        Raises:
            WireFormatError: anything else in it; nothing is applied.
        """
        parts = self.aggregator.async_parts if self.aggregator is not None else frozenset()
        wrong = [name for name, *_ in request.rows if name not in parts]
        if wrong or request.grads or request.pull or request.row_pulls or request.progress is not None:
            raise errors.WireFormatError(
                f"{self.task_name}: a push of rows applied at once carries only rows of the tables "
                f"SyncReplicas(async_tables=...) names ({sorted(parts) or 'none here'}); it had "
                f"{wrong or 'other contents'}"
            )

    def _apply_cached(
        self, cached: CachedRequest, header: pb.PushPullHeader, envelope: codec.Envelope, region: SameHostRegion | None
    ) -> bytes | None:
        """The fast path: an asynchronous request of a kind cached before; None if the cached request no longer holds.

        With a shared ``region`` (a worker on this host), the reply's tensors go there.
        """
        grads = cached.request.tensors(envelope)
        store = self.store
        worker = header.caller.task_index
        with store.lock:
            if cached.generation != store.generation or self.aggregator is not None:
                return None
            if grads and not self.ledger.admits(worker):
                self._wait_turn(worker)
                if cached.generation != store.generation:  # made anew while it waited (a re-layout's cut)
                    return None
            duplicate = bool(grads) and self.ledger.is_duplicate(worker, header.push_id)
            if duplicate:
                grads = []  # applied already: answered with the values it pulls, not applied again
            step = store.update(cached.variables, grads, header.end_of_step)
            ahead = self._record(worker, header.push_id, header.end_of_step) if grads else 0
            # Encode under the lock, as below: one consistent version, one copy.
            reply = pb.PushPullReplyHeader(global_step=step, duplicate=duplicate, steps_ahead=ahead)
            if region is not None and region.fits_reply(cached.reply):
                region.write_reply(cached.reply, cached.reply_buffers)
                reply.in_region = True
                return cached.reply.encode_header(reply)
            return cached.reply.encode(reply, cached.reply_buffers)

    def _apply_now(
        self, request: PushPullRequest, header: pb.PushPullHeader, cache: StreamCache | None, refused: str
    ) -> bytes:
        """The general path: apply an asynchronous push (or none) and answer what it pulls, under the store's lock.

        A dense asynchronous request of full precision is cached on its stream
        (``cache``), so that the next of its kind takes the fast path.
        """
        store = self.store
        grads, rows, pull = request.grads, request.rows, request.pull
        pushes, worker = request.pushes, request.worker
        with store.lock:
            if pushes and not self.ledger.admits(worker):
                self._wait_turn(worker)
            self.relayout.check_caller(header.caller)  # it waited at a re-layout's cut: nothing applies
            for name, ids, *_ in request.row_pulls:  # every row asked for exists before anything changes
                store.check_row_ids(name, ids)
            duplicate = pushes and self.ledger.is_duplicate(worker, request.push_id)
            if duplicate:  # applied already: answered with the values it pulls, not applied again
                store.check_gradients(grads)
                store.check_rows(rows)
                grads, rows, pushes = {}, [], False
            progress = request.progress if pushes else None
            if progress is not None:  # the range is still this worker's, or nothing applies
                self.data.check(worker, progress)
            step, values = store.push_pull(grads, pull, request.end_of_step and pushes, rows)
            ahead = self._record(worker, request.push_id, request.end_of_step) if pushes else 0
            if progress is not None:  # consumed exactly when the update that trained on it applied
                self.data.record(worker, progress)
            if (
                cache is not None
                and request.wire_dtype is None
                and self.aggregator is None
                and not (rows or request.row_pulls)
                and not duplicate
            ):
                self._cache_request(cache, header, list(grads), values)
            # Encode under the lock: the reply is one consistent version, and
            # the only copy of the variables is the one into the reply.
            reply = pb.PushPullReplyHeader(
                global_step=step, region_refused=refused, duplicate=duplicate, steps_ahead=ahead
            )
            sent = outgoing(pull, values, request.wire_dtype)
            if not request.row_pulls:
                return codec.encode(reply, sent)
            kinds = row_tensors.reply_kinds(len(sent), 0)
            for name, ids, create, cached in request.row_pulls:
                if cached is None:
                    sent.append((name, store.read_rows(name, ids, create)))
                    kinds.append(row_tensors.ROWS)
                else:  # a worker's row cache: the rows it lacks or holds too old only
                    versions, fresh = store.read_rows_since(name, ids, create, cached, request.row_staleness)
                    sent += [(name, versions), (name, fresh)]
                    kinds += [row_tensors.ROW_VERSIONS, row_tensors.ROWS]
            return codec.encode(reply, sent, kinds)

    def _record(self, worker: int, push_id: int, end_of_step: bool) -> int:
        """Record an asynchronous push applied (under the store's lock); for one that ends the
        worker's step, count how many steps ahead it found the worker (:mod:`psframe.ps.protocol.staleness`)."""
        ahead = self.staleness.count(worker) if end_of_step else 0
        self.ledger.record(worker, push_id, end_of_step)
        if end_of_step:
            self.staleness.stepped()
        return ahead

    def _bound_staleness(self, header: pb.PushPullHeader) -> None:
        """Hold the reply to a step-ending push under a staleness bound until the worker is
        within it (asynchronous training; without the store's lock)."""
        if header.end_of_step and header.push_id and header.HasField("staleness_bound") and self.aggregator is None:
            self.staleness.wait(header.caller.task_index, header.staleness_bound, header.staleness_timeout or 300.0)

    def _wait_turn(self, worker: int) -> None:
        """Wait (holding the store's lock again on return) until a checkpoint's cut lets
        ``worker``'s push apply: the hold ends by the cut's deadline at the latest."""
        while not self.ledger.admits(worker):
            self._pause_lock()

    def _join_round(
        self, aggregator: SyncAggregator, request: PushPullRequest, region: SameHostRegion | None, refused: str
    ) -> bytes:
        """The synchronous path: add a push to its step's round, and answer once the round is
        applied if it pulls or ends the worker's step (at once otherwise)."""
        worker, pull = request.worker, request.pull
        self.store.check_names(pull)
        if request.row_pulls:  # a round's replies are one encoding for every member: values only
            raise errors.WireFormatError(
                f"{self.task_name}: a synchronous push asked for rows of {request.row_pulls[0][0]!r} too; "
                f"in synchronous training rows are pulled in a message of their own"
            )
        # A push that pulls nothing is one of several messages of a worker's
        # step: it is recorded and answered at once (see Trainer._step_plan).
        # Gradients in a worker's shared region are kept as views: the worker
        # writes there again only after its step's last reply, which comes once
        # the round is applied, or after a failure, which gives it a new region.
        # The step's last message waits for the round: it pulls the new values (or, on
        # a ps task holding only embedding tables, ends a step that pulls rows later).
        # A round applies a worker's gradients once however often they are sent (it
        # is keyed by step and worker); the ledger counts the worker's step once, and
        # tells a push sent again after a lost reply from a stale one.
        if (
            request.step < self.store.global_step
            and self.ledger.is_duplicate(worker, request.push_id)
            and aggregator.was_member(worker, request.step)
        ):
            with self.store.lock:
                return self._round_replies.reply(pull, request.wire_dtype, False, region, refused)
        if request.progress is not None:
            with self.store.lock:
                self.data.check(worker, request.progress)
        dropped = aggregator.push(
            worker,
            request.step,
            request.grads,
            rows=request.rows,
            count_drop=request.end_of_step,
            wait=bool(pull) or request.end_of_step,
            progress=request.progress,
        )
        with self.store.lock:
            duplicate = self.ledger.is_duplicate(worker, request.push_id)
            if not dropped and not duplicate:
                self.ledger.record(worker, request.push_id, request.end_of_step)
            return self._round_replies.reply(pull, request.wire_dtype, dropped, region, refused)

    def _cache_request(
        self, cache: StreamCache, header: pb.PushPullHeader, pushed: list[str], pulled: list[torch.Tensor]
    ) -> None:
        """Let requests of this kind take the fast way from now on (the caller holds the store's lock)."""
        try:
            cached = CachedRequest.make(header, self.store.variables(pushed), pulled, self.store.generation)
        except PsframeError as e:  # a request psframe's workers do not make: it stays on the general path
            log.debug("%s: a request that cannot be cached: %s", self.task_name, e)
        else:
            cache.add(cached)

    # ---- data read in ranges

    def data_range(self, request: pb.DataRangeRequest) -> pb.DataRangeReply:
        self._check_caller(request.caller)
        worker = request.caller.task_index
        spec = DataSpec(request.num_examples, request.range_size, request.epochs)
        with self.roster.call(worker):
            grant = self.data.acquire(worker, request.name, spec)
        if self.aggregator is not None:  # sync rounds do not wait for a worker without data
            if grant.lease is None:
                self.aggregator.pause(worker)
            else:
                self.aggregator.resume(worker)
        reply = pb.DataRangeReply(
            exhausted=grant.exhausted, retry_after=grant.retry_after, consumed=grant.consumed, total=grant.total
        )
        if grant.lease is not None:
            lease = grant.lease
            reply.lease, reply.epoch, reply.start, reply.end, reply.offset = (
                lease.lease_id,
                lease.epoch,
                lease.start,
                lease.end,
                lease.offset,
            )
        return reply

    # ---- sync

    def _start_sync(self, sync: pb.SyncDef) -> None:
        decide = None if self.task_index == 0 else self._peers.step_members
        self.aggregator = SyncAggregator(
            self.store,
            num_workers=sync.total_num_replicas or self.cluster.num_workers,
            replicas_to_aggregate=sync.replicas_to_aggregate,
            timeout=sync.timeout_seconds,
            decide=decide,
            required=messages.sync_from_def(sync).required if self.elastic else None,
            on_applied=self.data.record,
            async_parts=[d.name for d in self._variable_defs if d.variable in set(sync.async_tables)],
        )
        for worker in self.roster.finished:
            self.aggregator.worker_finished(worker)
        if self.elastic:  # (the store's lock is held: _follow_membership takes it after its own)
            self.aggregator.follow(set(self.roster.live()))
        self._sync_def = sync
        log.info("%s: synchronous training, %s", self.task_name, messages.describe_sync(sync))

    def step_members(self, request: pb.StepMembersRequest) -> pb.StepMembersReply:
        self._check_caller(request.caller, job_name="ps")
        if self.aggregator is None:
            raise NotReadyError(f"{self.task_name} is not training synchronously (yet)")
        workers = self.aggregator.members_of(request.step)
        return pb.StepMembersReply(step=request.step, workers=workers)

    # ---- Finish

    def finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        self._check_caller(request.caller)
        worker = request.caller.task_index
        if self.roster.finish(worker, self.store.global_step):
            log.info(
                "%s: worker %d finished (%d of %d)",
                self.task_name,
                worker,
                len(self.roster.finished),
                len(self.roster.members()),
            )
        done = len(self.roster.finished)
        self._worker_left(worker)
        return pb.FinishResponse(finished_workers=done, num_workers=len(self.roster.members()))

    def _worker_left(self, worker: int) -> None:
        """A worker finished: the rounds no longer wait for it, and the task ends once every one has."""
        if self.aggregator is not None:
            self.aggregator.worker_finished(worker)
        if self.elastic:
            self._follow_membership()
        if self.roster.all_finished:
            self.all_finished.set()

    def handlers(self) -> dict[str, Callable]:
        """The methods of the service this task answers, by name: all of them."""
        return {
            **super().handlers(),
            "Init": self.init,
            "PushPull": self.push_pull,
            "Finish": self.finish,
            "Save": self.save,
            "StepMembers": self.step_members,
            "DataRange": self.data_range,
            "Reshard": self.reshard,
            "FetchParts": self.fetch_parts,
        }

    def close(self) -> None:
        """Close the connections to the other ps tasks."""
        for peers in [*self._old_peers, self._peers]:
            peers.close()

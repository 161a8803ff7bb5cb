"""The ps task's service: its components wired together, and the table of what it answers.

Handlers take a request and return a reply; :mod:`psframe.wire.transport`
serves them, and turns the psframe errors they raise into status codes (a
PushPull stream's refused request gets the error in its reply instead, and
the stream goes on: the data plane's :meth:`PushPullHandler.stream` is the
PushPull method). Tensor-carrying methods (Init, PushPull, FetchParts, CopyPartsLive)
take and return raw bytes and use :mod:`psframe.wire.codec`, so tensors are
read in place from the request and written once into the reply; the small
methods use the generated classes.

Each handler is a component of this package, behind a narrow interface:

- :mod:`~psframe.ps.service.push_pull_handler`: the data plane (PushPull) and its
  fast path (a stream's requests worked out once), with
  :mod:`~psframe.ps.service.push_pull_request` (a request read) and
  :mod:`~psframe.ps.service.sync_pushes` (the synchronous path: rounds and their replies);
- :mod:`~psframe.ps.service.membership`: the callers admitted, the workers'
  comings and goings (GetInfo, Finish), the end of training;
- :mod:`~psframe.ps.service.model_init`: Init and TakeParts, with
  :mod:`~psframe.ps.service.definitions` and
  :mod:`~psframe.ps.service.incoming_model` (the chief's model, as it arrives);
- :mod:`~psframe.ps.service.cut_handler`: HoldCut, SaveShard and MoveCut (a
  checkpoint's or a re-layout's cut);
- :mod:`~psframe.ps.service.relayout_participant`: AskRelayout, RelayoutStatus,
  RelayoutDone, Precopy, FetchParts, CopyPartsLive, and the task's part in a re-layout;
- :mod:`~psframe.ps.service.data_range_handler`: DataRange, StreamPartitions and StreamOffsets;
- :mod:`~psframe.ps.service.metric_report`: ReportMetric (the chief's metric for the schedules);
- :mod:`~psframe.ps.service.status_report`: what GetInfo reports.

They share :class:`~psframe.ps.service.served_model.ServedModel` (the model
served: definitions, synchronous rounds) and
:class:`~psframe.ps.service.place.TaskPlace` (the task's cluster and its
connections to the other ps tasks);
:mod:`~psframe.ps.service.task_service` is what every task answers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy

from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.memory import HugePageMemory, malloc
from psframe.ps import recovery
from psframe.ps.elastic.relayout import Relayout
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.ledger_cut import LedgerCut, PushesHeld
from psframe.ps.protocol.roster import WorkerRoster, check_max_workers
from psframe.ps.protocol.staleness import StalenessGate
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service.cut_handler import CutHandler
from psframe.ps.service.data_range_handler import DataRangeHandler
from psframe.ps.service.membership import Membership
from psframe.ps.service.metric_report import MetricReportHandler
from psframe.ps.service.model_init import ModelInit
from psframe.ps.service.place import TaskPlace
from psframe.ps.service.push_pull_handler import PushPullHandler
from psframe.ps.service.relayout_participant import RelayoutParticipant
from psframe.ps.service.served_model import ServedModel
from psframe.ps.service.status_report import task_info
from psframe.ps.service.task_service import TaskService
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb


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
            that carries data progress to the task's owner (:class:`~psframe.errors.NotKeptHere`).
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
        slots = check_max_workers(max_workers, cluster.num_workers)
        elastic = max_workers is not None  # given: workers may join and leave, even with no slot to spare
        # A live re-layout (psframe.ps.elastic.relayout): one asked for, or taken.
        self.relayout = Relayout()
        self.store = store if store is not None else VariableStore(self.task_name, memory=HugePageMemory())
        # Each worker's pushes applied once, whatever is sent again after a reconnect.
        self.ledger = ledger if ledger is not None else PushLedger(slots)
        self.roster = WorkerRoster(
            cluster.num_workers, worker_timeout, last_seen=last_seen, chief_timeout=chief_timeout, capacity=slots
        )
        # Data read in ranges: what each worker's pushes consumed, recorded with them.
        self.data = RangeQueue(gone=lambda worker: worker not in self.roster.live(), lock=self.store.lock)
        # Asynchronous training: how far ahead each step finds its worker, and bounded staleness.
        self.staleness = StalenessGate(self.ledger, self.roster, self.task_name)
        self._checkpoint_dir, self._max_workers = checkpoint_dir, slots if elastic else None
        self._place = TaskPlace(cluster, task_index, security, liveness)
        self._model = ServedModel(
            self.store, self.ledger, self.data, self.roster, self._place, task_index=task_index, elastic=elastic
        )
        self._membership = Membership(
            self.roster,
            self.relayout,
            self._place,
            self.store,
            self.all_finished,
            self._model,
            task_name=self.task_name,
            elastic=elastic,
            max_workers=slots,
            worker_timeout=worker_timeout,
        )
        cut = LedgerCut(self.ledger, self.store.lock, self.roster, self.task_name)
        pushes = PushesHeld(self.ledger, self.data)
        self._relayout_participant = RelayoutParticipant(
            self.store,
            self._model,
            self.relayout,
            self._place,
            pushes,
            self.roster,
            task_index=task_index,
            check_tool_or_worker=self._check_tool_or_worker,
            take_finished=self._membership.take_finished,
            on_moved=self._moved,
        )
        self._model_init = ModelInit(
            self.store,
            self._model,
            self._membership,
            self.roster,
            self.ledger,
            self.relayout,
            self._relayout_participant,
            self._place,
            task_index=task_index,
            elastic=elastic,
            keeps_data=keeps_data,
            checkpoint_dir=checkpoint_dir,
        )
        self._cuts = CutHandler(
            self.store,
            self._model,
            cut,
            pushes,
            self.relayout,
            self._relayout_participant,
            self._place,
            task_index=task_index,
            checkpoint_dir=checkpoint_dir,
            check_tool_or_worker=self._check_tool_or_worker,
        )
        self._data_ranges = DataRangeHandler(self._membership, self.roster, self.data, self._model)
        self._metrics = MetricReportHandler(self._membership, self.store, self.task_name)
        # The data plane: its stream method answers PushPull.
        self.push_pulls = PushPullHandler(
            self.store,
            self.ledger,
            cut,
            self.roster,
            self.staleness,
            self.data,
            self._model,
            admission=self._membership,
            layout=self.relayout,
            # Where psframe may not tune malloc, freed message buffers are trimmed instead.
            memory=malloc.MemoryReturner(enabled=not malloc.malloc_tuned()),
            task_name=self.task_name,
            keeps_data=keeps_data,
        )
        if checkpoint_dir:
            restored = recovery.restore_own_shard(checkpoint_dir, task_index, cluster.num_ps)
            if restored is not None:
                self._model.take_restored(restored)

    def _moved(self, after: ClusterSpec) -> None:
        """A re-layout's cut moved this task to ``after`` (it keeps its index)."""
        self.cluster = after

    # ---- the handlers

    def handlers(self) -> dict[str, Callable]:
        """The methods of the service this task answers, by name: all of them."""
        return {
            **super().handlers(),
            "Init": self._model_init.init,
            "TakeParts": self._model_init.take_parts,
            "PushPull": self.push_pulls.stream,
            "Finish": self._membership.finish,
            "HoldCut": self._cuts.hold_cut,
            "SaveShard": self.save_shard,
            "MoveCut": self._cuts.move_cut,
            "StepMembers": self.step_members,
            "DataRange": self._data_ranges.data_range,
            "StreamPartitions": self._data_ranges.stream_partitions,
            "StreamOffsets": self._data_ranges.stream_offsets,
            "AskRelayout": self._relayout_participant.ask,
            "RelayoutStatus": self._relayout_participant.status,
            "RelayoutDone": self._relayout_participant.done,
            "Precopy": self._relayout_participant.precopy,
            "FetchParts": self._relayout_participant.fetch_parts,
            "CopyPartsLive": self._relayout_participant.copy_parts_live,
            "ReportMetric": self._metrics.report_metric,
        }

    def get_info(self, request: pb.InfoRequest) -> pb.TaskInfo:
        self._membership.heard(request)
        return self.info()

    def info(self) -> pb.TaskInfo:
        return task_info(
            super().info(),
            store=self.store,
            model=self._model,
            roster=self.roster,
            ledger=self.ledger,
            staleness=self.staleness,
            data=self.data,
            relayout=self.relayout,
            over=self.all_finished,
            checkpoint_dir=self._checkpoint_dir,
            max_workers=self._max_workers,
        )

    def save_shard(self, request: pb.SaveShardRequest) -> pb.SaveShardReply:
        """The SaveShard handler (:class:`~psframe.ps.service.cut_handler.CutHandler`)."""
        return self._cuts.save_shard(request)

    def step_members(self, request: pb.StepMembersRequest) -> pb.StepMembersReply:
        """ps 0 tells another ps task the members of a step's round."""
        self._membership.check_caller(request.caller, job_name="ps")
        return self._model.step_members(request.step)

    def _same_cluster(self, caller: pb.Caller) -> bool:
        return self._membership.same_cluster(caller)

    def check_training_over(self) -> bool:
        """Follow the workers (:meth:`Membership.tick`), then say whether training is over."""
        self._membership.tick()
        return self._membership.training_over()

    def close(self) -> None:
        """Close the connections to the other ps tasks."""
        self._place.close()

    # ---- views of the components' state (the serving processes' wrapper and tests read them)

    @property
    def aggregator(self) -> SyncAggregator | None:
        """The synchronous rounds; None in asynchronous training."""
        return self._model.aggregator

    @property
    def _variable_defs(self) -> list[pb.VariableDef]:
        return self._model.defs

    @_variable_defs.setter
    def _variable_defs(self, defs: list[pb.VariableDef]) -> None:
        self._model.defs = defs

    def _start_sync(self, sync: pb.SyncDef) -> None:
        self._model.start_sync(sync)

    @property
    def live_relayout(self) -> bool:
        """Whether the task may take a re-layout live (False where it serves from several processes,
        which share one layout: see :mod:`psframe.ps.serving.shared_service`)."""
        return self._relayout_participant.live

    @live_relayout.setter
    def live_relayout(self, live: bool) -> None:
        self._relayout_participant.live = live

    @property
    def relayout_parts_copied_ahead(self) -> int:
        """Table parts this task took as copies made ahead of their re-layout's cut."""
        return self._relayout_participant.parts_copied_ahead

    @property
    def relayout_rows_changed_since_copy(self) -> int:
        """The rows of those parts that changed between their copy and the cut."""
        return self._relayout_participant.rows_changed_since_copy

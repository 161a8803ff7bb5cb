"""``psframe.Trainer``: trains a replica of a ``torch.nn.Module`` against the ps tasks.

Lifecycle (``with trainer:`` or :meth:`Trainer.connect` / :meth:`Trainer.close`)::

    NEW --connect()--> RUNNING --close()--> CLOSED
          chief: create the variables on the ps tasks (or adopt those there)
          others: wait until the ps tasks hold the model
          all: pull the parameters into the local model

Each :meth:`Trainer.step` runs backward, sends every ps task the gradients of
the variables it holds and receives their updated values in the same call,
to all ps tasks in parallel.

The parts, each readable alone: :mod:`psframe.worker.model.replica` (the local
model bound to its shards), :mod:`psframe.worker.plan.step_plan` (which message
carries which shard), :mod:`psframe.worker.session.startup` (the chief's
initialisation, and joining the model after a lost ps task),
:mod:`psframe.worker.client.ps_client` (tensors to and from the ps tasks) and
:mod:`psframe.checkpoint` (saving).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from psframe import checkpoint
from psframe.cluster import ClusterSpec
from psframe.cluster.moves import MoveStage
from psframe.cluster.placement import ShardPlacement
from psframe.config.liveness import Liveness
from psframe.config.options import (
    DEFAULT_KEEP_CHECKPOINTS,
    BoundedStaleness,
    Checkpointing,
    DataRanges,
    Placement,
    RowCaching,
    Transport,
)
from psframe.config.security import Security, accept_security
from psframe.errors import (
    CheckpointError,
    ClusterMismatchError,
    ClusterSpecError,
    DataRangeLostError,
    LayoutChangedError,
    NotReadyError,
    PsframeError,
    RpcTimeoutError,
    TaskUnavailableError,
)
from psframe.optim import OptimizerSpec, SyncReplicas, SyncReplicasOptimizer
from psframe.tables.rows import UNKNOWN_VERSION, CachedPull, FreshRows, RowPull, RowPush
from psframe.worker.client.operations import DenseReply
from psframe.worker.client.ps_client import PsClient, RangeGrant, resolve_wire_dtype
from psframe.worker.client.streams import Exchange
from psframe.worker.hooks import CheckpointSaverHook, Hook
from psframe.worker.model.overlap import BackwardOverlap
from psframe.worker.model.prefetch import Prefetcher
from psframe.worker.model.replica import Replica, place_model
from psframe.worker.model.staging import HostStaging, resolve_device
from psframe.worker.model.tables import EmbeddingTables
from psframe.worker.plan.step_plan import Request
from psframe.worker.session import relayout, startup
from psframe.worker.session.arguments import (
    async_table_names,
    option_groups,
    resolve_optimizer,
    resolve_table_optimizer,
)
from psframe.worker.session.data_reader import Outcome, RangeReader
from psframe.worker.session.in_graph import InGraphReplicas

log = logging.getLogger(__name__)

T = TypeVar("T")
# How often the chief asks ps 0 whether a re-layout waits (asked by a tool): two small calls a second.
RESHARD_POLL_SECONDS = 0.5
# How long closing waits for the client of a layout before to close (it closes in a thread of its own).
CLOSE_WAIT_SECONDS = 10.0


class TrainerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class Trainer:
    """Trains one replica of ``model`` as worker ``task_index`` of ``cluster``.

    Args:
        model: any ``torch.nn.Module``; its trainable parameters become
            variables on the ps tasks. Every worker must build the same model.
        cluster: the cluster (a :class:`ClusterSpec` or a dict).
        task_index: this worker's index; worker 0 is the chief.
        optimizer: the server-side optimizer, e.g. ``psframe.optim.Adam(lr=1e-3)``;
            defaults to ``SGD(lr=0.01)``. A ``psframe.optim.SyncReplicasOptimizer``
            also sets ``sync``.
        sync: ``psframe.SyncReplicas(...)`` for synchronous training; None
            (the default) for asynchronous updates. Every worker must agree.
        device: where the local replica computes ("cpu", "cuda", "cuda:1");
            the model is moved there. Defaults to the model's device.
        gpu_memory_fraction: cap this process's share of the GPU's memory
            (TF's ``per_process_gpu_memory_fraction``); CUDA only.
        placement: where the variables go, a :class:`psframe.Placement`
            (greedy by bytes, explicit devices, partitioning); default ``Placement()``.
        hooks: :class:`psframe.hooks.Hook` instances.
        checkpointing: a :class:`psframe.Checkpointing` (folder or fsspec URL,
            interval, how many kept): the chief saves there every interval
            and at the end, and a ps task that restarts restores its shard
            from it. None: no checkpoints.
        transport: timeouts, wire compression and same-host shared memory, a
            :class:`psframe.Transport`; default ``Transport()``.
        table_optimizer: the optimizer of the model's embedding tables
            (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``, see
            :mod:`psframe.worker.model.tables`): one that updates only the rows a
            batch touched, ``psframe.optim.SGD``, ``SparseSGD`` (lazy
            momentum), ``Adagrad`` or ``SparseAdam``. Defaults to the row-by-row
            form of ``optimizer`` (``SGD`` with momentum: ``SparseSGD``;
            ``Adam``: ``SparseAdam``).
        security: who may talk to the cluster, a :class:`psframe.Security`:
            the cluster's shared auth token, sent with every call; this
            worker's certificate and key (PEM), presented to ps tasks that
            require one (mutual TLS); the CA (PEM) the ps tasks' certificates
            chain to (calls use TLS). Used as given. None: from the
            ``PSFRAME_AUTH_TOKEN`` and ``PSFRAME_TLS_*`` environment variables
            (:meth:`Security.resolve`; ``psframe launch`` sets them), or none.
        liveness: how this worker's connections are probed for a ps task
            that went away (keepalive pings; see :mod:`psframe.config.liveness`):
            a dead connection is noticed within ``keepalive_time +
            keepalive_timeout`` seconds, and the worker waits for the task
            and goes on. None: the ``PSFRAME_KEEPALIVE_*`` environment
            variables, or 5 s + 5 s.

        overlap_backward: send each of a step's messages as soon as backward
            has made its gradients, while it goes on (see
            :mod:`psframe.worker.model.overlap`); training is unchanged. Off by
            default: on 2 cores and a 1 Gbit/s link it gained nothing on the
            large MLP and lost 5% on a deeper one (docs/decisions.md). It
            applies to CPU replicas without embedding tables and without hooks
            that act before the push (``NanGuardHook``).
        row_cache: keep embedding rows between steps, a
            :class:`psframe.RowCaching`: a lookup sends the versions of the
            rows held, and a ps task sends back only those that moved more
            than its ``staleness`` past them (:mod:`psframe.worker.model.row_cache`).
            None: every lookup pulls its rows. Prefetched rows are pulled whole.
        staleness: asynchronous training in which this worker runs at most
            ``staleness.steps`` steps ahead of the slowest live worker, a
            :class:`psframe.BoundedStaleness` (SSP): each ps task answers the
            push that ends a step once that holds. None: no bound. Not with ``sync``.
        replica_devices: in-graph replication: this process drives a replica of the
            model on each device (``["cuda:0", "cuda:1"]``, or several ``"cpu"``), the
            first of them ``model`` itself; :meth:`step` then takes one loss per
            replica (:attr:`replicas`). Synchronous training averages the replicas'
            gradients here and pushes once; asynchronous training pushes each
            replica's gradient as a step of its own (:mod:`psframe.worker.session.in_graph`).
            Not with embedding tables or ``overlap_backward``. None: one replica.

    Raises:
        ClusterSpecError: the cluster or task index is invalid, or a ps task's address has port 0.
        ValueError: the model has no trainable parameter, or an argument is out of range.
        SecurityConfigError: a security setting is invalid or its file cannot be read.
        TypeError: an option group of another type.

    Example::

        trainer = psframe.Trainer(model, cluster, task_index=0, optimizer=psframe.optim.SGD(lr=0.5))
        with trainer:
            for x, y in loader:
                trainer.step(F.cross_entropy(model(x), y))
                if trainer.should_stop():
                    break
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cluster: ClusterSpec | Mapping[str, Sequence[str]],
        task_index: int = 0,
        *,
        optimizer: OptimizerSpec | SyncReplicasOptimizer | None = None,
        sync: SyncReplicas | None = None,
        table_optimizer: OptimizerSpec | None = None,
        device: str | torch.device | None = None,
        gpu_memory_fraction: float | None = None,
        hooks: Iterable[Hook] = (),
        placement: Placement | None = None,
        checkpointing: Checkpointing | None = None,
        transport: Transport | None = None,
        security: Security | None = None,
        liveness: Liveness | None = None,
        overlap_backward: bool = False,
        row_cache: RowCaching | None = None,
        staleness: BoundedStaleness | None = None,
        replica_devices: Sequence[str | torch.device] | None = None,
    ) -> None:
        placement, checkpointing, transport = option_groups(placement, checkpointing, transport)
        self._security = accept_security("Trainer", security)
        self._liveness = liveness or Liveness.resolve()
        self._cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self._cluster.validate_task("worker", task_index)
        if unbound := self._cluster.tasks_on_any_port("ps"):
            k = unbound[0]
            raise ClusterSpecError(
                f"{ClusterSpec.task_name('ps', k)} has address {self._cluster.task_address('ps', k)!r}: port 0 asks "
                f"its server to pick a free port, and a worker must be given the port it picked (the cluster of "
                f"the running server, psframe.Server(...).cluster, or psframe.local_cluster(...).cluster)"
            )
        self._task_index = task_index
        self._is_chief = task_index == 0
        # As given, and resolved: again at connect, for the live workers where the ps tasks are elastic.
        self._optimizer, self._sync_given, self._sync = resolve_optimizer(optimizer, sync, self._cluster.num_workers)
        rpc_timeout = transport.rpc_timeout
        if self._sync is not None:
            # A call may wait at the barrier for as long as the sync timeout.
            rpc_timeout = max(rpc_timeout, self._sync.timeout + 30.0)
        if staleness is not None:
            if not isinstance(staleness, BoundedStaleness):
                raise TypeError(f"staleness must be a psframe.BoundedStaleness or None, got {type(staleness).__name__}")
            if self._sync is not None:
                raise ValueError(
                    "staleness bounds asynchronous training; with sync every step waits for its round already "
                    "(give one or the other)"
                )
            rpc_timeout = max(rpc_timeout, staleness.timeout + 30.0)  # a step may wait as long as the bound's timeout
        self._staleness = staleness
        self._steps_ahead: collections.Counter[int] = collections.Counter()
        self._wire_dtype = resolve_wire_dtype(transport.wire_dtype)
        if replica_devices is not None:
            replica_devices = [torch.device(d) for d in replica_devices]
            if device is not None and torch.device(device) != replica_devices[0]:
                raise ValueError(f"device ({device}) must be the first of replica_devices ({replica_devices}), or None")
            device = replica_devices[0] if replica_devices else None
        self._device = resolve_device(model, device, gpu_memory_fraction)
        self._model = model.to(self._device)
        self._hooks = list(hooks)
        self._checkpointing = checkpointing
        if checkpointing is not None and self._is_chief:
            self._hooks.append(
                CheckpointSaverHook(*checkpointing.interval, checkpointing.delta_steps, checkpointing.delta_secs)
            )
        self._last_commit: int | None = None  # the step of the last checkpoint this chief committed
        self._recoveries = 0  # times this worker waited for a lost ps task and went on
        self._transport = transport
        self._rpc_timeout = rpc_timeout
        self._global_step = 0
        self._local_step = 0
        self._dropped_steps = 0  # sync: steps whose gradients came too late and were dropped
        self._skipped_steps = 0  # steps that pushed no gradient (e.g. NanGuardHook dropped them)
        # Steps whose gradients every ps task answered as applied (once, however often sent).
        self._pushed_steps = 0
        self._rows_looked_up = 0  # rows of embedding tables lookups asked the ps tasks about
        self._rows_pulled = 0  # rows that came back (a row cache's: those it lacked or held too old)
        self._sent_during_backward = 0  # requests sent before backward ended (overlap_backward)
        # Data read in ranges (read()): what became of the batch the last step trained on.
        self._batch_outcome: Outcome | None = None
        self._reading = False  # a batch of read() is out: the next step reports its progress
        self._state = TrainerState.NEW
        self._stop_requested = False
        self._client: PsClient | None = None
        self._prefetcher = Prefetcher()
        self._overlap_backward = overlap_backward
        self._overlap: BackwardOverlap | None = None
        self._placement_given, self._row_cache = placement, row_cache
        self._replica = self._make_replica(self._cluster.num_ps)
        self._next_reshard_poll = 0.0  # the chief asks ps 0 whether a re-layout waits (asked by a tool)
        self._relayouts = 0
        self._relayout_pauses: list[float] = []  # of the stages of the last re-layout this chief led
        self._relayout_parts: list[int] = []  # the parts each of those stages moved
        self._stage: MoveStage | None = None  # the last stage this chief took
        self._readying: relayout.Readying | None = None  # the next stage, readied while training goes on
        self._closing: list[threading.Thread] = []  # the clients of layouts before, closing
        self._layouts = relayout.Layouts(self._placement_on, self._layout_with, placement.max_shard_bytes)
        self._placement = self._replica.placement
        self._async_tables: frozenset[str] = frozenset()  # sync: tables applied at once (variable names)
        if self._sync_given is not None and self._sync_given.async_tables:
            self._async_tables = async_table_names(self._sync_given.async_tables, self._replica.tables.names)
            self._sync_given = dataclasses.replace(self._sync_given, async_tables=tuple(sorted(self._async_tables)))
            self._sync = self._sync_given.resolve(self._cluster.num_workers)
        self._in_graph: InGraphReplicas | None = None
        if replica_devices is not None:
            if self._replica.tables:
                raise ValueError("in-graph replication (replica_devices) takes models without embedding tables")
            if overlap_backward:
                raise ValueError("in-graph replication (replica_devices) does not overlap backward with the push")
            devices = [self._device, *(resolve_device(model, d, None) for d in replica_devices[1:])]
            self._in_graph = InGraphReplicas(self._model, devices)
        self._table_optimizer = resolve_table_optimizer(table_optimizer, self._optimizer, self._replica.tables)
        if placement.log:
            log.info("placement of worker %d:\n%s", task_index, self._placement.describe())

    # ---- lifecycle

    def connect(self) -> Trainer:
        """Connect to the ps tasks, create or wait for the model, pull parameters.

        Raises:
            ConnectTimeoutError: a ps task (or the model) did not come up in time.
            ClusterMismatchError: a ps task holds another model or cluster.
        """
        if self._state is not TrainerState.NEW:
            raise PsframeError(f"the trainer is {self._state.value}; connect() is called once")
        self._client = self._make_client(self._cluster)
        self._state = TrainerState.RUNNING
        try:
            self._join(connecting=True)
            self.pull()
            self._replica.tables.attach(self._pull_rows)
            if self._overlaps():
                self._overlap = BackwardOverlap(self._replica.plan.step, self._replica.params)
            log.info(
                "worker %d connected to %d ps tasks at global step %d",
                self._task_index,
                self._cluster.num_ps,
                self._global_step,
            )
            for hook in self._hooks:
                hook.begin(self)
        except BaseException:
            # Never started training: release the channels, report nothing.
            if self._overlap is not None:
                self._overlap.close()
                self._overlap = None
            self._replica.tables.detach()
            self._client.close()
            self._state = TrainerState.CLOSED
            raise
        return self

    def _make_replica(self, num_ps: int, placement: ShardPlacement | None = None) -> Replica:
        """The model bound to its placement on ``num_ps`` ps tasks (again after a re-layout), or to
        ``placement`` (a stage of a re-layout)."""
        return Replica(
            self._model,
            num_ps,
            HostStaging(self._device),
            sync=self._sync is not None,
            wire_dtype=self._wire_dtype,
            row_cache=self._row_cache,
            placement=placement,
            **self._placement_options(),
        )

    def _placement_options(self) -> dict[str, Any]:
        given = self._placement_given
        return {
            "variable_devices": dict(given.variable_devices),
            "strategy": given.strategy,
            "min_partition_bytes": given.min_partition_bytes,
            "dense_parts": given.dense_parts,
            "soft_placement": given.soft,
            "max_shard_bytes": given.max_shard_bytes,
            "table_partition": given.table_partition,
            "table_parts": given.table_parts,
        }

    def _placement_on(self, num_ps: int) -> ShardPlacement:
        """The model's own placement on ``num_ps`` ps tasks."""
        return place_model(self._model, num_ps, **self._placement_options())

    def _layout_with(self, cluster: ClusterSpec, placement: ShardPlacement) -> relayout.Layout:
        """The model bound to ``placement`` on the ps tasks of ``cluster``, and a client of them."""
        return relayout.Layout(cluster, self._make_client(cluster), self._make_replica(cluster.num_ps, placement))

    def _make_client(self, cluster: ClusterSpec) -> PsClient:
        return PsClient(
            cluster,
            self._task_index,
            rpc_timeout=self._rpc_timeout,
            wire_dtype=self._wire_dtype,
            shared_memory=self.shared_memory,
            security=self._security,
            liveness=self._liveness,
            staleness=self._staleness,
        )

    # Read-only: set by the trainer, read by hooks and callers.

    @property
    def model(self) -> torch.nn.Module:
        """The local model (on :attr:`device`), whose parameters mirror the ps tasks' variables."""
        return self._model

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster."""
        return self._cluster

    @property
    def task_index(self) -> int:
        """This worker's index."""
        return self._task_index

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0, which creates the model and writes checkpoints."""
        return self._is_chief

    @property
    def optimizer(self) -> OptimizerSpec:
        """The optimizer the ps tasks apply to the dense variables."""
        return self._optimizer

    @property
    def table_optimizer(self) -> OptimizerSpec | None:
        """The optimizer of the embedding tables' rows; None without tables."""
        return self._table_optimizer

    @property
    def sync(self) -> SyncReplicas | None:
        """The synchronous settings, resolved for the cluster (for the live workers, round by round,
        where the ps tasks take workers joining and leaving: known once connected); None: asynchronous."""
        return self._sync

    @property
    def device(self) -> torch.device:
        """Where the local model computes."""
        return self._device

    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks called around each step (with the chief's checkpoint saver, if any)."""
        return tuple(self._hooks)

    @property
    def placement(self) -> ShardPlacement:
        """Which ps task holds each shard (:class:`psframe.cluster.placement.ShardPlacement`)."""
        return self._placement

    @property
    def checkpointing(self) -> Checkpointing | None:
        """The checkpoint settings; None: the chief saves none."""
        return self._checkpointing

    @property
    def transport(self) -> Transport:
        """How the worker talks to the ps tasks."""
        return self._transport

    @property
    def security(self) -> Security:
        """The auth token and TLS settings every call carries."""
        return self._security

    @property
    def liveness(self) -> Liveness:
        """How the worker's connections are probed for a ps task that went away."""
        return self._liveness

    @property
    def rpc_timeout(self) -> float:
        """Deadline in seconds of each call (raised to outlast a sync round's timeout)."""
        return self._rpc_timeout

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype gradients and values travel in; None: as stored."""
        return self._wire_dtype

    @property
    def overlap_backward(self) -> bool:
        """Whether a step's requests are sent while backward still runs."""
        return self._overlap_backward

    @property
    def state(self) -> TrainerState:
        """new (not connected yet), running, or closed."""
        return self._state

    @property
    def global_step(self) -> int:
        """The global step of the values last received."""
        return self._global_step

    @property
    def local_step(self) -> int:
        """Steps this worker took."""
        return self._local_step

    @property
    def pushed_steps(self) -> int:
        """Steps whose gradients every ps task answered as applied (once, however often sent)."""
        return self._pushed_steps

    @property
    def dropped_steps(self) -> int:
        """Sync: steps whose gradients came too late and were dropped."""
        return self._dropped_steps

    @property
    def skipped_steps(self) -> int:
        """Steps that pushed no gradient (e.g. NanGuardHook dropped them)."""
        return self._skipped_steps

    @property
    def sent_during_backward(self) -> int:
        """Requests sent before backward ended (``overlap_backward``)."""
        return self._sent_during_backward

    @property
    def recoveries(self) -> int:
        """Times this worker waited for a lost ps task and went on."""
        return self._recoveries

    # Read from the option groups, never kept twice.

    @property
    def checkpoint_dir(self) -> str | None:
        """Where the chief saves checkpoints; None without :class:`psframe.Checkpointing`."""
        return self._checkpointing.dir if self._checkpointing is not None else None

    @property
    def keep_checkpoints(self) -> int:
        """How many of the newest checkpoints are kept."""
        return self._checkpointing.keep if self._checkpointing is not None else DEFAULT_KEEP_CHECKPOINTS

    @property
    def connect_timeout(self) -> float:
        """Seconds to wait for the ps tasks (:attr:`psframe.Transport.connect_timeout`)."""
        return self._transport.connect_timeout

    @property
    def shared_memory(self) -> bool:
        """Whether tensors to a ps task on this host go through shared memory
        (:attr:`psframe.Transport.same_host_memory`)."""
        return self._transport.same_host_memory

    @property
    def _ps(self) -> PsClient:
        """The client of the ps tasks, made by connect()."""
        if self._client is None:
            raise PsframeError("the trainer is not connected: call connect() first, or use it in a with block")
        return self._client

    def _overlaps(self) -> bool:
        """Whether steps send their messages during backward (see ``overlap_backward``)."""
        return (
            self._overlap_backward
            and self._device.type == "cpu"
            and not self._replica.tables
            and all(type(hook).before_push is Hook.before_push for hook in self._hooks)
        )

    def _join(self, connecting: bool = False, deadline: float | None = None) -> None:
        """Join the model on the ps tasks (:func:`startup.join`); where they moved (a re-layout, or
        a stage of one, taken before or meanwhile), follow ps 0 there; all by ``deadline``
        (``time.monotonic()``; default: ``connect_timeout`` from now)."""
        deadline = time.monotonic() + self.connect_timeout if deadline is None else deadline
        while True:
            try:
                self._join_layout(deadline)
                return
            except ClusterMismatchError:
                # Started with the ps tasks of before a re-layout (flags not yet updated), or the
                # ps tasks took a stage of one meanwhile: follow ps 0.
                status = self._ps.layout_status()
                if status.cluster is None or not status.moved or not self._same_workers(status.cluster):
                    raise
                if time.monotonic() >= deadline or self._layouts.where(status) == (self._cluster, self._placement):
                    raise
            layout = self._layouts.of(status)
            log.info(
                "worker %d: the ps tasks moved to %s%s; following them",
                self._task_index,
                layout.cluster.job_tasks("ps"),
                f" (stage {status.stage.stage} of {status.stage.stages} of a re-layout)" if status.stage else "",
            )
            if not connecting:  # training: its tables, prefetches and overlap follow too
                self._switch_to(layout, pull=False)
                continue
            self._ps.close()
            self._client, self._replica, self._cluster = layout.client, layout.replica, layout.cluster
            self._placement = layout.replica.placement
            self._relayouts += layout.final

    def _same_workers(self, cluster: ClusterSpec) -> bool:
        return cluster.job_tasks("worker") == self._cluster.job_tasks("worker")

    def _join_layout(self, deadline: float) -> None:
        self._ps.async_parts = frozenset(
            slot.name for slot in self._replica.slots if slot.shard.variable in self._async_tables
        )
        self._sync = startup.join(
            self._ps,
            self._replica,
            is_chief=self._is_chief,
            optimizer=self._optimizer,
            sync=self._sync_given,
            checkpoint_dir=self.checkpoint_dir,
            deadline=deadline,
            table_optimizer=self._table_optimizer,
            global_step=self._global_step,
            resume=self._resume_relayout,
        )

    def _resume_relayout(self, sync: SyncReplicas | None) -> None:
        """The chief, connecting: finish a re-layout (or its stage) its run before had begun
        (:func:`relayout.resume`); its next stages follow at the next steps.

        Raises:
            ClusterMismatchError: the ps tasks are at another layout than this chief's: it follows them.
        """
        status = self._ps.layout_status()
        if status.moving and self._layouts.where(status) != (self._cluster, self._placement):
            stage = status.stage
            assert stage is not None
            raise ClusterMismatchError(
                f"the ps tasks are at stage {stage.stage} of {stage.stages} of a re-layout, not at this "
                f"chief's placement"
            )
        relayout.resume(relayout.Layout(self._cluster, self._ps, self._replica), self._relayout_settings(sync), status)

    def _relayout_settings(self, sync: SyncReplicas | None) -> relayout.Settings:
        return relayout.Settings(self._optimizer, self._table_optimizer, sync, self.connect_timeout)

    def close(self) -> None:
        """Tell the ps tasks this worker is done and release the channels (idempotent)."""
        if self._state is not TrainerState.RUNNING:
            self._state = TrainerState.CLOSED
            return
        failure: BaseException | None = None
        try:
            for hook in self._hooks:  # every hook ends, even if one fails
                try:
                    hook.end(self)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    failure = failure or e
        finally:
            if self._readying is not None:  # a stage readied, not cut: ps 0 keeps it asked for the next chief
                self._readying.cancel()
                self._readying = None
            if self._overlap is not None:
                self._overlap.close()
                self._overlap = None
            self._replica.tables.detach()
            if self._in_graph is not None:
                self._in_graph.close()
            try:
                self._ps.finish()
            except LayoutChangedError as e:  # the ps tasks moved since this worker's last step
                self._following(e, lambda: self._ps.finish())
            self._ps.close()
            for closing in self._closing:  # each close ends by its calls' deadlines
                closing.join(CLOSE_WAIT_SECONDS)
            self._state = TrainerState.CLOSED
        if failure is not None:
            raise failure

    def __enter__(self) -> Trainer:
        return self.connect()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, KeyboardInterrupt):  # no failure: the user stopped it, and the interrupt goes on
            log.info("worker %d interrupted; telling the ps tasks it stopped", self._task_index)
            try:
                self.close()
            except PsframeError as e:  # the ps tasks were interrupted too, as a terminal's Ctrl-C does
                log.warning("worker %d could not tell the ps tasks it stopped: %s", self._task_index, e)
            return
        if exc is not None:
            log.error("worker %d stops on %s: %s", self._task_index, type(exc).__name__, exc)
        self.close()

    # ---- training

    def step(self, loss: torch.Tensor | Sequence[torch.Tensor] | None = None) -> int:
        """One training step: backward, push gradients, pull parameters.

        A step that ends with no gradient at all (a hook such as
        ``NanGuardHook(fail_on_nan=False)`` dropped them) pushes nothing: it
        only pulls the current values, and in synchronous training it is no
        member of the round.

        Args:
            loss: a scalar loss to call ``backward()`` on; None if the caller
                already computed the gradients. With ``replica_devices``, a list
                of one loss per replica (in-graph replication: see :attr:`replicas`).

        Returns:
            The global step after this update.

        Raises:
            PsframeError: a ps task refused the gradients or could not be reached.
            TypeError: a list of losses without ``replica_devices``, or one loss with them.
        """
        self._require_running()
        if loss is not None and not isinstance(loss, torch.Tensor):
            return self._step_replicas(list(loss))
        if self._in_graph is not None and loss is not None:
            raise TypeError(
                f"this trainer drives {len(self._in_graph)} replicas (replica_devices): give step() one loss per "
                f"replica, as a list"
            )
        return self._step(loss, run_backward=True)

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """The replicas of the model this process drives: :attr:`model` first, then one per
        further device of ``replica_devices`` (in-graph replication); ``[model]`` without."""
        return list(self._in_graph.models) if self._in_graph is not None else [self._model]

    def _step_replicas(self, losses: Sequence[torch.Tensor]) -> int:
        """In-graph replication's step: every replica's backward at once; sync: their mean gradient
        pushed once; async: each replica's pushed as a step of its own. Then every replica takes the values."""
        replicas = self._in_graph
        if replicas is None:
            raise TypeError("step() takes a list of losses only with replica_devices (in-graph replication)")
        replicas.backward(losses)
        try:
            if self._sync is not None:
                replicas.average_into_first()
                return self._step(replicas.mean_loss(losses), run_backward=False)
            for i, loss in enumerate(losses):
                replicas.gradient_into_first(i)
                self._step(replicas.mean_loss([loss]), run_backward=False)
                self._ps.clear_progress()  # a batch read in ranges is recorded with the first push alone
            return self._global_step
        finally:
            replicas.share_values()
            replicas.clear_gradients()

    def _step(self, loss: torch.Tensor | None, run_backward: bool) -> int:
        for hook in self._hooks:
            hook.before_step(self)
        exchange = self._backward(loss) if run_backward else None
        for hook in self._hooks:
            hook.before_push(self, loss)
        self._replica.tables.drop_prefetched()  # rows pulled ahead for this step's lookups, not taken
        rows = None
        row_gradients: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        pushed = self._replica.has_gradients()
        if pushed:
            requests = self._replica.plan.step
            row_gradients = self._replica.tables.take_row_gradients()
            rows = self._replica.tables.cut(
                row_gradients, every_table=self._sync is not None, except_tables=self._async_tables
            )
        else:  # nothing was sent during backward either: no parameter had a gradient
            self._skipped_steps += 1
            requests = self._replica.plan.pull
            exchange = None

        def pushes() -> list[
            tuple[Request, Any]
        ]:  # the gradients each request carries (views, no copies on a CPU replica)
            return [(r, self._replica.gradients(r) if pushed else ()) for r in requests]

        prefetched: dict[int, list[torch.Tensor]]
        computed_at = self._global_step  # the step the gradients were computed at (sync: their round)
        try:
            try:
                if exchange is not None:  # some requests went during backward; the rest go now
                    self._sent_during_backward += exchange.sent_early
                    replies, prefetched = self._ps.finish_step(exchange), {}
                else:
                    replies, prefetched = self._ps.push_pull_and_prefetch(
                        pushes(),
                        self._global_step,
                        self._prefetcher.requests(),
                        rows=rows,
                        pulls_with_pushes=self._sync is None,
                    )
            except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
                replies, prefetched = self._send_again(e, pushes(), rows), {}
            except LayoutChangedError as e:
                requests, replies = self._send_to_new_layout(e, pushed, row_gradients, computed_at)
                prefetched = {}
            except DataRangeLostError as e:
                if not self._reading:
                    raise
                self._range_lost(e)
                replies, prefetched = None, {}
            if replies is not None:
                self._receive(requests, replies)
                applied = pushed and not any(reply.dropped for reply in replies)
                if applied:
                    self._pushed_steps += 1
                if self._reading:
                    self._batch_outcome = Outcome.APPLIED if applied else Outcome.AGAIN
            self._prefetcher.deliver(prefetched)
            ahead = sum(rows.shape[0] for answers in prefetched.values() for rows in answers)
            self._rows_looked_up += ahead
            self._rows_pulled += ahead
        finally:
            self._prefetcher.drop()
        self._local_step += 1
        for hook in self._hooks:
            hook.after_step(self, self._global_step, loss)
        if self._is_chief and time.monotonic() >= self._next_reshard_poll:
            self._take_asked_reshard()  # between two steps: this one's lookups and pushes are done
        return self._global_step

    # ---- a live re-layout (psframe.ps.elastic.relayout)

    def reshard(self, cluster: ClusterSpec | Mapping[str, Sequence[str]]) -> float:
        """Move the model to the ps tasks of ``cluster`` now, while training goes on (chief only).

        As a tool's ``PsClient.ask_reshard`` does from outside: ps tasks added at the end of
        the ps list (started with ``cluster``, empty) or the last ones drained (they stop).
        The parts move in stages (:mod:`psframe.cluster.moves`), each a cut of its own; the other
        workers follow each at their next step, and train between two. This call returns once
        every stage is taken (asked through ``PsClient.ask_reshard``, the chief takes one stage
        per step instead). :attr:`relayout_pauses` holds the pause of each stage.

        Returns:
            The seconds training paused, all stages together: each from its cut until the layout
            after it held the model.

        Raises:
            ClusterSpecError: the re-layout cannot be taken live (the reason says what to do instead).
        """
        self._require_running()
        if not self._is_chief:
            raise PsframeError(f"the chief (worker 0) leads a re-layout; this is worker {self._task_index}")
        new = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self._ps.ask_reshard(new)
        return self._move_to(new)

    @property
    def relayouts(self) -> int:
        """The re-layouts (ps tasks added or drained) this worker followed to the layout they end on."""
        return self._relayouts

    @property
    def relayout_pauses(self) -> tuple[float, ...]:
        """The seconds each stage of the last re-layout this chief led paused training."""
        return tuple(self._relayout_pauses)

    @property
    def relayout_parts_moved(self) -> tuple[int, ...]:
        """The parts each stage of the last re-layout this chief led moved (those of
        :attr:`relayout_pauses`): the issue's measure of a stage's pause is per part moved."""
        return tuple(self._relayout_parts)

    def _take_asked_reshard(self) -> None:
        """The chief, between two steps: the re-layout ps 0 was asked for, if any, or the next
        stage of the one under way. A stage is readied first (its tasks copy the table parts they
        take ahead, :func:`relayout.get_ready`) in a thread while this chief trains on; it is cut
        at a step once ready. Until the re-layout is done, ps 0 is asked again at every step, but
        not while a stage readies (its thread says when it is done)."""
        if self._readying is not None and not self._readying.done:
            return  # looked at again at the next step
        self._next_reshard_poll = time.monotonic() + RESHARD_POLL_SECONDS
        try:
            status = self._ps.layout_status()
        except (TaskUnavailableError, RpcTimeoutError):
            return  # asked again at the next poll; the step finds out what is wrong
        if status.moving:
            stage = status.stage
            assert stage is not None
            stage = MoveStage(stage.origin, stage.target, stage.stage + 1, stage.stages)
        elif status.cluster is not None and not status.moved and status.cluster != self._cluster:
            stage = self._layouts.plan(self._cluster, status.cluster)[0]
        else:
            return
        self._next_reshard_poll = 0.0  # again at the next step: this stage (or the next) waits
        readying = self._readying
        if readying is None or readying.stage != stage:
            if readying is not None:
                readying.cancel()
            layout = self._layouts.of_stage(stage)
            self._readying = relayout.Readying(
                stage,
                layout,
                self._cluster,
                self._relayout_settings(self._sync),
                relayout.Moves.between(self._placement, layout.replica.placement),
            )
            return
        if not readying.done:
            return
        self._readying = None
        if stage.stage == 1:
            self._relayout_pauses, self._relayout_parts = [], []
        self._take_stage(stage, readying)
        if stage.done:
            self._next_reshard_poll = time.monotonic() + RESHARD_POLL_SECONDS

    def _move_to(self, new: ClusterSpec) -> float:
        """The chief's re-layout, every stage of it; then it trains on the new layout."""
        self._relayout_pauses, self._relayout_parts = [], []
        for stage in self._layouts.plan(self._cluster, new):
            self._take_stage(stage)
        return sum(self._relayout_pauses)

    def _take_stage(self, stage: MoveStage, ready: relayout.Readying | None = None) -> None:
        """The chief's ``stage`` of a re-layout (:func:`psframe.worker.session.relayout.lead`); then it trains
        on the layout after it. Its pause counts from the cut until this chief can step again (on
        the new layout's client, made before the cut). ``ready``: the stage readied while training
        went on; None: readied here first."""
        begun = time.monotonic()
        layout = ready.result() if ready is not None else self._layouts.of_stage(stage)
        moves = ready.moves if ready is not None else relayout.Moves.between(self._placement, layout.replica.placement)
        old, before = self._ps, self._cluster
        cut_at = relayout.lead(
            old, before, layout, self._relayout_settings(self._sync), moves, stage, ready=ready is not None
        )
        # No pull: the parts moved as they were, and hold what this chief's last step was answered.
        self._switch_to(layout, pull=False, let_go=lambda: relayout.let_go(old, before, layout))
        self._stage = stage
        paused = time.monotonic() - cut_at
        self._relayout_pauses.append(paused)
        self._relayout_parts.append(moves.parts)
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
            self._global_step,
        )

    def _reroute(self, error: LayoutChangedError, pull: bool = True, deadline: float | None = None) -> None:
        """A worker refused by a ps task that moved: train on the layout ps 0 moved to
        (:func:`psframe.worker.session.relayout.follow`), and pull; by ``deadline`` (``time.monotonic()``;
        default: ``connect_timeout`` from now).

        Raises:
            ConnectTimeoutError: the new layout did not hold the model by the deadline.
        """
        log.info("worker %d: %s", self._task_index, error)
        start = time.monotonic()
        deadline = start + self.connect_timeout if deadline is None else deadline
        while True:
            layout = relayout.follow(self._ps, self._layouts.of, self._sync, max(0.1, deadline - time.monotonic()))
            try:
                self._switch_to(layout, pull)
                break
            except LayoutChangedError:  # moved again before the pull: follow on
                if time.monotonic() >= deadline:
                    raise
        log.info(
            "worker %d: follows the re-layout to ps tasks %s%s in %.3f s",
            self._task_index,
            layout.cluster.job_tasks("ps"),
            "" if layout.stage is None else f" (stage {layout.stage.stage} of {layout.stage.stages})",
            time.monotonic() - start,
        )

    def _following(self, error: LayoutChangedError, attempt: Callable[[], T], pull: bool = False) -> T:
        """Follow the ps tasks where they moved (:meth:`_reroute`), and ``attempt()`` there; again
        while they move on meanwhile (the next stage of a re-layout), for up to ``connect_timeout``."""
        deadline = time.monotonic() + self.connect_timeout  # one deadline for every reroute
        while True:
            self._reroute(error, pull, deadline)
            try:
                return attempt()
            except LayoutChangedError as again:
                if time.monotonic() >= deadline:
                    raise
                error = again

    def _switch_to(self, layout: relayout.Layout, pull: bool = True, let_go: Callable[[], None] | None = None) -> None:
        """Train on the new layout from now on: its client and placement; pull its values. The
        client of before is closed in a thread of its own: its streams and channels take
        milliseconds to close, which training need not wait for. ``let_go``: called in that
        thread first (a chief's stage: :func:`relayout.let_go`)."""
        old = self._ps

        def close_before() -> None:
            if let_go is not None:
                let_go()
            old.close()

        self._closing = [c for c in self._closing if c.is_alive()]
        self._closing.append(threading.Thread(target=close_before, name="psframe-close-layout-before", daemon=True))
        self._closing[-1].start()
        before = self._replica.tables
        state = before.step_state()  # before detaching, which starts the tables afresh
        before.detach()
        self._prefetcher.drop()  # asked of the parts before: the lookups pull anew
        client, replica = layout.client, layout.replica
        client.take_progress(self._ps)  # a step sent again there still says how far it read
        self._client, self._replica, self._cluster = client, replica, layout.cluster
        self._placement = replica.placement
        client.async_parts = frozenset(slot.name for slot in replica.slots if slot.shard.variable in self._async_tables)
        replica.tables.attach(self._pull_rows)
        replica.tables.take_over(before, state)  # once attached: attaching starts the tables afresh
        if self._overlap is not None:  # the requests sent during backward are the new layout's
            self._overlap.close()
            self._overlap = BackwardOverlap(replica.plan.step, replica.params)
        self._relayouts += layout.final
        if pull:
            self._pull_all()

    def _send_to_new_layout(
        self,
        error: LayoutChangedError,
        pushed: bool,
        row_gradients: dict[str, tuple[torch.Tensor, torch.Tensor] | None],
        computed_at: int,
    ) -> tuple[tuple[Request, ...], list[DenseReply]]:
        """A step refused by a ps task that moved (nothing of it applied before the move): follow
        the re-layout and send the step there, once, its rows cut for the new parts; again if
        the ps tasks move once more meanwhile, for up to ``connect_timeout``.

        Returns:
            The requests sent (of the new layout's plan), and their replies.
        """

        def send() -> tuple[tuple[Request, ...], list[DenseReply]]:  # on the layout followed to
            requests = self._replica.plan.step if pushed else self._replica.plan.pull
            rows = None
            if pushed:
                rows = self._replica.tables.cut(
                    row_gradients, every_table=self._sync is not None, except_tables=self._async_tables
                )
            sent = [(r, self._replica.gradients(r) if pushed else ()) for r in requests]
            return requests, self._ps.push_pull(sent, computed_at, rows=rows)

        return self._following(error, send)  # no pull first: the step sent there pulls

    def _range_lost(self, error: DataRangeLostError) -> None:
        """The step's range of data went to another worker: nothing of the step applied on the
        queue's ps task; take the current values and let read() ask for another range."""
        log.warning("worker %d: %s", self._task_index, error)
        self._batch_outcome = Outcome.LOST
        self._dropped_steps += 1
        self.pull()

    def read(self, ranges: DataRanges) -> Iterator[torch.Tensor]:
        """This worker's batches of a data set read in ranges, each example of each epoch once
        across the workers, however they join, leave or die (see :class:`psframe.DataRanges`).

        Each batch is the indices of its examples (a ``LongTensor``); train on it with one
        :meth:`step`, whose push records how far the range was consumed::

            for indices in trainer.read(psframe.DataRanges("train", len(images), batch_size=100)):
                trainer.step(F.cross_entropy(model(images[indices]), labels[indices]))
                if trainer.should_stop():
                    break

        A batch whose step was not applied (dropped as late in synchronous training, or one
        that pushed nothing) comes again. The iteration ends once every example of every
        epoch was consumed, by this worker or others.

        Raises:
            PsframeError: the batch before was not stepped on, or /job:ps/task:0 (which keeps
                the queue) holds no dense variable of the model.
            BarrierTimeoutError: the last ranges, out with other workers, were not consumed in time.
        """
        self._require_running()
        if not any(request.ps_task == 0 and request.end_of_step for request in self._replica.plan.step):
            raise PsframeError(
                "read() needs a dense variable on /job:ps/task:0, which keeps the data's queue: the step's push "
                "there carries the data consumed (place one there, e.g. Placement(variable_devices=...))"
            )
        reader = RangeReader(self._data_range, self._ps.name, ranges, 0)
        for grant in reader.leases():
            order, offset = reader.order(grant.epoch), grant.offset
            while offset < grant.end:
                stop = min(offset + ranges.batch_size, grant.end)
                self._batch_outcome = None
                self._reading = True
                self._ps.report_progress(reader.queue_task, ranges.name, grant.lease, stop)
                try:
                    yield order[offset:stop]
                finally:
                    self._reading = False
                    self._ps.clear_progress()
                outcome = self._batch_outcome
                if outcome is None:
                    raise PsframeError(
                        f"read() gives one batch per step: call trainer.step(loss) on each batch of "
                        f"{ranges.name!r} before taking the next"
                    )
                if outcome is Outcome.LOST:
                    break
                if outcome is Outcome.APPLIED:
                    offset = stop

    def _data_range(self, *asked: Any) -> RangeGrant:
        """A range to read (``PsClient.data_range``), from the layout the ps tasks are at."""
        try:
            return self._ps.data_range(*asked)
        except LayoutChangedError as e:
            return self._following(e, lambda: self._ps.data_range(*asked))

    def _backward(self, loss: torch.Tensor | None) -> Exchange | None:
        """Run backward on ``loss``; with overlap, the step's requests whose gradients are
        complete are sent while it runs, and the step's exchange is returned."""
        if loss is None:
            return None
        if self._overlap is None:
            loss.backward()
            return None
        requests = self._replica.plan.step
        exchange = self._ps.begin_step(requests, self._global_step, lambda i: self._replica.gradients(requests[i]))
        self._overlap.begin(exchange)
        try:
            loss.backward()
        finally:
            self._overlap.end()
        return exchange

    def prefetch(self, table: torch.nn.Module, ids: torch.Tensor) -> None:
        """Pull the rows a coming lookup of ``table`` will use, behind the next :meth:`step`.

        For a worker that knows its next batch before it pushes: the rows of
        ``ids`` travel with the step's own messages, read once its
        gradients are applied, and the next lookup of ``table`` with the same
        distinct ids takes them instead of waiting on a round trip of its own
        (see :mod:`psframe.worker.model.prefetch`). Any other lookup pulls as usual::

            loss = loss_fn(model(ids), labels)
            trainer.prefetch(model.embedding, next_ids)
            trainer.step(loss)
            loss = loss_fn(model(next_ids), next_labels)  # the embedding's rows are here already

        Args:
            table: an ``nn.Embedding``/``nn.EmbeddingBag`` of the model built with ``sparse=True``,
                or a :class:`psframe.DynamicEmbedding` of it (its next training lookup takes the rows).
            ids: the ids it will be called with (any shape); call once per lookup.

        Raises:
            TypeError: ``table`` is not such a table of the model.
            RowIdError: an id is not a row of the (fixed) table; nothing is sent.
        """
        self._require_running()
        self._prefetcher.add(self._replica.tables, table, ids)

    def pull(self) -> int:
        """Copy the current values of every variable into the local model, exactly
        (uncompressed, whatever the ``wire_dtype``).

        Returns:
            The global step of the values received.
        """
        self._require_running()
        try:
            self._pull_all()
        except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
            self._recover(e)  # waits for the lost ps tasks, and pulls
        except LayoutChangedError as e:
            self._reroute(e)  # pulls from the new layout
        return self._global_step

    def _pull_all(self) -> None:
        requests = self._replica.plan.pull
        replies = self._ps.push_pull([(r, ()) for r in requests], self._global_step, compress=False)
        self._receive(requests, replies)
        if self._in_graph is not None:
            self._in_graph.share_values()

    def _pull_rows(
        self, wanted: Mapping[int, Sequence[RowPull | CachedPull]], create: bool = True, staleness: int = 0
    ) -> dict[int, list[torch.Tensor | FreshRows]]:
        """Rows of embedding tables for a lookup (see :mod:`psframe.worker.model.tables`); a lost
        ps task is waited for, as in :meth:`step`, and the rows asked of it again."""
        try:
            pulled = self._ps.pull_rows(wanted, self._global_step, create, staleness)
        except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
            # A row cache stays valid: a restarted ps task's versions count past all it gave before.
            self._recover(e)
            pulled = self._ps.pull_rows(wanted, self._global_step, create, staleness)
        except LayoutChangedError as e:  # asked of the parts before a re-layout: read where they went
            before = self._replica.tables
            pulled = self._following(
                e,
                lambda: {
                    ps_task: [self._rows_moved(before, asked) for asked in pulls] for ps_task, pulls in wanted.items()
                },
                pull=True,
            )
        self._rows_looked_up += sum(int(pull[1].numel()) for pulls in wanted.values() for pull in pulls)
        self._rows_pulled += sum(_row_count(rows) for answers in pulled.values() for rows in answers)
        return pulled

    def _rows_moved(self, before: EmbeddingTables, asked: RowPull | CachedPull) -> torch.Tensor | FreshRows:
        """A lookup's pull of a part placed before a re-layout, answered from the new layout. A row
        cache is answered as if it held none of them (versions count anew on the new layout)."""
        rows = self._replica.tables.rows_moved(
            before,
            asked[0],
            asked[1],
            lambda wanted, create, staleness: self._ps.pull_rows(wanted, self._global_step, create, staleness),
        )
        return FreshRows(torch.full_like(asked[1], UNKNOWN_VERSION), rows) if isinstance(asked, CachedPull) else rows

    def _receive(self, requests: Sequence[Request], replies: Sequence[DenseReply]) -> None:
        self._replica.assign(requests, replies)
        if self._sync is None and any(r.end_of_step for r in requests):
            # How far ahead of the slowest live worker this step found this one (the most over the ps tasks).
            self._steps_ahead[max(reply.steps_ahead for r, reply in zip(requests, replies) if r.end_of_step)] += 1
        self._dropped_steps += any(reply.dropped for reply in replies)
        # Async: global_step lives on /job:ps/task:0, as in TF. Sync: every ps
        # advances in lockstep, but a reply may have been read just before a
        # shard caught up; tagging the next push with the lowest step makes a
        # gradient computed on mixed versions stale everywhere, never applied.
        # A push-only request's answer carries the step before the update: skipped.
        steps = [
            reply.global_step
            for request, reply in zip(requests, replies)
            if request.pull and (request.ps_task == 0 or self._sync is not None)
        ]
        if steps:
            self._global_step = max(steps) if self._sync is None else min(steps)

    def _send_again(
        self, error: PsframeError, pushes: list[tuple[Request, Any]], rows: dict[int, list[RowPush]] | None
    ) -> list[DenseReply]:
        """Wait for the lost ps tasks, then send this step's pushes again, with the numbers
        they had: a ps task that applied one before the stream died answers it without
        applying it twice, and none is lost (see :mod:`psframe.ps.protocol.ledger`).

        Raises:
            ConnectTimeoutError: a ps task did not come back within ``connect_timeout``.
            PsframeError: the pushes kept failing for ``connect_timeout`` seconds.
        """
        replies, _ = self._when_back(
            error,
            f"sending step {self._global_step}'s pushes again",
            lambda: self._ps.push_pull_and_prefetch(pushes, self._global_step, {}, rows=rows, again=True),
        )
        log.info(
            "worker %d: the ps tasks are back; step %d sent again (%d of its pushes had been applied before)",
            self._task_index,
            self._global_step,
            sum(reply.duplicate for reply in replies),
        )
        return replies

    def _recover(self, error: PsframeError) -> None:
        """Wait for lost ps tasks to come back (restored from a checkpoint), then pull.

        Raises:
            ConnectTimeoutError: a ps task did not come back within ``connect_timeout``.
            PsframeError: the pull kept failing for ``connect_timeout`` seconds.
        """
        self._replica.clear_gradients()
        self._when_back(error, "pulling the parameters", self._pull_all)
        log.info("worker %d: the ps tasks are back; going on at global step %d", self._task_index, self._global_step)

    def _when_back(self, error: PsframeError, then: str, attempt: Callable[[], T]) -> T:
        """Wait for the lost ps tasks (logging whom it waits for), then ``attempt()``; again
        while it fails on the way, for up to ``connect_timeout`` seconds. Counts a recovery."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            log.warning(
                "worker %d: %s; waiting up to %.0fs for the ps tasks, then %s",
                self._task_index,
                error,
                self.connect_timeout,
                then,
            )
            self._ps.reset_streams()
            # A restarted ps restores its shard from the checkpoint (or, with
            # none, takes the chief's current values); the others ignore the chief.
            self._join(deadline=deadline)
            try:
                result = attempt()
            except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise
                error = e
                continue
            self._recoveries += 1
            return result

    def save_checkpoint(self) -> checkpoint.Manifest:
        """Have every ps task save its shard, then commit the checkpoint (chief).

        Returns:
            The committed checkpoint's manifest.

        Raises:
            CheckpointError: no checkpoint_dir, or a ps task could not write.
        """
        self._require_running()
        if not self.checkpoint_dir:
            raise CheckpointError("save_checkpoint() needs Trainer(checkpointing=psframe.Checkpointing(dir))")
        try:
            manifest = checkpoint.save(self._ps, self.checkpoint_dir, self._global_step, self.keep_checkpoints)
        except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
            self._recover(e)  # a ps task was lost as it saved: wait for it, then save again
            manifest = checkpoint.save(self._ps, self.checkpoint_dir, self._global_step, self.keep_checkpoints)
        self._last_commit = manifest.step
        log.info("checkpoint of global step %d committed in %s", manifest.step, manifest.folder)
        return manifest

    @property
    def steps_ahead(self) -> dict[int, int]:
        """Asynchronous training: how many of this worker's steps found it 0, 1, 2... steps ahead of
        the slowest live worker (the most over the ps tasks; with :class:`psframe.BoundedStaleness`
        never above its bound)."""
        return dict(sorted(self._steps_ahead.items()))

    @property
    def rows_looked_up(self) -> int:
        """Rows of embedding tables this worker's lookups asked the ps tasks about (each lookup's
        distinct ids), and those its prefetches pulled ahead."""
        return self._rows_looked_up

    @property
    def rows_pulled(self) -> int:
        """Rows of embedding tables that came back to lookups and prefetches: all of them, or
        with a :class:`psframe.RowCaching`, those the cache lacked or held too old."""
        return self._rows_pulled

    @property
    def last_checkpoint_step(self) -> int | None:
        """The step of the last checkpoint (full or delta) this chief committed; None before its first."""
        return self._last_commit

    def save_delta(self) -> checkpoint.Manifest:
        """Commit a delta checkpoint: only what changed since the last checkpoint committed (chief).

        Every ps task writes the variables, table rows and optimizer state it
        changed since then, and the ids it evicted, each under its own lock
        (:mod:`psframe.checkpoint.deltas`). With no checkpoint to follow yet,
        or when a ps task cannot write a delta (it restarted since), a full
        checkpoint is saved instead.

        Returns:
            The committed checkpoint's manifest (the last one, if the global
            step has not moved since).

        Raises:
            CheckpointError: no checkpoint_dir, or a ps task could not write.
        """
        self._require_running()
        if not self.checkpoint_dir:
            raise CheckpointError("save_delta() needs Trainer(checkpointing=psframe.Checkpointing(dir))")
        parent = self._last_commit
        if parent is None:
            chain = checkpoint.latest_chain(self.checkpoint_dir)
            parent = None if chain is None else chain.step
        if parent is None:
            return self.save_checkpoint()
        if self._global_step <= parent:
            return checkpoint.read(self.checkpoint_dir, parent).last
        try:
            manifest = checkpoint.save_delta(self._ps, self.checkpoint_dir, self._global_step, parent)
        except CheckpointError as e:
            log.warning("a delta from checkpoint step %d cannot be written; saving whole: %s", parent, e)
            return self.save_checkpoint()
        except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
            self._recover(e)  # a ps task was lost as it saved: it restored, so save whole
            return self.save_checkpoint()
        self._last_commit = manifest.step
        log.info("delta of global step %d (after step %d) committed in %s", manifest.step, parent, manifest.folder)
        return manifest

    def should_stop(self) -> bool:
        """Whether a hook (or :meth:`request_stop`) asked training to end."""
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the training loop to end after this step."""
        self._stop_requested = True

    def _require_running(self) -> None:
        if self._state is not TrainerState.RUNNING:
            raise PsframeError(
                f"the trainer is {self._state.value}; use it inside `with trainer:` (or after connect())"
            )


def _row_count(answer: torch.Tensor | FreshRows) -> int:
    """The rows a pull's answer carries."""
    return int((answer.rows if isinstance(answer, FreshRows) else answer).shape[0])

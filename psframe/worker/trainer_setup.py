"""The setup of a :class:`psframe.Trainer`: its arguments resolved and checked, its parts made
and wired together, and the read-only properties that give them back.

The parts, each readable alone: the session with the ps tasks (:mod:`psframe.worker.session.session`:
the layout, surviving lost ps tasks and re-layouts, a step's push, the values received and the
global step), data read in ranges (:mod:`psframe.worker.session.data_reader`),
checkpoints (:mod:`psframe.worker.session.checkpointer`), in-graph replicas
(:mod:`psframe.worker.session.in_graph`), the counters behind ``stats``
(:mod:`psframe.worker.session.stats`) and, on the chief, the lead of re-layouts
(:mod:`psframe.worker.relayout_leader`). :class:`psframe.Trainer` (:mod:`psframe.worker.trainer`)
builds on this: the lifecycle, the step, and what callers do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from psframe.cluster import ClusterSpec
from psframe.cluster.placement import ShardPlacement
from psframe.config.liveness import Liveness
from psframe.config.options import (
    DEFAULT_KEEP_CHECKPOINTS,
    BoundedStaleness,
    Checkpointing,
    Placement,
    Transport,
)
from psframe.config.security import Security, accept_security
from psframe.optim import OptimizerSpec, SyncReplicas, SyncReplicasOptimizer
from psframe.worker.client.ps_client import resolve_wire_dtype
from psframe.worker.hooks import CheckpointSaverHook, Hook
from psframe.worker.model.overlap import BackwardOverlap
from psframe.worker.model.prefetch import Prefetcher
from psframe.worker.model.replica import Replica
from psframe.worker.model.staging import resolve_device
from psframe.worker.relayout_leader import RelayoutLeader
from psframe.worker.session.arguments import (
    option_groups,
    resolve_async_tables,
    resolve_cluster,
    resolve_optimizer,
    resolve_replica_devices,
    resolve_rpc_timeout,
    resolve_table_optimizer,
)
from psframe.worker.session.checkpointer import Checkpointer
from psframe.worker.session.data_reader import RangeFeed
from psframe.worker.session.in_graph import replicate
from psframe.worker.session.layout_maker import LayoutMaker
from psframe.worker.session.session import Session, SessionSettings
from psframe.worker.session.stats import Counters, TrainerStats

log = logging.getLogger(__name__)


class TrainerSetup:
    """A trainer's arguments, resolved and checked, its parts, made and wired, and the read-only
    properties that give them back. :class:`psframe.Trainer` is one (its docstring says what each
    argument does)."""

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
        staleness: BoundedStaleness | None = None,
        replica_devices: Sequence[str | torch.device] | None = None,
    ) -> None:
        placement, checkpointing, transport = option_groups(placement, checkpointing, transport)
        self._security = accept_security("Trainer", security)
        self._liveness = liveness or Liveness.resolve()
        cluster = resolve_cluster(cluster, task_index)
        self._task_index, self._is_chief = task_index, task_index == 0
        # As given, and resolved: again at connect, for the live workers where the ps tasks are elastic.
        self._optimizer, sync_given, sync = resolve_optimizer(optimizer, sync, cluster.num_workers)
        self._rpc_timeout = resolve_rpc_timeout(transport.rpc_timeout, sync, staleness)
        self._wire_dtype = resolve_wire_dtype(transport.wire_dtype)
        device, devices = resolve_replica_devices(device, replica_devices)
        self._device = resolve_device(model, device, gpu_memory_fraction)
        self._model = model.to(self._device)
        self._hooks = list(hooks)
        self._checkpointing, self._transport, self._overlap_backward = checkpointing, transport, overlap_backward
        if checkpointing is not None and self._is_chief:
            self._hooks.append(
                CheckpointSaverHook(*checkpointing.interval, checkpointing.delta_steps, checkpointing.delta_secs)
            )
        self._prefetcher = Prefetcher()
        self._overlap: BackwardOverlap | None = None
        maker = LayoutMaker(
            self._model,
            self._device,
            placement,
            sync=sync is not None,
            wire_dtype=self._wire_dtype,
            task_index=task_index,
            rpc_timeout=self._rpc_timeout,
            shared_memory=self.shared_memory,
            security=self._security,
            liveness=self._liveness,
            staleness=staleness,
        )
        replica = maker.replica(cluster.num_ps)
        names = replica.tables.names
        self._async_tables, sync_given, sync = resolve_async_tables(sync_given, sync, names, cluster.num_workers)
        self._replicas = replicate(
            self._model, self._device, devices, tables=bool(replica.tables), overlap_backward=overlap_backward
        )
        self._table_optimizer = resolve_table_optimizer(table_optimizer, self._optimizer, replica.tables)
        self._counters = Counters()
        settings = SessionSettings(
            task_index,
            self._is_chief,
            self._optimizer,
            self._table_optimizer,
            sync_given,
            self.checkpoint_dir,
            self._async_tables,
            transport.connect_timeout,
        )
        self._session = Session(
            maker,
            cluster,
            replica,
            settings,
            sync=sync,
            pulled=self._replicas.share_values,
            counters=self._counters,
            max_stage_bytes=placement.max_shard_bytes,
            switched=self._switched,
        )
        self._feed = RangeFeed(self._session)
        self._checkpointer = Checkpointer(self._session, checkpointing)
        self._leader = RelayoutLeader(self._session, self._counters, maker.relayout_word) if self._is_chief else None
        if self._leader is not None:  # a hook for its end; it leads between two steps (Trainer._step)
            self._hooks.append(self._leader)
        # The hooks that do something at each point of a step (a hook's no-op costs a step nothing).
        self._before_step = [h for h in self._hooks if type(h).before_step is not Hook.before_step]
        self._before_push = [h for h in self._hooks if type(h).before_push is not Hook.before_push]
        self._after_step = [h for h in self._hooks if type(h).after_step is not Hook.after_step]
        if placement.log:
            log.info("placement of worker %d:\n%s", task_index, replica.placement.describe())

    def _start_overlap(self) -> None:
        """Steps send their messages during backward from now on, where they can (see ``overlap_backward``)."""
        if (
            self._overlap_backward
            and self._device.type == "cpu"
            and not self._session.replica.tables
            and all(type(hook).before_push is Hook.before_push for hook in self._hooks)
        ):
            self._overlap = BackwardOverlap(self._session.replica.plan.step, self._session.replica.params)

    def _close_overlap(self) -> None:
        if self._overlap is not None:
            self._overlap.close()
            self._overlap = None

    def _switched(self, replica: Replica) -> None:
        """The session trains on ``replica``'s layout from now on: the parts of the step follow."""
        self._prefetcher.drop()  # asked of the parts before: the lookups pull anew
        if self._overlap is not None:  # the requests sent during backward are the new layout's
            self._overlap.close()
            self._overlap = BackwardOverlap(replica.plan.step, replica.params)

    # ---- read-only: set by the trainer, read by hooks and callers

    @property
    def global_step(self) -> int:
        """The global step of the values last received."""
        return self._session.global_step

    @property
    def stats(self) -> TrainerStats:
        """What this worker counted so far (steps taken, applied, dropped, skipped; recoveries;
        re-layouts; rows pulled), a frozen snapshot: :class:`~psframe.worker.session.stats.TrainerStats`."""
        return self._counters.snapshot(self._checkpointer.last_commit)

    @property
    def replicas(self) -> list[torch.nn.Module]:
        """The replicas of the model this process drives: :attr:`model` first, then one per
        further device of ``replica_devices`` (in-graph replication); ``[model]`` without."""
        return list(self._replicas.models)

    @property
    def model(self) -> torch.nn.Module:
        """The local model (on :attr:`device`), whose parameters mirror the ps tasks' variables."""
        return self._model

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster."""
        return self._session.cluster

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
        return self._session.sync

    @property
    def device(self) -> torch.device:
        """Where the local model computes."""
        return self._device

    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks called around each step (with the chief's checkpoint saver, if any, and its
        re-layout leader)."""
        return tuple(self._hooks)

    @property
    def placement(self) -> ShardPlacement:
        """Which ps task holds each shard (:class:`psframe.cluster.placement.ShardPlacement`)."""
        return self._session.placement

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

"""``psframe.Trainer``: trains a replica of a ``torch.nn.Module`` against the ps tasks.

Lifecycle (``with trainer:`` or :meth:`Trainer.connect` / :meth:`Trainer.close`)::

    NEW --connect()--> RUNNING --close()--> CLOSED
          chief: create the variables on the ps tasks (or adopt those there)
          others: wait until the ps tasks hold the model
          all: pull the parameters into the local model

Each :meth:`Trainer.step` runs backward, sends every ps task the gradients of
the variables it holds and receives their updated values in the same call,
to all ps tasks in parallel.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe import allocator, checkpoint
from psframe.checkpoint import files as checkpoint_io
from psframe.wire import codec
from psframe.worker.client import PsClient
from psframe.cluster import ClusterSpec
from psframe.errors import (
    CheckpointError,
    ClusterMismatchError,
    NotReadyError,
    PsframeError,
    RpcTimeoutError,
    TaskUnavailableError,
)
from psframe.worker.hooks import CheckpointSaverHook, Hook
from psframe.optim import SGD as _SGD
from psframe.optim import OptimizerSpec, SyncReplicas, SyncReplicasOptimizer
from psframe.cluster.placement import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_MIN_PARTITION_BYTES,
    Placement,
    Shard,
    VariableInfo,
    place,
)
from psframe.wire import psframe_pb2 as pb
from psframe.worker.staging import HostStaging, resolve_device

log = logging.getLogger(__name__)


class TrainerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass
class _Slot:
    """One stored variable as seen from the worker: the part of a local parameter it mirrors."""

    shard: Shard
    param: torch.nn.Parameter

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.shard.partitioned:
            return tensor
        return tensor[self.shard.row_start : self.shard.row_end]


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
        placement: ``"greedy"`` (balance bytes, the default) or ``"round_robin"``.
        variable_devices: explicit TF device strings for some parameters,
            e.g. ``{"embedding.weight": "/job:ps/task:1"}``; they win.
        soft_placement: fall back to automatic placement, with a warning, when
            an explicit device names a ps task that does not exist.
        min_partition_bytes: parameters larger than this are partitioned along
            dim 0 across the ps tasks; None never partitions for balance.
        max_shard_bytes: no stored part is larger than this (one message).
        log_placement: log where each parameter went and the bytes per ps task.
        hooks: :class:`psframe.worker.hooks.Hook` instances.
        checkpoint_dir: where checkpoints go (a folder or any fsspec URL:
            ``memory://``, ``s3://``, ``hdfs://`` where installed). The chief
            saves every ``save_checkpoint_steps`` global steps or
            ``save_checkpoint_secs`` seconds (600 s if neither is given) and at
            the end, keeping the newest ``keep_checkpoints``; a ps task that
            restarts restores its shard from the latest valid one.
        connect_timeout: seconds to wait for the ps tasks (and for the chief to
            create the model) before giving up with an error naming them.
        rpc_timeout: seconds each call may take once connected.
        wire_dtype: optional compression of what travels each step:
            ``"bfloat16"`` (or ``torch.bfloat16``) or ``"float16"``. Float32
            gradients are sent, and parameters received, in that dtype: half
            the bytes. The ps keeps and updates its variables in their own
            dtype, and the local model keeps its dtype too; only the values
            exchanged are rounded. bfloat16 keeps float32's range; float16
            keeps more mantissa but gradients below ~6e-8 become zero. None
            (the default) sends everything exactly as stored.

    Raises:
        ClusterSpecError: the cluster or task index is invalid.
        ValueError: the model has no trainable parameter.

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
        device: str | torch.device | None = None,
        gpu_memory_fraction: float | None = None,
        placement: str = "greedy",
        variable_devices: Mapping[str, str] | None = None,
        soft_placement: bool = False,
        min_partition_bytes: int | None = DEFAULT_MIN_PARTITION_BYTES,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        log_placement: bool = False,
        hooks: Iterable[Hook] = (),
        checkpoint_dir: str | None = None,
        save_checkpoint_steps: int | None = None,
        save_checkpoint_secs: float | None = None,
        keep_checkpoints: int = 5,
        connect_timeout: float = 120.0,
        rpc_timeout: float = 300.0,
        wire_dtype: str | torch.dtype | None = None,
    ) -> None:
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self.cluster.validate_task("worker", task_index)
        allocator.tune_malloc()  # gradients and replies of every step reuse freed buffers
        self.task_index = task_index
        self.is_chief = task_index == 0
        if isinstance(optimizer, SyncReplicasOptimizer):
            if sync is not None:
                raise ValueError("give either a SyncReplicasOptimizer or sync=SyncReplicas(...), not both")
            optimizer, sync = optimizer.optimizer, optimizer.sync
        self.optimizer = optimizer if optimizer is not None else _SGD(lr=0.01)
        self.sync = sync.resolve(self.cluster.num_workers) if sync is not None else None
        if self.sync is not None:
            # A call may wait at the barrier for as long as the sync timeout.
            rpc_timeout = max(rpc_timeout, self.sync.timeout + 30.0)
        if not isinstance(self.optimizer, OptimizerSpec):
            raise TypeError(
                f"optimizer must be a psframe.optim spec such as psframe.optim.SGD(lr=0.1), "
                f"got {type(self.optimizer).__name__}; the ps tasks run the torch.optim optimizer"
            )
        self.wire_dtype = _resolve_wire_dtype(wire_dtype)
        self._wire_name = codec.dtype_name(self.wire_dtype) if self.wire_dtype is not None else ""
        self.device = resolve_device(model, device, gpu_memory_fraction)
        self.model = model.to(self.device)
        self.hooks = list(hooks)
        self.checkpoint_dir = checkpoint_dir
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self.keep_checkpoints = keep_checkpoints
        if checkpoint_dir and self.is_chief:
            if save_checkpoint_steps is None and save_checkpoint_secs is None:
                save_checkpoint_secs = 600.0
            self.hooks.append(CheckpointSaverHook(save_checkpoint_steps, save_checkpoint_secs))
        self.recoveries = 0  # times this worker waited for a lost ps task and went on
        self.connect_timeout = connect_timeout
        self.rpc_timeout = rpc_timeout
        self.global_step = 0
        self.local_step = 0
        self.dropped_steps = 0  # sync: steps whose gradients came too late and were dropped
        self.state = TrainerState.NEW
        self._stop_requested = False
        self._client: PsClient | None = None

        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameter: nothing to place on the ps tasks")
        variable_devices = dict(variable_devices or {})
        unknown = sorted(set(variable_devices) - {n for n, _ in params})
        if unknown:
            raise ValueError(
                f"variable_devices names {unknown}, which are not trainable parameters of the model; "
                f"expected names from model.named_parameters()"
            )
        self.placement: Placement = place(
            [VariableInfo(n, tuple(p.shape), p.element_size(), variable_devices.get(n)) for n, p in params],
            self.cluster.num_ps,
            strategy=placement,
            min_partition_bytes=min_partition_bytes,
            soft_placement=soft_placement,
            max_shard_bytes=max_shard_bytes,
        )
        if log_placement:
            log.info("placement of worker %d:\n%s", task_index, self.placement.describe())
        by_name = dict(params)
        slots = [_Slot(shard, by_name[shard.variable]) for shard in self.placement.shards]
        self._slots = slots
        # Requests to each ps task, as groups of slots that fit one message.
        self._batches: list[tuple[int, list[_Slot]]] = []
        for ps_task in range(self.cluster.num_ps):
            mine = [s for s in slots if s.shard.ps_task == ps_task]
            for batch in _split(mine, max_shard_bytes):
                self._batches.append((ps_task, batch))
        self._staging = HostStaging(self.device)
        self._plan = self._step_plan()
        self._headers: list[pb.PushPullHeader] = []  # one per request of _plan, made in connect()
        # Whose gradients are cleared after every step (the trainable ones, once each).
        self._params = list({id(s.param): s.param for s in slots}.values())

    # ---- lifecycle

    def connect(self) -> Trainer:
        """Connect to the ps tasks, create or wait for the model, pull parameters.

        Raises:
            ConnectTimeoutError: a ps task (or the model) did not come up in time.
            ClusterMismatchError: a ps task holds another model or cluster.
        """
        if self.state is not TrainerState.NEW:
            raise PsframeError(f"the trainer is {self.state.value}; connect() is called once")
        self._client = PsClient(self.cluster, self.task_index, rpc_timeout=self.rpc_timeout)
        # Every step sends the same headers but for the step number: build them once.
        self._headers = [
            pb.PushPullHeader(caller=self._client.caller, pull=[s.shard.name for s in pull],
                              end_of_step=end_of_step, wire_dtype=self._wire_name)
            for _, _, pull, end_of_step in self._plan
        ]
        self.state = TrainerState.RUNNING
        try:
            self._client.wait_for_ps(self.connect_timeout)
            if self.is_chief:
                self._create_variables()
            infos = self._client.wait_for_ps(self.connect_timeout, ready=True)
            self._check_model(infos)
            self.pull()
            log.info("worker %d connected to %d ps tasks at global step %d",
                     self.task_index, self.cluster.num_ps, self.global_step)
            for hook in self.hooks:
                hook.begin(self)
        except BaseException:
            # Never started training: release the channels, report nothing.
            self._client.close()
            self.state = TrainerState.CLOSED
            raise
        return self

    def _create_variables(self) -> None:
        defs = {ps: [] for ps in range(self.cluster.num_ps)}
        for slot in self._slots:
            defs[slot.shard.ps_task].append(_variable_def(slot.shard, slot.param))
        optimizer = codec.optimizer_to_proto(self.optimizer)
        created = 0
        for ps_task, batch in self._batches:  # one at a time: nobody buffers the whole model
            header = pb.InitHeader(caller=self._client.caller, variables=defs[ps_task], optimizer=optimizer,
                                   sync=self._sync_def(), checkpoint_dir=self.checkpoint_dir or "")
            values = [(s.shard.name, self._staging.to_host(s.rows(s.param.detach()))) for s in batch]
            data = self._client.init([(ps_task, codec.encode(header, values))])[0]
            created += codec.decode(data, pb.InitReplyHeader)[0].created
        log.info("chief %s the model on %d ps tasks", "created" if created else "found (or restored)",
                 self.cluster.num_ps)

    def _sync_def(self) -> pb.SyncDef | None:
        if self.sync is None:
            return None
        return pb.SyncDef(replicas_to_aggregate=self.sync.replicas_to_aggregate,
                          total_num_replicas=self.sync.total_num_replicas,
                          timeout_seconds=self.sync.timeout)

    def _check_model(self, infos: list[pb.TaskInfo]) -> None:
        mine_sync = self._sync_def()
        for ps_task, info in enumerate(infos):
            theirs_sync = info.sync if info.HasField("sync") else None
            if theirs_sync != mine_sync:
                raise ClusterMismatchError(
                    f"worker {self.task_index} is set up for "
                    f"{'asynchronous updates' if mine_sync is None else str(self.sync)}, but "
                    f"{self._client.describe(ps_task)} trains "
                    f"{'asynchronously' if theirs_sync is None else 'with ' + str(theirs_sync).strip()}"
                    f" (every worker must pass the same sync settings)"
                )
            theirs = {(d.name, d.dtype, tuple(d.shape)) for d in info.variables}
            mine = {
                (s.shard.name, codec.dtype_name(s.param.dtype), s.shard.shape)
                for s in self._slots
                if s.shard.ps_task == ps_task
            }
            if mine != theirs:
                raise ClusterMismatchError(
                    f"worker {self.task_index}'s model does not match the variables on "
                    f"{self._client.describe(ps_task)}: expected {sorted(mine)[:4]}..., "
                    f"found {sorted(theirs)[:4]}... (every worker must build the same model "
                    f"with the same placement options)"
                )

    def close(self) -> None:
        """Tell the ps tasks this worker is done and release the channels (idempotent)."""
        if self.state is not TrainerState.RUNNING:
            self.state = TrainerState.CLOSED
            return
        failure: BaseException | None = None
        try:
            for hook in self.hooks:  # every hook ends, even if one fails
                try:
                    hook.end(self)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    failure = failure or e
        finally:
            self._client.finish()
            self._client.close()
            self.state = TrainerState.CLOSED
        if failure is not None:
            raise failure

    def __enter__(self) -> Trainer:
        return self.connect()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            log.error("worker %d stops on %s: %s", self.task_index, type(exc).__name__, exc)
        self.close()

    # ---- training

    def step(self, loss: torch.Tensor | None = None) -> int:
        """One training step: backward, push gradients, pull parameters.

        Args:
            loss: a scalar loss to call ``backward()`` on; None if the caller
                already computed the gradients.

        Returns:
            The global step after this update.

        Raises:
            PsframeError: a ps task refused the gradients or could not be reached.
        """
        self._require_running()
        for hook in self.hooks:
            hook.before_step(self)
        if loss is not None:
            loss.backward()
        for hook in self.hooks:
            hook.before_push(self, loss)
        requests, pulled = [], []
        for (ps_task, push, pull, _), header in zip(self._plan, self._headers):
            grads = [(s.shard.name, s.rows(s.param.grad)) for s in push if s.param.grad is not None]
            if self.sync is not None and len(grads) < len(push):
                # A synchronous step averages a gradient for every variable:
                # a parameter this replica did not use contributes zeros.
                grads = [(s.shard.name, s.rows(_grad_or_zeros(s.param))) for s in push]
            if self.wire_dtype is not None:
                grads = [(name, codec.to_wire(grad, self.wire_dtype)) for name, grad in grads]
            header.step = self.global_step
            requests.append((ps_task, codec.encode(header, self._staging.grads_to_host(grads))))
            pulled.append(pull)
        try:
            replies = self._client.push_pull(requests)
        except (TaskUnavailableError, NotReadyError, RpcTimeoutError) as e:
            self._recover(e)  # this step's gradients are lost; the parameters are fresh
        else:
            self._receive(pulled, replies)
        self.local_step += 1
        for hook in self.hooks:
            hook.after_step(self, self.global_step, loss)
        return self.global_step

    def _step_plan(self) -> list[tuple[int, list[_Slot], list[_Slot], bool]]:
        """The requests of one step: (ps task, slots to push, slots to pull, end of step).

        Async, and sync when a ps task's variables fit one message: each
        request pushes a batch and pulls it back. Sync with several messages
        to a ps task: the ps must have all of them before the step can
        complete, so all but the last only push (the ps answers at once),
        the last pushes and waits for the update, and then the rest are
        pulled; a stream never waits on a message queued behind it.
        """
        plan = []
        by_ps: dict[int, list[list[_Slot]]] = {}
        for ps_task, batch in self._batches:
            by_ps.setdefault(ps_task, []).append(batch)
        for ps_task, batches in by_ps.items():
            if self.sync is None or len(batches) == 1:
                plan += [(ps_task, b, b, i == len(batches) - 1) for i, b in enumerate(batches)]
            else:
                *first, last = batches
                plan += [(ps_task, b, [], False) for b in first]
                plan.append((ps_task, last, last, True))
                plan += [(ps_task, [], b, False) for b in first]
        return plan

    def pull(self) -> int:
        """Copy the current values of every variable into the local model.

        Returns:
            The global step of the values received.
        """
        self._require_running()
        requests = [
            (ps_task, codec.encode(pb.PushPullHeader(caller=self._client.caller, step=self.global_step,
                                                     pull=[s.shard.name for s in batch]), ()))
            for ps_task, batch in self._batches
        ]
        self._receive([batch for _, batch in self._batches], self._client.push_pull(requests))
        return self.global_step

    def _receive(self, pulled: list[list[_Slot]],
                 replies: list[tuple[pb.PushPullReplyHeader, list[torch.Tensor]]]) -> None:
        steps, dropped = [], False
        with torch.no_grad():
            for batch, (reply, tensors) in zip(pulled, replies):
                dropped |= reply.dropped
                if not batch:
                    continue  # a push-only request's answer: no values, and the step before the update
                ps_task = batch[0].shard.ps_task
                for slot, tensor in zip(batch, tensors):
                    if self._staging.cuda or slot.shard.partitioned:
                        self._staging.to_device(slot.rows(slot.param.data), tensor)
                    else:
                        # A whole CPU parameter takes the received bytes as its
                        # storage: the reply is not copied again (unless it
                        # travelled compressed: then widening is the copy).
                        slot.param.data = tensor if tensor.dtype == slot.param.dtype else tensor.to(slot.param.dtype)
                if ps_task == 0 or self.sync is not None:
                    steps.append(reply.global_step)
            for param in self._params:
                param.grad = None
        self._staging.synchronize()
        self.dropped_steps += dropped
        # Async: global_step lives on /job:ps/task:0, as in TF. Sync: every ps
        # advances in lockstep, but a reply may have been read just before a
        # shard caught up; tagging the next push with the lowest step makes a
        # gradient computed on mixed versions stale everywhere, never applied.
        if steps:
            self.global_step = max(steps) if self.sync is None else min(steps)

    def _recover(self, error: PsframeError) -> None:
        """Wait for lost ps tasks to come back (restored from a checkpoint), then pull."""
        log.warning("worker %d: %s; waiting up to %.0fs for the ps tasks to come back",
                    self.task_index, error, self.connect_timeout)
        for param in self.model.parameters():
            param.grad = None
        self._client.reset_streams()
        self._client.wait_for_ps(self.connect_timeout)
        if self.is_chief:
            # A restarted ps restores its shard from the checkpoint (or, with
            # none, takes the chief's current values); the others ignore this.
            self._create_variables()
        self._check_model(self._client.wait_for_ps(self.connect_timeout, ready=True))
        self.pull()
        self.recoveries += 1
        log.info("worker %d: the ps tasks are back; going on at global step %d",
                 self.task_index, self.global_step)

    def save_checkpoint(self) -> checkpoint_io.Manifest:
        """Have every ps task save its shard, then commit the checkpoint (chief).

        Returns:
            The committed checkpoint's manifest.

        Raises:
            CheckpointError: no checkpoint_dir, or a ps task could not write.
        """
        self._require_running()
        if not self.checkpoint_dir:
            raise CheckpointError("save_checkpoint() needs Trainer(checkpoint_dir=...)")
        manifest = checkpoint.save(self._client, self.checkpoint_dir, self.global_step, self.keep_checkpoints)
        log.info("checkpoint of global step %d committed in %s", manifest.step, manifest.folder)
        return manifest

    def should_stop(self) -> bool:
        """Whether a hook (or :meth:`request_stop`) asked training to end."""
        return self._stop_requested

    def request_stop(self) -> None:
        """Ask the training loop to end after this step."""
        self._stop_requested = True

    def _require_running(self) -> None:
        if self.state is not TrainerState.RUNNING:
            raise PsframeError(
                f"the trainer is {self.state.value}; use it inside `with trainer:` (or after connect())"
            )


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def _split(slots: list[_Slot], max_bytes: int) -> list[list[_Slot]]:
    """Group slots, in order, into batches of at most ``max_bytes`` (at least one slot each)."""
    batches: list[list[_Slot]] = []
    size = 0
    for slot in slots:
        if not batches or size + slot.shard.nbytes > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(slot)
        size += slot.shard.nbytes
    return batches


def _variable_def(shard: Shard, param: torch.Tensor) -> pb.VariableDef:
    return pb.VariableDef(
        name=shard.name,
        variable=shard.variable,
        dtype=codec.dtype_name(param.dtype),
        shape=shard.shape,
        full_shape=tuple(param.shape),
        row_start=shard.row_start,
        part_index=shard.part_index,
        num_parts=shard.num_parts,
    )


def _resolve_wire_dtype(wire_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The compression dtype asked for, or None; a clear error for anything else."""
    if wire_dtype is None or wire_dtype in ("float32", torch.float32):
        return None
    if isinstance(wire_dtype, torch.dtype) and wire_dtype in codec.WIRE_DTYPES.values():
        return wire_dtype
    if isinstance(wire_dtype, str) and wire_dtype in codec.WIRE_DTYPES:
        return codec.WIRE_DTYPES[wire_dtype]
    raise ValueError(
        f"wire_dtype must be None (send as stored), {sorted(codec.WIRE_DTYPES)} or the matching "
        f"torch dtype, got {wire_dtype!r}"
    )

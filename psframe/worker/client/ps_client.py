"""A worker's view of the ps tasks: named tensors in, named tensors out.

:class:`PsClient` is the worker side's only door to the ps tasks, in the
spirit of ps-lite's ``KVWorker`` (push, pull, wait): it takes shards and
tensors, and gives back tensors and global steps. Messages, the codec and
gRPC stay behind it (:mod:`psframe.wire`). Requests go to every ps task in
parallel; a failed call is raised as the psframe error the ps raised, or as
a named transport error. Every wait has a deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from psframe import errors
from psframe.checkpoint.manifest import ShardRecord
from psframe.cluster import ClusterSpec, parse_address
from psframe.cluster.moves import MoveStage
from psframe.config.liveness import Liveness
from psframe.config.options import BoundedStaleness
from psframe.config.security import Security
from psframe.errors import ConnectTimeoutError
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.status import TaskState, TaskStatus
from psframe.tables.rows import CachedPull, FreshRows, RowPull
from psframe.wire import codec, messages, row_tensors, same_host, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client import streams
from psframe.worker.client.operations import (
    DenseReply,
    Operation,
    PullRows,
    PushPull,
    PushRows,
    Reply,
    RowsPulled,
    RowsPushed,
)
from psframe.worker.client.streams import PushPullStreams
from psframe.worker.plan.step_plan import Request, Slot

ReplyT = TypeVar("ReplyT", DenseReply, RowsPulled)

log = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 5.0


class PsClient:
    """Channels from one worker (or a tool such as ``psframe status``) to every ps task.

    Args:
        cluster: the cluster.
        task_index: the worker's index.
        rpc_timeout: deadline in seconds of each call once connected.
        job_name: ``"worker"``, or ``"tool"`` for a command that only asks
            and stops (``psframe status``, ``psframe shutdown``).
        wire_dtype: compress floating-point tensors to this dtype on the
            wire (``torch.bfloat16`` or ``torch.float16``); None sends them as they are.
        shared_memory: move the tensors of PushPull requests to a ps task
            on this host through shared memory (:mod:`psframe.wire.same_host`);
            gRPC carries the headers. Tasks on other hosts refuse, and get messages.
        security: the auth token every call carries, and TLS (default: none;
            :meth:`psframe.config.security.Security.resolve` reads them from flags and the environment).
        liveness: how the channels probe their connections (see :mod:`psframe.config.liveness`);
            default: :meth:`Liveness.resolve`.
        staleness: the bound every step-ending push carries (:class:`psframe.BoundedStaleness`); None: none.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        task_index: int,
        *,
        rpc_timeout: float = 300.0,
        job_name: str = "worker",
        wire_dtype: torch.dtype | None = None,
        shared_memory: bool = False,
        security: Security | None = None,
        liveness: Liveness | None = None,
        staleness: BoundedStaleness | None = None,
    ) -> None:
        if job_name == "worker":
            cluster.validate_task("worker", task_index)
        elif job_name != "tool":
            raise ValueError(
                f"job_name must be 'worker' or 'tool' (a command such as psframe shutdown), got {job_name!r}"
            )
        self.cluster = cluster
        self.task_index = task_index
        self.name = ClusterSpec.caller_name(job_name, task_index)
        self.rpc_timeout = rpc_timeout
        self.wire_dtype = wire_dtype
        self.caller = pb.Caller(
            job_name=job_name,
            task_index=task_index,
            cluster_fingerprint=cluster.fingerprint,
            ps_fingerprint=cluster.ps_fingerprint,
        )
        self._ps = [
            transport.Connection(address, f"{ClusterSpec.task_name('ps', k)} at {address}", security, liveness)
            for k, address in enumerate(cluster.job_tasks("ps"))
        ]
        # The tasks on this host may take shared regions until one says it cannot map them.
        share = shared_memory and same_host.available()
        self._streams = PushPullStreams(self._ps, self.caller, wire_dtype, share_with=share, staleness=staleness)
        # Synchronous training: parts of tables whose rows are applied at once (SyncReplicas.async_tables).
        self.async_parts: frozenset[str] = frozenset()

    @property
    def num_ps(self) -> int:
        return len(self._ps)

    def describe(self, ps_task: int) -> str:
        """``"/job:ps/task:K at host:port"``."""
        return self._ps[ps_task].peer

    # ---- waiting for peers

    def wait_for_ps(
        self, timeout: float, *, ready: bool = False, tasks: Sequence[int] | None = None, poll: float = 0.1
    ) -> list[TaskStatus]:
        """Wait until every ps task (or those of ``tasks``) answers (and, with ``ready``, holds the model).

        Asks again every ``poll`` seconds; logs whom it waits for every few seconds.

        Returns:
            Each ps task's (of ``tasks``) :class:`~psframe.status.TaskStatus`, by task index.

        Raises:
            ConnectTimeoutError: naming the tasks still missing after ``timeout``.
            ClusterMismatchError: a ps task was started with another cluster.
            TrainingFinishedError: a ps task has seen every worker finish.
        """
        start = time.monotonic()
        deadline = start + timeout
        next_log = start  # say at once whom we wait for, then every few seconds
        infos: dict[int, TaskStatus] = {}
        pending = list(range(self.num_ps)) if tasks is None else list(tasks)
        # A worker asks to take part (an elastic ps task counts it, even after it had left).
        request = pb.InfoRequest(caller=self.caller, joining=self.caller.job_name == "worker")
        while True:
            asked = list(pending)
            timeout_each = max(0.1, min(2.0, deadline - time.monotonic()))
            replies = transport.call_each([(self._ps[k], "GetInfo", request) for k in asked], timeout_each)
            for k, (reply, error) in zip(asked, replies):
                if isinstance(error, (errors.TaskUnavailableError, errors.RpcTimeoutError)):
                    continue
                if error is not None:
                    raise error
                info = messages.task_status(reply)
                messages.check_identity(info, self.cluster, "ps", k, self._ps[k].address)
                if self.caller.job_name == "worker":  # number pushes above those the task applied already
                    last = next((w.last_push_id for w in info.workers if w.task_index == self.task_index), 0)
                    self._streams.numbers.start_after(k, last)
                if info.state is TaskState.FINISHED:
                    raise errors.TrainingFinishedError(
                        f"{self.describe(k)} has seen every worker finish; training is over"
                    )
                if ready and info.state is not TaskState.READY:
                    continue
                infos[k] = info
                pending.remove(k)
            if not pending:
                if 0 in infos:  # a push carries the layout the ps tasks are at: one of a layout before is refused
                    self.caller.layout_version = infos[0].layout_version
                return [infos[k] for k in sorted(infos)]
            now = time.monotonic()
            what = "hold the model (the chief creates it)" if ready else "come up"
            missing = ", ".join(self.describe(k) for k in pending)
            if now >= deadline:
                raise ConnectTimeoutError(
                    f"{self.name} waited {now - start:.1f}s for {missing} to {what}; {_what_to_check(ready, pending)}"
                )
            if now >= next_log:
                log.info("%s waiting for %s to %s (%.0fs of %.0fs)", self.name, missing, what, now - start, timeout)
                next_log = now + LOG_EVERY_SECONDS
            time.sleep(min(poll, max(0.0, deadline - now)))

    def get_info(self, ps_task: int) -> TaskStatus:
        """One ps task's :class:`~psframe.status.TaskStatus` (who it is, what it holds, its counters)."""
        info = self._ps[ps_task].call("GetInfo", pb.InfoRequest(caller=self.caller), timeout=self.rpc_timeout)
        return messages.task_status(info)

    # ---- the model

    def create(
        self,
        ps_task: int,
        slots: Sequence[Slot],
        values: Sequence[tuple[str, torch.Tensor]],
        optimizer: OptimizerSpec,
        sync: SyncReplicas | None,
        checkpoint_dir: str | None,
        *,
        rows: Sequence[row_tensors.RowPush] = (),
        table_optimizer: OptimizerSpec | None = None,
        global_step: int = 0,
    ) -> bool:
        """Ask a ps task to create its variables (chief only), with some of their initial values.

        ``slots`` are every variable the ps task holds; ``values`` (CPU
        tensors, by shard name) may be a part of them, and ``rows`` some
        rows of its embedding tables' parts, as ``(part, ids, rows)``: the
        ps creates the variables once it has them all, so a large model
        travels in several calls. A ps task that holds the model already
        (or restores it from ``checkpoint_dir``) keeps what it has.
        ``table_optimizer`` updates the tables (needed if there are any).
        ``global_step``: the chief's (0 at the start of a job); a ps task that
        lost its variables and has no checkpoint goes on from it.

        Returns:
            True if this call created the variables.
        """
        header = pb.InitHeader(
            caller=self.caller,
            variables=messages.variable_defs(slots),
            optimizer=messages.optimizer_to_proto(optimizer),
            sync=messages.sync_def(sync),
            checkpoint_dir=checkpoint_dir or "",
            global_step=global_step,
        )
        if table_optimizer is not None:
            header.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
        pushed_rows, row_kinds = row_tensors.push_tensors(rows)
        tensors = list(values) + pushed_rows
        data = self._ps[ps_task].call(
            "Init",
            codec.encode(header, tensors, [row_tensors.VALUE] * len(values) + row_kinds),
            timeout=self.rpc_timeout,
        )
        return codec.decode(data, pb.InitReplyHeader)[0].created

    def check_model(self, infos: Sequence[TaskStatus], slots: Sequence[Slot], sync: SyncReplicas | None) -> None:
        """Check that every ps task holds exactly these variables, trained with these sync settings.

        Raises:
            ClusterMismatchError: naming the ps task and the first differences.
        """
        for ps_task, info in enumerate(infos):
            where = f"the model of {self.name} does not match {self.describe(ps_task)}"
            messages.check_same_sync(where, messages.sync_def(sync), messages.sync_def(info.sync))
            mine = messages.variable_defs(s for s in slots if s.shard.ps_task == ps_task)
            messages.check_same_variables(where, messages.keys_of_defs(mine), [v.key for v in info.variables])

    # ---- a step

    def push_pull(
        self,
        requests: Sequence[tuple[Request, Sequence[tuple[str, torch.Tensor]]]],
        step: int,
        *,
        compress: bool = True,
        timeout: float | None = None,
        rows: Mapping[int, Sequence[row_tensors.RowPush]] | None = None,
    ) -> list[DenseReply]:
        """Send planned requests, each with its gradients, and wait for every reply.

        Each ps task is reached over one long-lived stream, with a few
        requests in flight (:mod:`psframe.worker.client.streams`).

        Args:
            requests: ``(request, gradients)`` pairs; gradients are CPU
                tensors by shard name (compressed here when ``wire_dtype`` is set).
            step: the global step the gradients were computed at.
            compress: let tensors travel in ``wire_dtype`` (when set); False
                moves them exactly as stored (a full pull of the ps's values).
            rows: per ps task, the gradients of embedding table rows as
                ``(table part, ids, rows)``; each ps task gets them in one
                message ahead of its requests (ending the step where it has
                no request).

        Returns:
            The replies, in the order of ``requests``.

        Raises:
            PsframeError: the error a ps task raised, or a transport error
                naming the task; RpcTimeoutError after ``timeout`` seconds.
        """
        return self._push_pull(requests, step, compress, timeout, rows, {})[0]

    def push_pull_and_prefetch(
        self,
        requests: Sequence[tuple[Request, Sequence[tuple[str, torch.Tensor]]]],
        step: int,
        prefetch: Mapping[int, Sequence[row_tensors.RowPull]],
        *,
        rows: Mapping[int, Sequence[row_tensors.RowPush]] | None = None,
        again: bool = False,
        pulls_with_pushes: bool = False,
    ) -> tuple[list[DenseReply], dict[int, list[torch.Tensor]]]:
        """:meth:`push_pull`, then rows of embedding tables read behind the step's messages.

        Each ps task in ``prefetch`` is asked for the ``(table part, ids)`` pairs
        listed for it after this step's pushes: with ``pulls_with_pushes``
        (asynchronous training) in the message that ends the step there, read
        once its pushes are applied; otherwise in one more message on its
        stream after the step's, which a ps task answers in order, once the
        step's gradients are applied (in synchronous training, once its round
        is). Either way the pull travels while the task works instead of in a
        round trip of its own.

        Returns:
            The replies to ``requests``, in order; per ps task, the rows of each
            of its pairs, in order (read-only views of the reply).

        ``again``: these are the pushes of the last call, which failed on the
        way (a ps task was lost), sent again with the numbers they had: a ps
        task answers those it applied then without applying them twice
        (:mod:`psframe.ps.protocol.ledger`).
        """
        return self._push_pull(requests, step, True, None, rows, prefetch, again, pulls_with_pushes)

    def _push_pull(
        self,
        requests: Sequence[tuple[Request, Sequence[tuple[str, torch.Tensor]]]],
        step: int,
        compress: bool,
        timeout: float | None,
        rows: Mapping[int, Sequence[row_tensors.RowPush]] | None,
        prefetch: Mapping[int, Sequence[row_tensors.RowPull]],
        again: bool = False,
        pulls_with_pushes: bool = False,
    ) -> tuple[list[DenseReply], dict[int, list[torch.Tensor]]]:
        # Each ps task gets its rows' gradients in the planned request that ends its step,
        # or, where none does (a ps task of tables only), in a message of their own ahead
        # of any planned request, that ends the step. The pulls go with the message that
        # ends the step (pulls_with_pushes: asynchronous training; a synchronous one
        # answers once its round is applied, and the pulls follow in a message of their own).
        rows = rows or {}
        # Rows of tables applied at once (synchronous training's async tables) go first, alone.
        rows_now = [
            PushRows(ps_task, now, False, rows_async=True)
            for ps_task, pushes in (rows.items() if self.async_parts else ())
            if (now := [push for push in pushes if push[0] in self.async_parts])
        ]
        if rows_now:
            rows = {
                ps_task: kept
                for ps_task, pushes in rows.items()
                if (kept := [push for push in pushes if push[0] not in self.async_parts])
            }
        pending = dict(prefetch)
        ending = {request.ps_task: i for i, (request, _) in enumerate(requests) if request.end_of_step}

        def pulls_of(ps_task: int) -> Sequence[row_tensors.RowPull]:
            return pending.pop(ps_task, ()) if pulls_with_pushes else ()

        pushed_rows = [
            PushRows(ps_task, pushes, True, pulls_of(ps_task))
            for ps_task, pushes in rows.items()
            if ps_task not in ending
        ]
        planned = [
            PushPull(request, grads, rows.get(request.ps_task, ()), pulls_of(request.ps_task))
            if ending.get(request.ps_task) == i
            else PushPull(request, grads)
            for i, (request, grads) in enumerate(requests)
        ]
        pulls = [PullRows(ps_task, wanted) for ps_task, wanted in pending.items()]
        replies = self._exchange([*rows_now, *pushed_rows, *planned, *pulls], step, compress, timeout, again)
        replies = replies[len(rows_now) :]
        dense = [_expect(reply, DenseReply) for reply in replies[len(pushed_rows) : len(pushed_rows) + len(planned)]]
        pulled: dict[int, list[torch.Tensor]] = {}
        carriers: list[PushRows | PushPull] = [*pushed_rows, *planned]
        for operation, reply in zip(carriers, replies):
            if operation.row_pulls and isinstance(reply, (RowsPushed, DenseReply)):
                pulled[operation.ps_task] = reply.rows
        for pull, reply in zip(pulls, replies[len(pushed_rows) + len(planned) :]):
            if isinstance(reply, RowsPulled):
                pulled[pull.ps_task] = cast(list[torch.Tensor], reply.rows)  # pulls without a row cache: tensors only
        return dense, pulled

    def begin_step(
        self, requests: Sequence[Request], step: int, grads_of: Callable[[int], Sequence[tuple[str, torch.Tensor]]]
    ) -> streams.Exchange:
        """A step whose planned ``requests`` are sent as their gradients become ready.

        For overlapping the step's messages with backward (:mod:`psframe.worker.model.overlap`):
        :meth:`~psframe.worker.client.streams.Exchange.send_ready` sends request ``i`` (its
        gradients from ``grads_of(i)``) while backward still runs, and
        :meth:`~psframe.worker.client.streams.Exchange.finish` sends the rest and gives the
        replies, as :meth:`push_pull` would. Every request that pushes takes a push
        number now; sent again after a failure (:meth:`push_pull_and_prefetch` with
        ``again``), the same pushes keep them.
        """
        operations = [PushPull(request) for request in requests]
        push_ids = self._streams.numbers.assign(_targets(operations))
        return self._streams.begin(operations, grads_of, step, self.wire_dtype is not None, self.rpc_timeout, push_ids)

    def finish_step(self, exchange: streams.Exchange) -> list[DenseReply]:
        """Send what :meth:`begin_step`'s ``exchange`` has left and wait for every reply.

        Returns:
            The replies, in the order of the step's requests.

        Raises:
            PsframeError: as :meth:`push_pull`.
        """
        return [_expect(reply, DenseReply) for reply in exchange.finish()]

    def pull_rows(
        self,
        wanted: Mapping[int, Sequence[RowPull | CachedPull]],
        step: int,
        create: bool = True,
        staleness: int = 0,
    ) -> dict[int, list[torch.Tensor | FreshRows]]:
        r"""The current values of some rows of embedding tables, from every ps task asked, in parallel.

        Args:
            wanted: per ps task, ``(table part, ids)`` pairs (int64 ids of rows of the part),
                or :class:`~psframe.tables.rows.CachedPull`\ s naming the versions a row cache holds.
            step: the worker's global step (for the ps task's records).
            create: dynamic tables make the rows of ids they do not hold (else
                they answer those ids' initial rows and keep nothing).
            staleness: how many versions a cached row may lag behind before it is sent again.

        Returns:
            Per ps task, the rows of each pair, in order (read-only views of the reply);
            for a cached pull, its :class:`~psframe.tables.rows.FreshRows`.

        Raises:
            PsframeError: the error a ps task raised (e.g. ``RowIdError``), or a transport error.
        """
        pulls = [PullRows(ps_task, pairs, create, staleness) for ps_task, pairs in wanted.items()]
        replies = self._exchange(pulls, step, False, self.rpc_timeout)
        return {pull.ps_task: _expect(reply, RowsPulled).rows for pull, reply in zip(pulls, replies)}

    def _exchange(
        self,
        operations: Sequence[Operation],
        step: int,
        compress: bool,
        timeout: float | None,
        again: bool = False,
    ) -> list[Reply | None]:
        """Send ``operations``, every push numbered in the order it is sent to its ps task
        (``again``: the pushes of the last step that pushed, with the numbers they had)."""
        push_ids = self._streams.numbers.assign(_targets(operations), again)
        return self._streams.exchange(
            operations, step, compress and self.wire_dtype is not None, timeout or self.rpc_timeout, push_ids
        )

    def reset_streams(self) -> None:
        """Forget the PushPull streams (after a ps task went away); new ones open on next use,
        and shared regions are offered anew."""
        self._streams.reset()

    # ---- checkpoints and the end

    def save(self, checkpoint_dir: str, step: int, parent: int | None = None) -> list[ShardRecord]:
        """Ask every ps task to write its shard of checkpoint ``step``, in parallel: what
        it holds, or only what changed since checkpoint ``parent`` (a delta).

        The shards are of one cut. In asynchronous training each holds the
        same steps of every worker (a step some ps task had begun applying is
        applied by all first; the steps after wait, at most a few seconds); in
        synchronous training, the same rounds (a round some ps task had applied
        is applied by all first; the rounds after wait).

        Returns:
            What each ps task wrote, by task index.
        """
        requests = self._cut_requests(
            checkpoint_dir=checkpoint_dir, step=step, delta=parent is not None, parent_step=parent or 0
        )
        try:
            replies = transport.call_all(
                [(ps, "Save", request) for ps, request in zip(self._ps, requests)], self.rpc_timeout
            )
        except errors.CheckpointCutError as e:  # a worker lost mid-step, say: better a checkpoint than none
            log.warning("%s: checkpoint step %d is saved without one cut across the ps tasks: %s", self.name, step, e)
            for request in requests:
                del request.targets[:]
                request.cut_rounds = False
            replies = transport.call_all(
                [(ps, "Save", request) for ps, request in zip(self._ps, requests)], self.rpc_timeout
            )
        return [
            ShardRecord(ps_task=k, file=r.file, sha256=r.sha256, nbytes=r.nbytes, global_step=r.global_step)
            for k, r in enumerate(replies)
        ]

    def _cut_requests(self, move_to: str = "", **fields: object) -> list[pb.SaveRequest]:
        """Hold every ps task at one cut; the ``Save`` requests (with ``fields``) that take it, by task.

        Every ps task holds pushes back and says how many steps of each worker it has
        begun; each then applies the steps another had begun, and takes its part.
        ``move_to``: the cut of a re-layout to that cluster (no other cut may begin meanwhile).
        """
        hold = pb.SaveRequest(caller=self.caller, hold=True, hold_seconds=min(self.rpc_timeout, 10.0), move_to=move_to)
        holds = transport.call_all([(ps, "Save", hold) for ps in self._ps], self.rpc_timeout)
        begun = [list(r.steps_begun) for r in holds if r.holds]
        targets = [max(steps) for steps in zip(*begun)] if begun else []
        # Synchronous: the ps tasks are at most one round apart; the cut is at the latest.
        round_target = max((r.global_step for r in holds if r.holds_rounds), default=0)
        return [
            pb.SaveRequest(
                caller=self.caller,
                targets=targets if r.holds else [],
                round_target=round_target if r.holds_rounds else 0,
                cut_rounds=r.holds_rounds,
                move_to=move_to,
                **fields,  # type: ignore[arg-type]
            )
            for r in holds
        ]

    # ---- a live re-layout (psframe.ps.elastic.relayout)

    def layout_status(self) -> LayoutStatus:
        """Where ps 0 stands with re-layouts: asked for, or taken (and at which stage)."""
        reply = self._ps[0].call("Reshard", pb.ReshardRequest(caller=self.caller), timeout=self.rpc_timeout)
        stage = None
        if reply.moved and reply.HasField("stage"):
            s = reply.stage
            stage = MoveStage(s.origin_spec, s.target_spec, s.stage, s.stages)
        return LayoutStatus(
            ClusterSpec.from_string(reply.cluster_spec) if reply.cluster_spec else None,
            reply.moved,
            stage,
            ClusterSpec.from_string(reply.before_spec) if reply.moved and reply.before_spec else None,
        )

    def ask_reshard(self, new: ClusterSpec) -> None:
        """Ask ps 0 for a re-layout to ``new`` (from a tool); the chief takes it between two steps.

        Raises:
            ClusterSpecError: ``new`` cannot be taken live (the reason says what to do instead).
        """
        self._ps[0].call(
            "Reshard", pb.ReshardRequest(caller=self.caller, cluster_spec=new.to_string()), timeout=self.rpc_timeout
        )

    def move(self, new: ClusterSpec, stage: MoveStage | None = None) -> CutTaken:
        """The chief's first part of a re-layout (or of its ``stage``): every ps task takes one cut,
        snapshots its parts into memory and moves to ``new`` (workers of the layout before are
        refused from then on). Returns ps 0's reply: the layout version and the workers that had
        finished, which the tasks of the new layout are told.

        A cut lost to a worker that died in the middle of a step (CheckpointCutError) is taken
        again without the steps it waited for, as a checkpoint is: that step may be applied on
        some parts and not on others.
        """
        staged = (
            {}
            if stage is None
            else {
                "move_stage": pb.MoveStage(
                    origin_spec=stage.origin, target_spec=stage.target, stage=stage.stage, stages=stage.stages
                )
            }
        )
        requests = self._cut_requests(move_to=new.to_string(), **staged)
        try:
            replies = transport.call_all([(ps, "Save", r) for ps, r in zip(self._ps, requests)], self.rpc_timeout)
        except errors.CheckpointCutError as e:
            log.warning("%s: the re-layout's cut is taken without waiting for a lost worker's step: %s", self.name, e)
            for request in requests:
                del request.targets[:]
                request.cut_rounds = False
            replies = transport.call_all([(ps, "Save", r) for ps, r in zip(self._ps, requests)], self.rpc_timeout)
        first = replies[0]
        ledger = (
            (tuple(first.ledger.last_push), tuple(first.ledger.applied_steps)) if first.HasField("ledger") else None
        )
        return CutTaken(first.layout_version, tuple(first.finished_workers), ledger)

    def adopt(
        self,
        slots: Sequence[Slot],
        optimizer: OptimizerSpec,
        table_optimizer: OptimizerSpec | None,
        sync: SyncReplicas | None,
        adopt_from: Sequence[str],
        layout_version: int,
        finished_workers: Sequence[int] = (),
        sources: Sequence[Sequence[int]] | None = None,
        ledger: tuple[Sequence[int], Sequence[int]] | None = None,
    ) -> bool:
        """The chief's second part of a re-layout: every ps task of this (new) cluster takes the
        parts placed on it from the snapshots of the tasks before (``adopt_from``), in parallel;
        ps task ``k`` from tasks ``sources[k]`` only (:func:`psframe.cluster.moves.sources`), or all.
        ``ledger``: ps 0's pushes applied at the cut (:class:`CutTaken`), which every task takes;
        None: each reads it from ps 0's snapshot (then ps 0 must be among ``sources[k]``).

        Returns:
            Whether every task now holds the model (then it holds these variables, and this
            client numbers its pushes from the replies: no :meth:`wait_for_ps` needed).
        """
        self.caller.layout_version = layout_version  # the tasks kept refuse a caller of the layout before
        calls = []
        for k, ps in enumerate(self._ps):
            header = pb.InitHeader(
                caller=self.caller,
                variables=messages.variable_defs(s for s in slots if s.shard.ps_task == k),
                optimizer=messages.optimizer_to_proto(optimizer),
                sync=messages.sync_def(sync),
                adopt_from=adopt_from,
                layout_version=layout_version,
                finished_workers=finished_workers,
                adopt_tasks=() if sources is None else sources[k],
            )
            if table_optimizer is not None:
                header.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
            if ledger is not None:
                header.ledger.CopyFrom(pb.PushLedger(last_push=ledger[0], applied_steps=ledger[1]))
            calls.append((ps, "Init", codec.encode(header, ())))
        replies = [codec.decode(r, pb.InitReplyHeader)[0] for r in transport.call_all(calls, self.rpc_timeout)]
        if any(r.state != pb.TaskInfo.READY for r in replies):
            return False
        for k, reply in enumerate(replies):  # as wait_for_ps would: above the pushes each task applied
            self._streams.numbers.start_after(k, reply.last_push_id)
        self.caller.layout_version = replies[0].layout_version
        return True

    def copy_ahead(
        self,
        slots: Sequence[Slot],
        optimizer: OptimizerSpec,
        table_optimizer: OptimizerSpec | None,
        adopt_from: Sequence[str],
        sources: Sequence[Sequence[int]] | None = None,
        parts: Sequence[str] = (),
    ) -> None:
        """Before a re-layout stage's cut, while training goes on: every ps task of this (the
        next) layout makes its optimizers ready and copies the fixed table parts it takes at the
        cut (``parts``, those of them it holds next) from the tasks before (``adopt_from``;
        ``sources``: as :meth:`adopt`), in parallel; at the cut only their rows changed since
        cross (:mod:`psframe.ps.elastic.precopy`)."""
        copied = set(parts)
        calls = []
        for k, ps in enumerate(self._ps):
            held = [s for s in slots if s.shard.ps_task == k]
            precopy = pb.Precopy(
                variables=messages.variable_defs(held),
                parts=[s.name for s in held if s.name in copied],
                adopt_from=adopt_from,
                adopt_tasks=() if sources is None else sources[k],
                optimizer=messages.optimizer_to_proto(optimizer),
                cluster_spec=self.cluster.to_string(),
            )
            if table_optimizer is not None:
                precopy.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
            calls.append((ps, "Reshard", pb.ReshardRequest(caller=self.caller, precopy=precopy)))
        transport.call_all(calls, self.rpc_timeout)

    def reshard_done(self) -> None:
        """Tell the ps tasks the new layout holds the model: their snapshots may go."""
        request = pb.ReshardRequest(caller=self.caller, done=True)
        transport.call_all([(ps, "Reshard", request) for ps in self._ps], self.rpc_timeout)

    # ---- data read in ranges

    def data_range(self, ps_task: int, name: str, num_examples: int, range_size: int, epochs: int) -> RangeGrant:
        """A range of data set ``name`` to train on, from the ps task that keeps its queue
        (:mod:`psframe.ps.protocol.data_ranges`): a lease, or none yet (``retry_after``), or ``exhausted``."""
        request = pb.DataRangeRequest(
            caller=self.caller, name=name, num_examples=num_examples, range_size=range_size, epochs=epochs
        )
        reply = self._ps[ps_task].call("DataRange", request, timeout=self.rpc_timeout)
        return RangeGrant(
            reply.lease,
            reply.epoch,
            reply.start,
            reply.end,
            reply.offset,
            reply.exhausted,
            reply.retry_after,
            reply.consumed,
            reply.total,
        )

    def report_progress(self, ps_task: int, name: str, lease: int, offset: int) -> None:
        """Carry, in the next step's step-ending push to ``ps_task``, that the step consumed data set
        ``name``'s range ``lease`` up to ``offset`` (recorded with the push, applied once)."""
        self._streams.encoder.progress = (ps_task, pb.DataProgress(name=name, lease=lease, offset=offset))

    def take_progress(self, other: PsClient) -> None:
        """Carry the data progress ``other`` was to send (a client of the layout before a re-layout)."""
        self._streams.encoder.progress = other._streams.encoder.progress

    def clear_progress(self) -> None:
        """Steps carry no data progress from now on (until :meth:`report_progress`)."""
        self._streams.encoder.progress = None

    def shutdown(self, ps_task: int) -> None:
        """Ask a ps task to stop serving (it exits 0)."""
        self._ps[ps_task].call("Shutdown", pb.ShutdownRequest(caller=self.caller), timeout=min(self.rpc_timeout, 30.0))

    def finish(self) -> None:
        """Tell every ps task this worker is done; a ps that is gone is only logged."""
        request = pb.FinishRequest(caller=self.caller)
        for ps in self._ps:
            try:
                ps.call("Finish", request, timeout=min(self.rpc_timeout, 30.0))
            except (errors.TaskUnavailableError, errors.RpcTimeoutError) as e:
                log.warning("%s could not report that it finished: %s", self.name, e)

    def close(self) -> None:
        self._streams.close()
        for ps in self._ps:
            ps.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class CutTaken:
    """What ps 0 answers a re-layout's cut: what the tasks of the new layout are told with their parts."""

    layout_version: int  # the re-layouts gone through, this one counted
    finished_workers: tuple[int, ...]  # the workers that had finished before
    # ps 0's pushes applied at the cut, by worker: each one's last push and steps applied (None: unsaid)
    ledger: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class LayoutStatus:
    """What ps 0 says of re-layouts: the one asked for, or the layout taken, and its stage."""

    cluster: ClusterSpec | None  # asked for (not yet taken), or the cluster of the layout taken; None: none
    moved: bool  # a layout was taken (``cluster`` is where the ps tasks are)
    stage: MoveStage | None = None  # taken: the stage of the re-layout it is at; None: a layout of one stage
    before: ClusterSpec | None = None  # taken: the cluster of the layout it moved from (the last stage's)

    @property
    def moving(self) -> bool:
        """Whether a staged re-layout is under way: taken, its last stage not yet."""
        return self.moved and self.stage is not None and not self.stage.done


@dataclass(frozen=True)
class RangeGrant:
    """A ps task's answer to a worker asking for a range of a data set (``lease`` 0: none now)."""

    lease: int
    epoch: int
    start: int
    end: int
    offset: int  # consumed up to here: train from it
    exhausted: bool  # every example of every epoch consumed
    retry_after: float  # every range left is out with live workers: ask again after this many seconds
    consumed: int
    total: int


def _what_to_check(ready: bool, pending: Sequence[int]) -> str:
    """What to do about ps tasks that did not come up (or hold no model) in time, for the error."""
    if ready:
        return f"is the chief, {ClusterSpec.task_name('worker', 0)}, running? (raise connect_timeout to wait longer)"
    if len(pending) == 1:
        return "is it started, and is the address right? (raise connect_timeout to wait longer)"
    return "are they started, and are the addresses right? (raise connect_timeout to wait longer)"


def _targets(operations: Iterable[Operation]) -> list[int | None]:
    """Per operation, the ps task it pushes to, or None if it pushes nothing (for push numbers)."""
    return [operation.ps_task if operation.pushes else None for operation in operations]


def _expect(reply: Reply | None, kind: type[ReplyT]) -> ReplyT:
    """``reply``, which answers an operation whose reply is of type ``kind``."""
    if not isinstance(reply, kind):
        raise errors.WireFormatError(f"expected a {kind.__name__} reply, got {reply!r}")
    return reply


def ping(target: str, timeout: float = 5.0, security: Security | None = None) -> TaskStatus:
    """Ask the task at ``target`` (``grpc://host:port`` or ``host:port``) who it is.

    Raises:
        ConnectTimeoutError: nothing answered within ``timeout`` seconds.
        AuthenticationError: the task refused the call (``security``'s token is missing or wrong).
        PsframeError: something answered, but not as a psframe task.
    """
    address = target.removeprefix("grpc://")
    parse_address(address)
    with transport.Connection(address, security=security) as connection:
        try:
            info = connection.call("GetInfo", pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except errors.RpcTimeoutError as e:
            raise ConnectTimeoutError(
                f"no psframe task answered at {address} within {timeout}s; is it started, and is the address right?"
            ) from e
    return messages.task_status(info)


def resolve_wire_dtype(wire_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The compression dtype asked for (``Transport(wire_dtype=...)``), or None; a clear error for anything else.

    Raises:
        ValueError: not None, float32, or one of :data:`psframe.wire.codec.WIRE_DTYPES`.
    """
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

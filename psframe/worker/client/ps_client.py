"""A worker's view of the ps tasks: its connections, the step path, and the cut.

:class:`PsClient` holds the worker side's connections to every ps task and
the step path over them, in the spirit of ps-lite's ``KVWorker`` (push,
pull, wait): it takes shards and tensors, and gives back tensors and global
steps, over one long-lived stream per ps task; it also takes the cut that
checkpoints (:meth:`PsClient.save`) and re-layouts are taken at
(:meth:`PsClient.take_cut`). Messages,
the codec and gRPC stay behind it (:mod:`psframe.wire`). The calls around
the steps take a client: :mod:`psframe.worker.client.control_calls`
(waiting, the model, data ranges, the end) and
:mod:`psframe.worker.client.relayout_calls` (a live re-layout). Requests go to
every ps task in parallel; a failed call is raised as the psframe error the ps
raised, or as a named transport error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch

from psframe import errors
from psframe.checkpoint.manifest import ShardRecord
from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.options import BoundedStaleness
from psframe.config.security import Security
from psframe.tables.rows import RowPull
from psframe.wire import dtypes, one_cut, row_tensors, same_host, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client import streams
from psframe.worker.client.operations import (
    DenseReply,
    Operation,
    PullRows,
    PushPull,
    PushRows,
    RelayoutWord,
    Reply,
    RowsPulled,
    RowsPushed,
    StreamProgress,
)
from psframe.worker.client.streams import PushPullStreams
from psframe.worker.plan.step_plan import Request

ReplyT = TypeVar("ReplyT", DenseReply, RowsPulled)

log = logging.getLogger(__name__)


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
        relayout_word: where what ps 0's replies say of re-layouts is kept, shared by the clients of
            a worker's layouts (:class:`~psframe.worker.client.operations.RelayoutWord`); None: one of its own.
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
        relayout_word: RelayoutWord | None = None,
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
        # One connection per ps task, by index: the step streams and every other call use them.
        self.connections = [
            transport.Connection(address, f"{ClusterSpec.task_name('ps', k)} at {address}", security, liveness)
            for k, address in enumerate(cluster.job_tasks("ps"))
        ]
        # The tasks on this host may take shared regions until one says it cannot map them.
        share = shared_memory and same_host.available()
        self._streams = PushPullStreams(
            self.connections,
            self.caller,
            wire_dtype,
            share_with=share,
            staleness=staleness,
            relayout_word=relayout_word,
        )
        # Synchronous training: parts of tables whose rows are applied at once (SyncReplicas.async_tables).
        self.async_parts: frozenset[str] = frozenset()

    @property
    def push_numbers(self) -> streams.PushNumbers:
        """How this worker numbers its pushes to each ps task (the control calls that learn
        what a task applied already move the numbering on)."""
        return self._streams.numbers

    @property
    def num_ps(self) -> int:
        return len(self.connections)

    def describe(self, ps_task: int) -> str:
        """``"/job:ps/task:K at host:port"``."""
        return self.connections[ps_task].peer

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
        if not rows and not prefetch:  # no table rows: the planned requests alone
            planned = [PushPull(request, grads) for request, grads in requests]
            # Every reply is there (a failure raised), and a PushPull's is a DenseReply.
            return cast(list[DenseReply], self._exchange(planned, step, compress, timeout, again)), {}
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
                pulled[pull.ps_task] = reply.rows
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
        wanted: Mapping[int, Sequence[RowPull]],
        step: int,
        create: bool = True,
    ) -> dict[int, list[torch.Tensor]]:
        """The current values of some rows of embedding tables, from every ps task asked, in parallel.

        Args:
            wanted: per ps task, ``(table part, ids)`` pairs (int64 ids of rows of the part).
            step: the worker's global step (for the ps task's records).
            create: dynamic tables make the rows of ids they do not hold (else
                they answer those ids' initial rows and keep nothing).

        Returns:
            Per ps task, the rows of each pair, in order (read-only views of the reply).

        Raises:
            PsframeError: the error a ps task raised (e.g. ``RowIdError``), or a transport error.
        """
        pulls = [PullRows(ps_task, pairs, create) for ps_task, pairs in wanted.items()]
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

    # ---- the cut that checkpoints and re-layouts are taken at

    def save(self, checkpoint_dir: str, step: int, parent: int | None = None) -> list[ShardRecord]:
        """Ask every ps task to write its shard of checkpoint ``step``, in parallel: what
        it holds, or only what changed since checkpoint ``parent`` (a delta).

        The shards are of one cut (:mod:`psframe.wire.one_cut`). In asynchronous training each
        holds the same steps of every worker (a step some ps task had begun applying is
        applied by all first; the steps after wait, at most a few seconds); in
        synchronous training, the same rounds (a round some ps task had applied
        is applied by all first; the rounds after wait).

        Returns:
            What each ps task wrote, by task index.
        """
        requests = [
            pb.SaveShardRequest(
                caller=self.caller,
                checkpoint_dir=checkpoint_dir,
                step=step,
                delta=parent is not None,
                parent_step=parent or 0,
            )
            for _ in self.connections
        ]
        replies = self.take_cut(
            "SaveShard",
            requests,
            f"{self.name}: checkpoint step {step} is saved without one cut across the ps tasks",
        )
        return [
            ShardRecord(ps_task=k, file=r.file, sha256=r.sha256, nbytes=r.nbytes, global_step=r.global_step)
            for k, r in enumerate(replies)
        ]

    def take_cut(self, method: str, requests: Sequence[Any], lost: str, *, for_move: bool = False) -> list[Any]:
        """Hold every ps task at one cut and have each take its part there (:func:`~psframe.wire.one_cut.at_one_cut`):
        ``method`` (``SaveShard``: a checkpoint's shard; ``MoveCut``: a re-layout's snapshot,
        ``for_move``) with its request of ``requests``, by task. ``lost`` says in the warning what
        a cut lost to a worker that died mid-step means.

        Returns:
            Each ps task's reply, by task index.
        """
        return one_cut.at_one_cut(
            self.connections,
            self.caller,
            method,
            requests,
            lambda: self.rpc_timeout,
            hold_seconds=min(self.rpc_timeout, 10.0),
            for_move=for_move,
            lost=lost,
        )

    # ---- data progress, carried by the steps' pushes

    def report_progress(self, ps_task: int, name: str, lease: int, offset: int) -> None:
        """Carry, in the next step's step-ending push to ``ps_task``, that the step consumed data set
        ``name``'s range ``lease`` up to ``offset`` (recorded with the push, applied once)."""
        self._streams.encoder.carry_progress({ps_task: pb.DataProgress(name=name, lease=lease, offset=offset)})

    def report_stream_progress(self, progress: Mapping[int, StreamProgress]) -> None:
        """Carry, in the next step's pushes to each ps task ``k`` of ``progress``, the stream's
        batch ``progress[k]`` (:mod:`psframe.ps.protocol.stream_partitions`)."""
        self._streams.encoder.carry_progress({task: batch.message() for task, batch in progress.items()})

    def progress_carried(self) -> set[int]:
        """The ps tasks whose step-ending push carried the progress (since it was last set)."""
        return set(self._streams.encoder.carried)

    def take_progress(self, other: PsClient) -> None:
        """Carry the data progress ``other`` was to send (a client of the layout before a re-layout)."""
        self._streams.encoder.carry_progress(other._streams.encoder.progress)

    def clear_progress(self) -> None:
        """Steps carry no data progress from now on (until :meth:`report_progress`)."""
        self._streams.encoder.carry_progress(None)

    def close(self) -> None:
        self._streams.close()
        for ps in self.connections:
            ps.close()

    def __enter__(self) -> PsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _targets(operations: Iterable[Operation]) -> list[int | None]:
    """Per operation, the ps task it pushes to, or None if it pushes nothing (for push numbers)."""
    return [operation.ps_task if operation.pushes else None for operation in operations]


def _expect(reply: Reply | None, kind: type[ReplyT]) -> ReplyT:
    """``reply``, which answers an operation whose reply is of type ``kind``."""
    if not isinstance(reply, kind):
        raise errors.WireFormatError(f"expected a {kind.__name__} reply, got {reply!r}")
    return reply


def resolve_wire_dtype(wire_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The compression dtype asked for (``Transport(wire_dtype=...)``), or None; a clear error for anything else.

    Raises:
        ValueError: not None, float32, or one of :data:`psframe.wire.codec.WIRE_DTYPES`.
    """
    if wire_dtype is None or wire_dtype in ("float32", torch.float32):
        return None
    if isinstance(wire_dtype, torch.dtype) and wire_dtype in dtypes.WIRE_DTYPES.values():
        return wire_dtype
    if isinstance(wire_dtype, str) and wire_dtype in dtypes.WIRE_DTYPES:
        return dtypes.WIRE_DTYPES[wire_dtype]
    raise ValueError(
        f"wire_dtype must be None (send as stored), {sorted(dtypes.WIRE_DTYPES)} or the matching "
        f"torch dtype, got {wire_dtype!r}"
    )

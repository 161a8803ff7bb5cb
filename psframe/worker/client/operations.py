"""What a worker asks of a ps task, and what it gets back: named operations, one encoder.

Every operation travels as one PushPull message on the ps task's stream
(:mod:`psframe.worker.client.streams`), and is answered by one reply of its own type:

=================  =====================================  ================================  ===============
operation          pushes                                 pulls                             reply
=================  =====================================  ================================  ===============
:class:`PushPull`  gradients of dense shards (or none)    their values, after the update    :class:`DenseReply`
:class:`PushRows`  gradients of some rows of table parts  nothing                           :class:`RowsPushed`
:class:`PullRows`  nothing                                rows of table parts, by id        :class:`RowsPulled`
=================  =====================================  ================================  ===============

A step's messages to a ps task are as few as it can make them: the rows'
gradients travel in the message that ends the step there (a
:class:`PushPull`'s ``rows``), and in asynchronous training the rows
pulled ahead for the next step (:mod:`psframe.worker.model.prefetch`) too
(``row_pulls``, read once the message's pushes are applied). A ps task
that holds only embedding tables gets one :class:`PushRows`, which may
carry the pulls the same way. Each message costs a ps task about a
quarter of a millisecond of gRPC's Python beyond its tensors' work, more
than the row update of a CTR batch's table part.

*End of step* is a field of the operations that push (a :class:`PushPull`'s
planned request, or :attr:`PushRows.end_of_step`): the worker's last push of
its step to that ps task, which counts the step (and, in synchronous
training, closes the worker's part of the round).

:class:`OperationEncoder` is the one place that turns an operation into a
message and a reply back into its type. A :class:`PushPull` is sent every
step, so the work of its message is done once (:class:`PreparedRequest`: its header,
the layouts of its gradients and of its reply's values), and on the ps task's host
its tensors may move through a shared region.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from psframe.config.options import BoundedStaleness
from psframe.errors import WireFormatError
from psframe.tables.rows import RowPull, RowPush
from psframe.wire import codec, dtypes, encoding, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion
from psframe.worker.plan.step_plan import Request

log = logging.getLogger(__name__)

Gradients = Sequence[tuple[str, torch.Tensor]]
"""Tensors by shard name: the gradients a :class:`PushPull` sends."""


class PushPull:
    """A planned request of a step (:class:`~psframe.worker.plan.step_plan.Request`) with its gradients.

    ``grads`` may be empty for a request that only pulls, or left to the
    exchange that sends it (its gradients are not all there yet: see
    :meth:`psframe.worker.client.streams.PushPullStreams.begin`). What the
    streams and the encoder ask of it is an attribute, worked out when it is made.
    """

    __slots__ = ("carries_rows", "grads", "ps_task", "pushes", "request", "row_pulls", "rows")

    def __init__(
        self,
        request: Request,
        grads: Gradients = (),
        rows: Sequence[RowPush] = (),
        row_pulls: Sequence[RowPull] = (),
    ) -> None:
        self.request, self.grads = request, grads
        self.rows = rows  # gradients of rows of the ps task's table parts, applied with the request's
        self.row_pulls = row_pulls  # rows read after the update (asynchronous training), answered in the reply
        self.ps_task = request.ps_task
        self.pushes = bool(request.push or rows)
        # It travels with rows: a message of its own make, not its prepared request's.
        self.carries_rows = bool(rows or row_pulls)


@dataclass(frozen=True)
class StreamProgress:
    """What a step on a stream's batch tells one ps task: the batch is records ``[start, end)`` of
    ``partition`` (of ``partitions``), on lease ``lease`` (ps 0's), and the worker last knew the
    task's updates of the partition to have reached ``seen``."""

    name: str
    lease: int
    partition: int
    partitions: int
    start: int
    end: int
    seen: int

    def message(self) -> pb.DataProgress:
        return pb.DataProgress(
            name=self.name,
            lease=self.lease,
            offset=self.end,
            start=self.start,
            seen=self.seen,
            partition=self.partition,
            partitions=self.partitions,
        )


@dataclass(frozen=True, slots=True)
class PushRows:
    """Gradients of rows of embedding table parts held by one ps task."""

    ps_task: int
    rows: Sequence[RowPush]
    end_of_step: bool  # no PushPull of the step to this ps task ends it: this message does
    row_pulls: Sequence[RowPull] = ()  # rows read after these are applied (asynchronous training)
    rows_async: bool = False  # sync training: rows of tables applied at once, outside the round
    pushes: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class PullRows:
    """The current values of rows of embedding table parts held by one ps task.

    ``create``: a dynamic table makes the rows of ids it does not hold (else
    it answers their initial rows and keeps nothing).
    """

    ps_task: int
    rows: Sequence[RowPull]
    create: bool = True
    pushes: ClassVar[bool] = False


Operation = PushPull | PushRows | PullRows


@dataclass(slots=True)
class DenseReply:
    """The answer to a :class:`PushPull`: the ps task's global step and the values pulled."""

    global_step: int
    dropped: bool  # sync: the gradients were stale or late, and not applied
    values: list[torch.Tensor]  # in the order of the request's ``pull``; read-only views of the reply
    duplicate: bool = False  # a push sent again whose first copy the ps task had applied (not applied again)
    rows: list[torch.Tensor] = field(default_factory=list)  # the rows of the request's ``row_pulls``, in order
    steps_ahead: int = 0  # async, a step-ending push: how far ahead of the slowest live worker it found this one


@dataclass(slots=True)
class RowsPushed:
    """The answer to a :class:`PushRows`."""

    global_step: int
    duplicate: bool  # sent again after its first copy was applied (not applied again)
    rows: list[torch.Tensor] = field(default_factory=list)  # the rows of its ``row_pulls``, in order


@dataclass(slots=True)
class RowsPulled:
    """The answer to a :class:`PullRows`: the rows of each ``(part, ids)`` pair, in order (read-only
    views)."""

    rows: list[torch.Tensor]


Reply = DenseReply | RowsPushed | RowsPulled


class RelayoutWord:
    """What ps 0's replies say of re-layouts (``PushPullReplyHeader.relayout_pending``): one asked
    for or under way. Only ps 0 is asked for re-layouts, so only its replies are heard. One word
    serves the clients of every layout a worker trains on; the chief reads it after each step,
    and clears it (:mod:`psframe.worker.relayout_leader`), instead of asking ps 0."""

    __slots__ = ("heard", "pending")

    def __init__(self) -> None:
        self.heard = False  # a reply of ps 0 was read since the chief last looked
        self.pending = False  # and the last one said a re-layout is pending


class OperationEncoder:
    """Operations to PushPull messages, and replies to their types, for one client.

    Args:
        caller: who sends (every header names it).
        wire_dtype: the dtype compressed :class:`PushPull` gradients move in; None: none.
        share_with: the ps tasks that may take shared regions (on this host, with
            shared memory available); one that says it cannot map them is dropped.
        staleness: the bound every push that ends a step carries
            (:class:`psframe.BoundedStaleness`, :mod:`psframe.ps.protocol.staleness`); None: none.
        relayout_word: where what ps 0's replies say of re-layouts is kept; None: a word of its own.
    """

    def __init__(
        self,
        caller: pb.Caller,
        wire_dtype: torch.dtype | None,
        share_with: set[int],
        staleness: BoundedStaleness | None = None,
        relayout_word: RelayoutWord | None = None,
    ) -> None:
        self._caller = caller
        self._staleness = staleness
        self._wire_dtype = wire_dtype
        self._wire_name = dtypes.dtype_name(wire_dtype) if wire_dtype is not None else ""
        self.share_with = share_with
        # Made once per planned request (and compression): see PreparedRequest.
        self.prepared: dict[tuple[Request, bool], PreparedRequest] = {}
        # Data read in ranges or from a stream: what this step consumed, for its step-ending push
        # to each ps task named (psframe.ps.protocol.data_ranges); None between such steps.
        self.progress: Mapping[int, pb.DataProgress] | None = None
        self.carried: set[int] = set()  # the ps tasks whose step-ending push named it
        self.relayout_word = relayout_word or RelayoutWord()

    def carry_progress(self, progress: Mapping[int, pb.DataProgress] | None) -> None:
        """Name ``progress[k]`` in the step-ending pushes to ps task ``k`` from now on; None: in none
        (the prepared headers forget what they named, so that a step without it checks nothing)."""
        self.progress = progress
        self.carried = set()
        if progress is None:
            for prepared in self.prepared.values():
                prepared.header.ClearField("progress")

    def encode(self, operation: Operation, step: int, compress: bool, push_id: int, grads: Gradients = ()) -> bytes:
        """The message of ``operation`` at ``step``, numbered ``push_id`` (0 for one that pushes nothing).

        ``compress``: a :class:`PushPull`'s tensors travel in the wire dtype; ``grads``:
        its gradients, where the operation does not hold them.
        """
        if isinstance(operation, PushPull) and not operation.carries_rows:  # a planned request, prepared
            request = operation.request
            prepared = self.prepared.get((request, compress))
            if prepared is None:  # every step sends the same header but for the step number
                prepared = self.prepared[(request, compress)] = PreparedRequest(
                    self._planned_header(request, compress), share=request.ps_task in self.share_with
                )
            elif prepared.share and request.ps_task not in self.share_with:
                prepared.share = False
                prepared.drop_region()
            if self.progress is not None:
                self._report_progress(prepared.header, request.ps_task)
            grads = grads or operation.grads
            return prepared.encode(step, self._to_wire(grads) if compress else grads, push_id)
        if isinstance(operation, PushPull):
            return self._encode_with_rows(operation, grads or operation.grads, step, compress, push_id)
        if isinstance(operation, PushRows):
            tensors, kinds = row_tensors.push_tensors(operation.rows)
            pulled, pulled_kinds = row_tensors.pull_tensors(operation.row_pulls)
            header = pb.PushPullHeader(
                caller=self._caller,
                step=step,
                end_of_step=operation.end_of_step,
                push_id=push_id,
                rows_async=operation.rows_async,
            )
            self._bound(header)
            self._report_progress(header, operation.ps_task)
            return codec.encode(header, tensors + pulled, kinds + pulled_kinds)
        tensors, kinds = row_tensors.pull_tensors(operation.rows, operation.create)
        header = pb.PushPullHeader(caller=self._caller, step=step)
        return codec.encode(header, tensors, kinds)

    def _planned_header(self, request: Request, compress: bool) -> pb.PushPullHeader:
        """The header of a planned request, but for its step and push number."""
        header = pb.PushPullHeader(
            caller=self._caller,
            pull=[s.name for s in request.pull],
            end_of_step=request.end_of_step,
            wire_dtype=self._wire_name if compress else "",
        )
        self._bound(header)
        return header

    def _to_wire(self, grads: Gradients) -> Gradients:
        """The gradients as they travel compressed: in the wire dtype."""
        return [(name, dtypes.to_wire(grad, self._wire_dtype)) for name, grad in grads]

    def _bound(self, header: pb.PushPullHeader) -> None:
        """Name the staleness bound in a step-ending push's header (where there is one)."""
        if self._staleness is not None and header.end_of_step:
            header.staleness_bound = self._staleness.steps
            header.staleness_timeout = self._staleness.timeout

    def _report_progress(self, header: pb.PushPullHeader, ps_task: int) -> None:
        """Name the data this step consumed in its step-ending push to each ps task it is for; a
        stream's batch in every push of the step there (each is applied, or answered as applied
        already, or refused, as the step's batch is: :mod:`psframe.ps.protocol.stream_partitions`)."""
        progress = self.progress.get(ps_task) if self.progress is not None else None
        if progress is not None and (header.end_of_step or progress.partitions):
            header.progress.CopyFrom(progress)
            if header.end_of_step:
                self.carried.add(ps_task)
        elif header.HasField("progress"):
            header.ClearField("progress")

    def _encode_with_rows(
        self, operation: PushPull, grads: Gradients, step: int, compress: bool, push_id: int
    ) -> bytes:
        """A planned request that carries rows too: its header, its gradients and the rows, in the message."""
        header = self._planned_header(operation.request, compress)
        header.step, header.push_id = step, push_id
        self._report_progress(header, operation.ps_task)
        grads = self._to_wire(grads) if compress else grads
        pushed, pushed_kinds = row_tensors.push_tensors(operation.rows)
        pulled, pulled_kinds = row_tensors.pull_tensors(operation.row_pulls)
        kinds = [int(row_tensors.VALUE)] * len(grads) + pushed_kinds + pulled_kinds
        return codec.encode(header, [*grads, *pushed, *pulled], kinds)

    def decode(self, operation: Operation, data: bytes, compress: bool) -> tuple[pb.PushPullReplyHeader, Reply]:
        """The reply to ``operation``: its header (errors and region fields) and its typed answer."""
        if isinstance(operation, PushPull) and not operation.carries_rows:  # a planned request, prepared
            prepared = self.prepared[(operation.request, compress)]
            header, tensors = prepared.decode(data)
            if header.region_refused:
                self.share_with.discard(operation.ps_task)
            if header.region_unusable:  # nothing was applied: the tensors go again in the message
                prepared.drop_region()
            reply: Reply = DenseReply(
                header.global_step, header.dropped, tensors, header.duplicate, steps_ahead=header.steps_ahead
            )
        else:
            header, reply = self._decode_general(operation, data)
        if operation.ps_task == 0 and not (header.error_class or header.region_unusable):
            word = self.relayout_word
            word.heard, word.pending = True, header.relayout_pending
        return header, reply

    def _decode_general(self, operation: Operation, data: bytes) -> tuple[pb.PushPullReplyHeader, Reply]:
        """The reply to an operation that is no prepared request (it carries rows, or is of rows)."""
        header, tensors = codec.decode(data, pb.PushPullReplyHeader)
        if isinstance(operation, PushPull):
            values = [t for meta, t in zip(header.tensors, tensors) if meta.kind == row_tensors.VALUE]
            rows = row_tensors.pulled_rows(header.tensors, tensors)
            return header, DenseReply(
                header.global_step, header.dropped, values, header.duplicate, rows, header.steps_ahead
            )
        if isinstance(operation, PushRows):
            rows = row_tensors.pulled_rows(header.tensors, tensors)
            return header, RowsPushed(header.global_step, header.duplicate, rows)
        return header, RowsPulled(row_tensors.pulled_rows(header.tensors, tensors))

    def drop_regions(self, operations: Sequence[Operation], compress: bool) -> None:
        """Give the planned requests among ``operations`` regions of their own next time (a step that failed
        may have left gradients in theirs that a ps task still holds: a sync round waits for them)."""
        for operation in operations:
            if isinstance(operation, PushPull):
                prepared = self.prepared.get((operation.request, compress))
                if prepared is not None:
                    prepared.drop_region()

    def drop_all_regions(self) -> None:
        """Offer shared regions anew (the streams were closed)."""
        for prepared in self.prepared.values():
            prepared.drop_region()


class PreparedRequest:
    """What one planned request sends and gets back every step, worked out on first use.

    A worker sends each ps task the same planned requests every step; only the step and the
    tensors' values change. A prepared request keeps the header, and learns the layouts of the
    request's gradients and of the reply's values from the first message of each, so that later
    ones that fit are encoded and decoded without per-tensor work (:mod:`psframe.wire.encoding`).

    On the ps task's host it also moves the tensors through a shared region
    (:mod:`psframe.wire.same_host`): the second request of its kind (both layouts known) offers
    one; once the ps task answered in it, the requests leave their gradients there and carry
    only the header.

    Args:
        header: the request's header; only its step and push number change from one message to the next.
        share: offer the ps task a shared region (it and this worker may share a host).
    """

    def __init__(self, header: pb.PushPullHeader, share: bool = False) -> None:
        self.header = header
        self.share = share
        self._request: MessageEncoding | None = None
        self._reply: MessageEncoding | None = None
        self._region: SameHostRegion | None = None
        self._in_region = False  # the ps task answered in the region: requests leave their tensors there

    @property
    def in_region(self) -> bool:
        """Whether requests leave their tensors in the shared region (the ps task answered in it)."""
        return self._in_region

    def encode(self, step: int, grads: Sequence[tuple[str, torch.Tensor]], push_id: int = 0) -> bytes:
        """The request of ``step`` carrying ``grads``, numbered ``push_id`` (0: it pushes nothing)."""
        self.header.step = step
        self.header.push_id = push_id
        if self._request is None:
            self._request = MessageEncoding(pb.PushPullHeader, [(name, g.dtype, tuple(g.shape)) for name, g in grads])
        try:
            buffers = self._request.buffers([g for _, g in grads])
        except WireFormatError:  # gradients of another layout, or not contiguous: general, in the message
            self.share = False
            self.drop_region()
            header = pb.PushPullHeader()
            header.CopyFrom(self.header)
            return codec.encode(header, grads)
        if self._in_region:
            assert self._region is not None  # in a region only while it holds one (drop_region clears both)
            self._region.write_request(self._request, buffers)
            return self._request.encode_header(self.header)
        if self._region is None and self.share and self._reply is not None:
            self._offer_region()  # the second message of its kind: a request sent once never makes one
        return self._request.encode(self.header, buffers)

    def decode(self, data: bytes) -> tuple[pb.PushPullReplyHeader, list[torch.Tensor]]:
        """The reply's header and values (views of the reply, or of the shared region:
        read them before this request is sent again).

        Raises:
            WireFormatError: the reply does not fit its header.
        """
        envelope = encoding.parse(data, pb.PushPullReplyHeader)
        header = envelope.header
        if header.in_region:
            if self._region is None:
                raise WireFormatError("a reply in a shared region this request did not offer")
            envelope = self._region.reply_envelope(header)
            if not self._in_region:  # accepted: both sides have it mapped, the file can go
                self._in_region = self.header.same_host.in_region = True
                self._region.unlink()
        elif header.region_refused:
            log.debug("the ps task will not share a region: %s", header.region_refused)
            self.share = False
            self.drop_region()
        if self._reply is not None and self._reply.matches(header):
            tensors = self._reply.tensors(envelope)
        else:
            tensors = encoding.tensors_of(envelope)
            if not (header.error_class or header.region_unusable) and self._reply is None:  # a refusal has no tensors
                self._reply = MessageEncoding(
                    pb.PushPullReplyHeader,
                    [(meta.name, t.dtype, tuple(t.shape)) for meta, t in zip(header.tensors, tensors)],
                )
        return header, tensors

    def _offer_region(self) -> None:
        if not self.share or self._request is None or self._reply is None or self.header.wire_dtype:
            return
        try:
            self._region = SameHostRegion.create(self._request, self._reply)
        except OSError as e:
            log.debug("no shared region (%s): tensors travel in messages", e)
            self.share = False
            return
        self.header.same_host.CopyFrom(self._region.message)

    def drop_region(self) -> None:
        """Send the tensors in messages again (the ps task could not use the region, or was
        replaced); the next request offers a new region."""
        if self._region is not None:
            self._region.unlink()
            self._region = None
        self._in_region = False
        self.header.ClearField("same_host")

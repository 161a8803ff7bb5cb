"""The data plane: a ps task's answer to each PushPull request of a stream, read from its bytes.

:meth:`PushPullHandler.stream` is the PushPull method (the service lists it
in its table of handlers): the transport hands it a stream's requests as
they came off the wire, and it yields each reply's bytes; it knows nothing
of gRPC. A refused request is answered with the psframe error's name in its
reply (:meth:`PushPullHandler.reply`), and the stream goes on; the caller's
admission and the layout reach it only through two guards' ``check_caller``.

The path a request takes:

=========  =================================================  ===============================
training   request                                            path
=========  =================================================  ===============================
async      dense, of a kind cached on this stream             :meth:`_apply_cached`
async      any other: dense or rows, pushing or pulling       :meth:`_apply_now`
sync       pulls only: dense values, rows                     :meth:`_apply_now`
sync       pushes: dense gradients, rows' gradients           :class:`~psframe.ps.service.sync_pushes.SyncPushes`
=========  =================================================  ===============================

Each worker's pushes apply once (the push ledger), wait their turn while a
checkpoint's cut holds them back, carry the data progress they consumed, and
(asynchronous training, under a staleness bound) hold the reply that ends a
step until the worker is within the bound.

The fast path. A worker's stream repeats a few kinds of request, one per
message of its step plan (:mod:`psframe.worker.plan.step_plan`): the same
gradients, the same pulls, every step. The first request of a kind is
handled the general way, every name, dtype and shape checked against the
store, and leaves a :class:`CachedRequest` in the stream's
:class:`StreamCache`: the request's layout, the variables its gradients
update, and the reply's layout with views of the variables it pulls. A later
request that matches a cached one skips all of that: its gradients are read
in place, applied, and the reply is written from the views. A cached request
holds for one generation of the store's variables
(:attr:`VariableStore.generation`); when the store makes its variables anew
(the chief created them again, a checkpoint was restored), cached requests of
the generation before are dropped and made again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from psframe.errors import NotKeptHere, NotReadyError, PsframeError, SharedRegionError
from psframe.memory.malloc import MemoryReturner
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.ledger_cut import LedgerCut
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import HISTOGRAM_BUCKETS, StalenessGate
from psframe.ps.service.push_pull_request import PushPullRequest, outgoing
from psframe.ps.service.served_model import ServedModel
from psframe.ps.service.sync_pushes import SyncPushes
from psframe.ps.store import VariableStore
from psframe.wire import codec, dtypes, encoding, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.layouts import Layouts
from psframe.wire.same_host import SameHostRegion
from psframe.wire.transport.error_codec import encode_error

log = logging.getLogger(__name__)


class CallerGuard(Protocol):
    """Refuses a caller it does not take (by raising)."""

    def check_caller(self, caller: pb.Caller) -> None: ...


class LayoutGuard(CallerGuard, Protocol):
    """Refuses a worker of a layout a re-layout left; says whether a re-layout is asked for or under way."""

    pending: bool  # a plain attribute: every reply reads it, without a lock


class PushPullHandler:
    """The PushPull requests of ps task ``task_name``, answered over its store.

    Args:
        store: the variables.
        ledger, cut: each worker's pushes applied, and a checkpoint's hold of them.
        roster: a worker is alive while its call runs.
        staleness: how far ahead each asynchronous step finds its worker (its histogram), and the bound.
        data: the data ranges the pushes consumed.
        model: the synchronous rounds, when training is synchronous.
        admission: admits the caller of a request that takes no cached path.
        layout: refuses a worker of a layout a re-layout left (checked again after a wait); every
            reply says whether a re-layout is asked for or under way (its ``pending``: the chief
            asks ps 0 for the re-layout's status only then).
        memory: gives freed message buffers back, every so many bytes handled (where it is on).
        task_name: the task, for the errors.
        keeps_data: this process keeps the data queues (a serving process hands a push that
            carries data progress to the task's owner: :class:`NotKeptHere`).
    """

    def __init__(
        self,
        store: VariableStore,
        ledger: PushLedger,
        cut: LedgerCut,
        roster: WorkerRoster,
        staleness: StalenessGate,
        data: RangeQueue,
        model: ServedModel,
        admission: CallerGuard,
        layout: LayoutGuard,
        memory: MemoryReturner,
        *,
        task_name: str,
        keeps_data: bool,
    ) -> None:
        self._store, self._ledger, self._cut, self._roster = store, ledger, cut, roster
        self._staleness, self._data, self._model = staleness, data, model
        self._admission, self._layout, self._memory = admission, layout, memory
        self._task_name, self._keeps_data = task_name, keeps_data
        self._sync = SyncPushes(store, ledger, data, model, layout, task_name=task_name)
        # Bytes handled since freed buffers were last given back; counted only where that is on.
        self._returns_memory, self._unreturned = memory.enabled, 0

    def stream(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        """PushPull on a long-lived stream: requests are answered in order (:meth:`reply`), and
        a refused one gets the error's name in its reply; the stream goes on."""
        cache = StreamCache()
        for data in requests:
            yield self.reply(data, cache)

    def reply(self, data: bytes, cache: StreamCache | None = None) -> bytes:
        """The reply to one PushPull request (:meth:`answer`): a refused one names the error.

        A request whose shared region cannot be used is answered with the
        reason in ``region_unusable``: nothing was applied, and the worker
        sends it again with its tensors in the message. Anything else (a bug)
        ends the stream, with the status the transport gives it.
        """
        try:
            return self.answer(data, cache)
        except SharedRegionError as e:
            return codec.encode(pb.PushPullReplyHeader(region_unusable=str(e)), ())
        except PsframeError as e:
            name, message = encode_error(e)
            return codec.encode(pb.PushPullReplyHeader(error_class=name, error_message=message), ())

    def answer(self, data: bytes, cache: StreamCache | None = None) -> bytes:
        """Read one request and answer it by the one path its kind and the training take (see the module).

        A cached request the model no longer fits (its variables were made
        anew) is dropped from the cache and takes the general path. Asynchronous
        pushes are applied at once; synchronous ones join their step's round,
        and a request that pulls (or ends the worker's step) is answered once
        the round is applied. A request's tensors may lie in the sender's shared
        region (a worker on this host): a reply on the fast path or of a round
        goes back there too.

        ``cache`` holds the cached requests of the request's stream: an asynchronous request
        of a kind seen before on it takes the fast path.

        Raises:
            PsframeError: the request is refused; nothing of it was applied.
            SharedRegionError: its shared region cannot be used; nothing was applied.
        """
        if self._returns_memory:
            # Counted without a lock: a count lost to a race between streams only delays a trim.
            self._unreturned += len(data)
            if self._unreturned >= MemoryReturner.EVERY_BYTES:
                self._memory.handled(self._unreturned)
                self._unreturned = 0
        envelope = encoding.parse(data, pb.PushPullHeader)
        header = envelope.header
        region, refused = None, ""
        if cache is not None and cache.refused_push and header.push_id:
            cache.check_order(header.push_id)
        if header.HasField("same_host"):  # a worker on this host: its tensors may lie in a shared region
            envelope, region, refused = (cache if cache is not None else StreamCache()).open_region(envelope)
        cached = None
        if header.HasField("progress"):
            if not self._keeps_data:
                raise NotKeptHere(header.progress.name)
        elif cache is not None and self._model.aggregator is None:
            cached = cache.find(header)
        if cached is None:
            self._admission.check_caller(header.caller)
        try:
            with self._roster.call(header.caller.task_index):
                if cached is not None and cache is not None:
                    reply = self._apply_cached(cached, header, envelope, region)
                    if reply is not None:
                        if header.HasField("staleness_bound"):
                            self._bound_staleness(header)
                        return reply
                    cache.drop(cached)
                return self._answer_decoded(header, envelope, cache, region, refused)
        except NotReadyError:
            self._layout.check_caller(header.caller)  # the variables went at a re-layout's cut meanwhile
            raise

    def _answer_decoded(
        self,
        header: pb.PushPullHeader,
        envelope: encoding.Envelope,
        cache: StreamCache | None,
        region: SameHostRegion | None,
        refused: str,
    ) -> bytes:
        """The request decoded, answered the general way or joined to its round (the caller is in its call)."""
        tensors, span = cache.layouts.read(envelope) if cache is not None else (encoding.tensors_of(envelope), None)
        request = PushPullRequest.decode(header, tensors, span)
        if request.wire_dtype is not None:
            request.grads = self._store.widen(request.grads, request.wire_dtype)
        if request.rows_async:
            self._sync.check_async_rows(request)
        aggregator = self._model.aggregator
        if aggregator is None or not request.pushes or request.rows_async:
            reply = self._apply_now(request, header, cache, refused)
            self._bound_staleness(header)
            return reply
        return self._sync.join_round(aggregator, request, region, refused)

    def _apply_cached(
        self,
        cached: CachedRequest,
        header: pb.PushPullHeader,
        envelope: encoding.Envelope,
        region: SameHostRegion | None,
    ) -> bytes | None:
        """The fast path: an asynchronous request of a kind cached before; None if the cached request no longer holds.

        With a shared ``region`` (a worker on this host), the reply's tensors go there.
        """
        grads = cached.request.tensors(envelope)
        store, ledger = self._store, self._ledger
        worker = header.caller.task_index
        with store.lock:
            if cached.generation != store.generation or self._model.aggregator is not None:
                return None
            if grads and not ledger.admits(worker):
                self._cut.wait_turn(worker)
                if cached.generation != store.generation:  # made anew while it waited (a re-layout's cut)
                    return None
            duplicate = bool(grads) and ledger.is_duplicate(worker, header.push_id)
            if duplicate:
                grads = []  # applied already: answered with the values it pulls, not applied again
            step = store.update(cached.variables, grads, header.end_of_step)
            ahead = self._record(worker, header.push_id, header.end_of_step) if grads else 0
            # Encode under the lock, as below: one consistent version, one copy.
            reply = pb.PushPullReplyHeader(
                global_step=step, duplicate=duplicate, steps_ahead=ahead, relayout_pending=self._layout.pending
            )
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
        store, ledger = self._store, self._ledger
        grads, rows, pull = request.grads, request.rows, request.pull
        pushes, worker = request.pushes, request.worker
        with store.lock:
            if pushes and not ledger.admits(worker):
                self._cut.wait_turn(worker)
            self._layout.check_caller(header.caller)  # it waited at a re-layout's cut: nothing applies
            for name, ids, _ in request.row_pulls:  # every row asked for exists before anything changes
                store.check_row_ids(name, ids)
            duplicate = pushes and ledger.is_duplicate(worker, request.push_id)
            if duplicate:  # applied already: answered with the values it pulls, not applied again
                store.check_gradients(grads)
                store.check_rows(rows)
                grads, rows, pushes = {}, [], False
            progress = request.progress if pushes else None
            # The range (or partition) is still this worker's, or nothing applies; a stream's
            # batch applied here already is answered as a push sent again is.
            if progress is not None and self._data.check(worker, progress):
                grads, rows, pushes, progress = {}, [], False, None
            step, values = store.push_pull(grads, pull, request.end_of_step and pushes, rows)
            ahead = self._record(worker, request.push_id, request.end_of_step) if pushes else 0
            if progress is not None and request.end_of_step:  # consumed exactly when its update applied
                self._data.record(worker, progress)
            if (
                cache is not None
                and request.wire_dtype is None
                and self._model.aggregator is None
                and not (rows or request.row_pulls)
                and not duplicate
            ):
                self._cache_request(cache, header, list(grads), values)
            # Encode under the lock: the reply is one consistent version, and
            # the only copy of the variables is the one into the reply.
            reply = pb.PushPullReplyHeader(
                global_step=step,
                region_refused=refused,
                duplicate=duplicate,
                steps_ahead=ahead,
                relayout_pending=self._layout.pending,
            )
            sent = outgoing(pull, values, request.wire_dtype)
            if not request.row_pulls:
                return codec.encode(reply, sent)
            kinds = row_tensors.reply_kinds(len(sent), 0)
            for name, ids, create in request.row_pulls:
                sent.append((name, store.read_rows(name, ids, create)))
                kinds.append(row_tensors.ROWS)
            return codec.encode(reply, sent, kinds)

    def _record(self, worker: int, push_id: int, end_of_step: bool) -> int:
        """Record an asynchronous push applied (under the store's lock); for one that ends the
        worker's step, return how many steps ahead it found the worker, counted in ``psframe status``'s
        histogram (:attr:`StalenessGate.counts`), and wake the replies held to a bound, if any."""
        if not end_of_step:
            self._ledger.record(worker, push_id, False)
            return 0
        ahead = self._ledger.record(worker, push_id, True, self._roster.live_snapshot())
        self._staleness.counts[min(ahead, HISTOGRAM_BUCKETS - 1)] += 1
        if self._staleness.waiting:  # only under a bound: without one, a step wakes no one
            self._staleness.stepped()
        return ahead

    def _bound_staleness(self, header: pb.PushPullHeader) -> None:
        """Hold the reply to a step-ending push under a staleness bound until the worker is
        within it (asynchronous training; without the store's lock)."""
        if (
            header.end_of_step
            and header.push_id
            and header.HasField("staleness_bound")
            and self._model.aggregator is None
        ):
            self._staleness.wait(header.caller.task_index, header.staleness_bound, header.staleness_timeout or 300.0)

    def _cache_request(
        self, cache: StreamCache, header: pb.PushPullHeader, pushed: list[str], pulled: list[torch.Tensor]
    ) -> None:
        """Let requests of this kind take the fast way from now on (the caller holds the store's lock)."""
        try:
            cached = CachedRequest.make(header, self._store.variables(pushed), pulled, self._store.generation)
        except PsframeError as e:  # a request psframe's workers do not make: it stays on the general path
            log.debug("%s: a request that cannot be cached: %s", self._task_name, e)
        else:
            cache.add(cached)


@dataclass(eq=False)
class CachedRequest:
    """One kind of asynchronous PushPull request, checked once against a store.

    Attributes:
        caller: who sends it (checked when it was cached).
        pull: the names it pulls.
        request: where its gradients lie in the request.
        variables: the variables its gradients update, in request order.
        reply: where the pulled variables lie in the reply.
        reply_buffers: views of the pulled variables' bytes.
        generation: the store's generation of variables it was checked against.
    """

    caller: pb.Caller
    pull: list[str]
    request: MessageEncoding
    variables: list[torch.Tensor]
    reply: MessageEncoding
    reply_buffers: list
    generation: int

    @classmethod
    def make(
        cls,
        header: pb.PushPullHeader,
        variables: Sequence[torch.Tensor],
        pulled: Sequence[torch.Tensor],
        generation: int,
    ) -> CachedRequest:
        """The cached form of a request the store just answered: ``variables`` are those its
        gradients updated, ``pulled`` those it read (live, updated in place)."""
        request = MessageEncoding(
            pb.PushPullHeader,
            [(meta.name, dtypes.dtype_from_name(meta.dtype), tuple(meta.shape)) for meta in header.tensors],
        )
        reply = MessageEncoding(
            pb.PushPullReplyHeader,
            [(name, value.dtype, tuple(value.shape)) for name, value in zip(header.pull, pulled)],
        )
        caller = pb.Caller()
        caller.CopyFrom(header.caller)
        return cls(caller, list(header.pull), request, list(variables), reply, reply.buffers(pulled), generation)

    def matches(self, header: pb.PushPullHeader) -> bool:
        """Whether ``header`` is a request of this kind (the step and end-of-step may differ)."""
        return (
            not header.wire_dtype
            and header.caller == self.caller
            and header.pull == self.pull
            and self.request.matches(header)
        )


class StreamCache:
    """The cached requests of one PushPull stream, tried from the one after the last used,
    and the shared regions its requests named (:mod:`psframe.wire.same_host`).

    A stream's requests come in the same order every step, so the next
    request is almost always of the kind after the last one.
    """

    MAX_REQUESTS = 256  # a step of 1 GiB in 4 MiB messages; beyond, the general path

    def __init__(self) -> None:
        self._requests: list[CachedRequest] = []
        self._next = 0
        self._regions: dict[str, SameHostRegion] = {}
        self.layouts = Layouts()  # of the requests read the general way (synchronous training's, compressed ones)
        # The number of a push refused for its region, until it comes again: the pushes
        # after it on this stream are refused too, so that a worker's pushes are applied
        # in the order it numbered them (the ledger's rule, psframe.ps.protocol.ledger).
        # Read by the handler: while it is 0, a request has no order to check.
        self.refused_push = 0

    def check_order(self, push_id: int) -> None:
        """Refuse a push that comes after one refused for its region, until that one came again.

        Raises:
            SharedRegionError: the worker sends it again, after the refused one.
        """
        if self.refused_push and push_id > self.refused_push:
            raise SharedRegionError(
                f"push {push_id} follows push {self.refused_push}, refused for its "
                f"shared region: both are sent again, in order"
            )
        if push_id == self.refused_push:
            self.refused_push = 0

    def open_region(self, envelope: encoding.Envelope) -> tuple[encoding.Envelope, SameHostRegion | None, str]:
        """Where the tensors of a request that names a shared region lie, the region, and why
        the region is refused (empty if it is not).

        Raises:
            SharedRegionError: the tensors are in a region that cannot be used
                (the worker then sends them in the message).
        """
        message = envelope.header.same_host
        try:
            region = self.region(message)
        except SharedRegionError as e:
            if message.in_region:
                push_id = envelope.header.push_id
                if push_id and not self.refused_push:
                    self.refused_push = push_id
                raise
            return envelope, None, str(e)  # an offer: the tensors came in the message
        return (region.request_envelope(envelope.header) if message.in_region else envelope), region, ""

    def region(self, message: pb.SameHostRegion) -> SameHostRegion:
        """The region ``message`` names, mapped on first use.

        Raises:
            SharedRegionError: it cannot be mapped here, or is not as named.
        """
        region = self._regions.get(message.path)
        if region is not None and region.matches(message):
            return region
        region = SameHostRegion.attach(message)
        if len(self._regions) >= self.MAX_REQUESTS:  # a worker makes one per kind of request
            self._regions.clear()
        self._regions[message.path] = region
        return region

    def find(self, header: pb.PushPullHeader) -> CachedRequest | None:
        """The cached request ``header`` matches, or None."""
        cache = self._requests
        count = len(cache)
        for i in range(count):
            index = (self._next + i) % count
            if cache[index].matches(header):
                self._next = (index + 1) % count
                return cache[index]
        return None

    def add(self, cached: CachedRequest) -> None:
        """Keep ``cached`` (dropping any of an older generation)."""
        cache = [p for p in self._requests if p.generation == cached.generation]
        if len(cache) < self.MAX_REQUESTS:
            cache.append(cached)
        self._requests = cache
        self._next = len(cache)  # the next request is of a kind after this one

    def drop(self, cached: CachedRequest) -> None:
        """Forget ``cached`` (its store's variables were made anew)."""
        self._requests = [p for p in self._requests if p is not cached]
        self._next = 0

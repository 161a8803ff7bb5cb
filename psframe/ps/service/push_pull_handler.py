"""The data plane: a ps task's answer to one PushPull request, read from its bytes.

:meth:`PushPullHandler.answer` takes a request as it came off the wire (and
the cache of its stream) and returns the reply's bytes; it knows nothing of
gRPC. A refused request raises the psframe error (the service turns it into
the reply's error fields); the caller's admission and the layout reach it
only through two guards' ``check_caller``.

The path a request takes:

=========  =================================================  =========================
training   request                                            path
=========  =================================================  =========================
async      dense, of a kind cached on this stream             :meth:`_apply_cached`
async      any other: dense or rows, pushing or pulling       :meth:`_apply_now`
sync       pulls only: dense values, rows                     :meth:`_apply_now`
sync       pushes: dense gradients, rows' gradients           :meth:`_join_round`
=========  =================================================  =========================

Each worker's pushes apply once (the push ledger), wait their turn while a
checkpoint's cut holds them back, carry the data progress they consumed, and
(asynchronous training, under a staleness bound) hold the reply that ends a
step until the worker is within the bound.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from psframe import errors
from psframe.errors import NotKeptHere, NotReadyError, PsframeError
from psframe.memory.malloc import MemoryReturner
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.ledger_cut import LedgerCut
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import StalenessGate
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service.fast_path import CachedRequest, StreamCache
from psframe.ps.service.push_pull_request import PushPullRequest
from psframe.ps.service.round_replies import RoundReplies, outgoing
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import codec, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.same_host import SameHostRegion

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
        staleness: how far ahead each asynchronous step finds its worker, and the bound.
        data: the data ranges the pushes consumed.
        model: the synchronous rounds, when training is synchronous.
        admission: admits the caller of a request that takes no cached path.
        layout: refuses a worker of a layout a re-layout left (checked again after a wait); every
            reply says whether a re-layout is asked for or under way (its ``pending``: the chief
            asks ps 0 for the re-layout's status only then).
        memory: counts the bytes handled, to give freed message buffers back.
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
        self._round_replies = RoundReplies(store)

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
        of a kind seen before on it takes the fast path (see :mod:`psframe.ps.service.fast_path`).

        Raises:
            PsframeError: the request is refused; nothing of it was applied.
            SharedRegionError: its shared region cannot be used; nothing was applied.
        """
        self._memory.handled(len(data))
        envelope = codec.parse(data, pb.PushPullHeader)
        header = envelope.header
        region, refused = None, ""
        if cache is not None and header.push_id:
            cache.check_order(header.push_id)
        if header.HasField("same_host"):  # a worker on this host: its tensors may lie in a shared region
            envelope, region, refused = (cache if cache is not None else StreamCache()).open_region(envelope)
        if header.HasField("progress") and not self._keeps_data:
            raise NotKeptHere(header.progress.name)
        cached = (
            cache.find(header)
            if cache is not None and self._model.aggregator is None and not header.HasField("progress")
            else None
        )
        if cached is None:
            self._admission.check_caller(header.caller)
        try:
            return self._answer(header, envelope, cache, cached, region, refused)
        except NotReadyError:
            self._layout.check_caller(header.caller)  # the variables went at a re-layout's cut meanwhile
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
        """:meth:`answer` once the request is read and its caller checked."""
        with self._roster.call(header.caller.task_index):
            if cached is not None and cache is not None:
                reply = self._apply_cached(cached, header, envelope, region)
                if reply is not None:
                    self._bound_staleness(header)
                    return reply
                cache.drop(cached)
            request = PushPullRequest.decode(header, codec.tensors_of(envelope))
            if request.wire_dtype is not None:
                request.grads = self._store.widen(request.grads, request.wire_dtype)
            if request.rows_async:
                self._check_async_rows(request)
            aggregator = self._model.aggregator
            if aggregator is None or not request.pushes or request.rows_async:
                reply = self._apply_now(request, header, cache, refused)
                self._bound_staleness(header)
                return reply
            return self._join_round(aggregator, request, region, refused)

    def _check_async_rows(self, request: PushPullRequest) -> None:
        """A push of rows applied at once in synchronous training carries rows of tables so
        declared (``SyncReplicas(async_tables=...)``) and nothing else.

        Raises:
            WireFormatError: anything else in it; nothing is applied.
        """
        aggregator = self._model.aggregator
        parts = aggregator.async_parts if aggregator is not None else frozenset()
        wrong = [name for name, *_ in request.rows if name not in parts]
        if wrong or request.grads or request.pull or request.row_pulls or request.progress is not None:
            raise errors.WireFormatError(
                f"{self._task_name}: a push of rows applied at once carries only rows of the tables "
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
        store = self._store
        worker = header.caller.task_index
        with store.lock:
            if cached.generation != store.generation or self._model.aggregator is not None:
                return None
            if grads and not self._ledger.admits(worker):
                self._cut.wait_turn(worker)
                if cached.generation != store.generation:  # made anew while it waited (a re-layout's cut)
                    return None
            duplicate = bool(grads) and self._ledger.is_duplicate(worker, header.push_id)
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
            for name, ids, *_ in request.row_pulls:  # every row asked for exists before anything changes
                store.check_row_ids(name, ids)
            duplicate = pushes and ledger.is_duplicate(worker, request.push_id)
            if duplicate:  # applied already: answered with the values it pulls, not applied again
                store.check_gradients(grads)
                store.check_rows(rows)
                grads, rows, pushes = {}, [], False
            progress = request.progress if pushes else None
            if progress is not None:  # the range is still this worker's, or nothing applies
                self._data.check(worker, progress)
            step, values = store.push_pull(grads, pull, request.end_of_step and pushes, rows)
            ahead = self._record(worker, request.push_id, request.end_of_step) if pushes else 0
            if progress is not None:  # consumed exactly when the update that trained on it applied
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
            for name, ids, create, cached in request.row_pulls:
                if cached is None:
                    sent.append((name, store.read_rows(name, ids, create)))
                    kinds.append(row_tensors.ROWS)
                else:  # a worker's row cache: the rows it lacks or holds too old only
                    versions, fresh = store.read_rows_since(name, ids, create, cached, request.row_max_lag)
                    sent += [(name, versions), (name, fresh)]
                    kinds += [row_tensors.ROW_VERSIONS, row_tensors.ROWS]
            return codec.encode(reply, sent, kinds)

    def _record(self, worker: int, push_id: int, end_of_step: bool) -> int:
        """Record an asynchronous push applied (under the store's lock); for one that ends the
        worker's step, count how many steps ahead it found the worker (:mod:`psframe.ps.protocol.staleness`)."""
        ahead = self._staleness.count(worker) if end_of_step else 0
        self._ledger.record(worker, push_id, end_of_step)
        if end_of_step:
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

    def _join_round(
        self, aggregator: SyncAggregator, request: PushPullRequest, region: SameHostRegion | None, refused: str
    ) -> bytes:
        """The synchronous path: add a push to its step's round, and answer once the round is
        applied if it pulls or ends the worker's step (at once otherwise)."""
        store, ledger = self._store, self._ledger
        worker, pull = request.worker, request.pull
        store.check_names(pull)
        if request.row_pulls:  # a round's replies are one encoding for every member: values only
            raise errors.WireFormatError(
                f"{self._task_name}: a synchronous push asked for rows of {request.row_pulls[0][0]!r} too; "
                f"in synchronous training rows are pulled in a message of their own"
            )
        # A push that pulls nothing is one of several messages of a worker's
        # step: it is recorded and answered at once (the worker's step plan:
        # psframe.worker.plan.step_plan.StepPlan).
        # Gradients in a worker's shared region are kept as views: the worker
        # writes there again only after its step's last reply, which comes once
        # the round is applied, or after a failure, which gives it a new region.
        # The step's last message waits for the round: it pulls the new values (or, on
        # a ps task holding only embedding tables, ends a step that pulls rows later).
        # A round applies a worker's gradients once however often they are sent (it
        # is keyed by step and worker); the ledger counts the worker's step once, and
        # tells a push sent again after a lost reply from a stale one.
        if (
            request.step < store.global_step
            and ledger.is_duplicate(worker, request.push_id)
            and aggregator.was_member(worker, request.step)
        ):
            with store.lock:
                return self._round_replies.reply(
                    pull, request.wire_dtype, False, region, refused, pending=self._layout.pending
                )
        if request.progress is not None:
            with store.lock:
                self._data.check(worker, request.progress)
        dropped = aggregator.push(
            worker,
            request.step,
            request.grads,
            rows=request.rows,
            count_drop=request.end_of_step,
            wait=bool(pull) or request.end_of_step,
            progress=request.progress,
        )
        with store.lock:
            duplicate = ledger.is_duplicate(worker, request.push_id)
            if not dropped and not duplicate:
                ledger.record(worker, request.push_id, request.end_of_step)
            return self._round_replies.reply(
                pull, request.wire_dtype, dropped, region, refused, pending=self._layout.pending
            )

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

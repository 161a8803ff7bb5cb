"""The synchronous path of PushPull: a push joins its step's round, and its reply reads what the round left.

:class:`SyncPushes` takes what :class:`~psframe.ps.service.push_pull_handler.PushPullHandler`
hands it in synchronous training: a push joins its step's round of the
barrier (:mod:`psframe.ps.protocol.sync`), and a request that pulls (or ends
the worker's step) is answered once the round is applied; a push of rows of
tables declared asynchronous (``SyncReplicas(async_tables=...)``) is checked
here and applied at once by the handler.

Every member of a round is released at once, to read the same variables at
the same version (:class:`RoundReplies`). A member on another host gets a
message: the first to answer encodes it and the others send the same bytes
(the step goes on when the last worker has its reply, so this takes one
encode, and a wait for the store's lock, out of every step's critical path).
A member on the ps task's host that gave its request a shared region
(:mod:`psframe.wire.same_host`) gets the values written into that region and
a header alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from psframe import errors
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.sync import SyncAggregator
from psframe.ps.service.push_pull_request import PushPullRequest, outgoing
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion


class Pending(Protocol):
    """Says whether a re-layout is asked for or under way."""

    pending: bool  # a plain attribute: every reply reads it, without a lock


class SyncPushes:
    """The synchronous PushPull requests of ps task ``task_name``, answered over its store.

    Args:
        store: the variables.
        ledger: each worker's pushes applied (a round counts a worker's step once).
        data: the data ranges the pushes consumed.
        model: the synchronous rounds (:attr:`ServedModel.aggregator`).
        layout: says whether a re-layout is asked for or under way (its ``pending``), in every reply.
        task_name: the task, for the errors.
    """

    def __init__(
        self,
        store: VariableStore,
        ledger: PushLedger,
        data: RangeQueue,
        model: ServedModel,
        layout: Pending,
        *,
        task_name: str,
    ) -> None:
        self._store, self._ledger, self._data, self._model = store, ledger, data, model
        self._layout, self._task_name = layout, task_name
        self._round_replies = RoundReplies(store)

    def check_async_rows(self, request: PushPullRequest) -> None:
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

    def join_round(
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
            span=request.span,
        )
        with store.lock:
            duplicate = ledger.is_duplicate(worker, request.push_id)
            if not dropped and not duplicate:
                ledger.record(worker, request.push_id, request.end_of_step)
            return self._round_replies.reply(
                pull, request.wire_dtype, dropped, region, refused, pending=self._layout.pending
            )


class RoundReplies:
    """The replies to pushes the sync barrier released, for the version they read."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        # Encoded replies of the current version only: those of the last round.
        self._released: tuple[tuple, dict[tuple, bytes]] = ((), {})
        self._laid_out = ReplyLayouts()

    def reply(
        self,
        pull: list[str],
        wire_dtype: torch.dtype | None,
        dropped: bool,
        region: SameHostRegion | None = None,
        refused: str = "",
        *,
        pending: bool = False,
    ) -> bytes:
        """A released member's reply (the caller holds the store's lock): in ``region`` where
        the member gave one, else a message, saying why its region was ``refused`` if it was,
        and whether a re-layout is ``pending`` (``PushPullReplyHeader.relayout_pending``)."""
        store = self.store
        if region is not None and wire_dtype is None:
            layout, buffers = self._laid_out.of(pull, store.read(pull), store.generation)
            if region.fits_reply(layout):
                region.write_reply(layout, buffers)
                header = pb.PushPullReplyHeader(
                    global_step=store.global_step, dropped=dropped, relayout_pending=pending, in_region=True
                )
                return layout.encode_header(header)
        version = (store.version, store.global_step)
        kept_version, replies = self._released
        if kept_version != version:
            replies = {}
            self._released = (version, replies)
        key = (tuple(pull), wire_dtype, dropped, refused, pending)
        data = replies.get(key)
        if data is None:
            reply = pb.PushPullReplyHeader(
                global_step=store.global_step, dropped=dropped, region_refused=refused, relayout_pending=pending
            )
            if wire_dtype is None:  # the values' bytes laid out once, as for a region
                layout, buffers = self._laid_out.of(pull, store.read(pull), store.generation)
                data = replies[key] = layout.encode(reply, buffers)
            else:
                data = replies[key] = codec.encode(reply, outgoing(pull, store.read(pull), wire_dtype))
        return data


class ReplyLayouts:
    """The layouts of a round's replies of full precision, in a message or in a worker's shared
    region, with views of the variables they carry.

    They are made once per set of names and generation of the store's
    variables, as a :class:`~psframe.ps.service.push_pull_handler.CachedRequest`
    makes them for asynchronous requests.
    """

    def __init__(self) -> None:
        self._laid_out: dict[tuple[int, tuple[str, ...]], tuple[MessageEncoding, list]] = {}

    def of(self, pull: Sequence[str], values: Sequence[torch.Tensor], generation: int) -> tuple[MessageEncoding, list]:
        """The layout of a reply of ``values`` (the live variables named ``pull``) and their
        buffers (:meth:`MessageEncoding.buffers`). The caller holds the store's lock."""
        key = (generation, tuple(pull))
        laid_out = self._laid_out.get(key)
        if laid_out is None:
            layout = MessageEncoding(
                pb.PushPullReplyHeader, [(name, value.dtype, tuple(value.shape)) for name, value in zip(pull, values)]
            )
            # Only the current generation's layouts are kept: older variables are gone.
            self._laid_out = {k: v for k, v in self._laid_out.items() if k[0] == generation}
            laid_out = self._laid_out[key] = (layout, layout.buffers(values))
        return laid_out

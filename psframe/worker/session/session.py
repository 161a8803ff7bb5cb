"""The layout a worker trains on, one way to survive failures, and the values received.

A :class:`Session` holds the layout (the cluster, a client of its ps tasks, the model bound to
its placement) and makes the worker's calls to the ps tasks through :meth:`Session.call`, which
survives the two failures training goes on after, by one deadline (``connect_timeout`` from the
first failure):

- a ps task lost (unavailable, not ready, a call timed out): wait until the ps tasks are back
  (a restarted one restored from a checkpoint), join the model again, and try again;
- the ps tasks moved (a re-layout, or a stage of one): follow ps 0 to the layout they moved to
  (:func:`psframe.worker.session.relayout.follow`), switch to it, and try there.

A step's push is one such call (:meth:`Session.push_step`); sent again once lost ps tasks are
back, with the numbers it had (a ps task that applied one before answers it without applying it
twice: :mod:`psframe.ps.protocol.ledger`), or on the layout the ps tasks moved to, of that
layout's plan (nothing of it was applied before the move). In every reply read
(:meth:`Session.receive`) the replica takes the values, and the :attr:`~Session.global_step`
follows the training's rule: asynchronous, ``/job:ps/task:0`` keeps it (as in TF); synchronous,
the lowest over the ps tasks.

Joining the model (:func:`psframe.worker.session.startup.join`, following ps 0 where the ps
tasks moved before), the switch to a new layout with the hand-over of a step under way, and the
embedding tables' pulls of rows for their lookups are here too.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from psframe.cluster import ClusterSpec
from psframe.cluster.placement import ShardPlacement
from psframe.errors import (
    ClusterMismatchError,
    LayoutChangedError,
    NotReadyError,
    PsframeError,
    RpcTimeoutError,
    TaskUnavailableError,
)
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.tables.rows import RowPull
from psframe.worker.client import control_calls, relayout_calls
from psframe.worker.client.operations import DenseReply
from psframe.worker.client.ps_client import PsClient
from psframe.worker.client.streams import Exchange
from psframe.worker.model.replica import Replica
from psframe.worker.model.tables import EmbeddingTables
from psframe.worker.plan.step_plan import Request
from psframe.worker.session import relayout, startup
from psframe.worker.session.layout_maker import LayoutMaker
from psframe.worker.session.stats import Counters

log = logging.getLogger(__name__)

T = TypeVar("T")
# A ps task lost: the worker waits for it to come back, then goes on.
LOST = (TaskUnavailableError, NotReadyError, RpcTimeoutError)
# How long closing waits for the client of a layout before to close (it closes in a thread of its own).
CLOSE_WAIT_SECONDS = 10.0
# A step's push: the requests sent (of the plan of the layout they went to), their replies, rows prefetched.
Sent = tuple[tuple[Request, ...], list[DenseReply], dict[int, list[torch.Tensor]]]


class Retry(enum.Enum):
    """Why an attempt is made again."""

    LOST = "lost"  # the lost ps tasks are back: the same call again (pushes sent again keep their numbers)
    MOVED = "moved"  # on the layout the ps tasks moved to


@dataclass(frozen=True)
class Attempt:
    """One try of a call: the client and the replica of the layout it is made on, and why it is
    made again (None: the first try)."""

    client: PsClient
    replica: Replica
    retry: Retry | None = None


@dataclass(frozen=True)
class SessionSettings:
    """What a worker tells the ps tasks of the model when it joins, and how long it waits."""

    task_index: int
    is_chief: bool
    optimizer: OptimizerSpec
    table_optimizer: OptimizerSpec | None
    sync: SyncReplicas | None  # as given: resolved at each join, for the workers then
    checkpoint_dir: str | None
    async_tables: frozenset[str]  # sync: tables applied at once (variable names)
    timeout: float  # connect_timeout: a join, a recovery, a follow


class Session:
    """The layout a worker trains on, and its calls to the ps tasks.

    Args:
        maker: makes the layouts of the model.
        cluster: the cluster the worker starts on.
        replica: the model bound to its placement there.
        settings: what joining tells the ps tasks.
        sync: the sync settings resolved for ``cluster`` (until a join resolves them again; None,
            asynchronous training, stays None).
        pulled: called after every pull of all the values (in-graph replication: the other
            replicas take them).
        counters: where recoveries, re-layouts followed, rows pulled, steps dropped as late and
            steps ahead of the slowest worker are counted.
        max_stage_bytes: the most bytes a stage of a re-layout moves.
        switched: called with the replica of each layout the session switches to, once it
            trains there (the worker's parts bound to the replica before follow).
    """

    def __init__(
        self,
        maker: LayoutMaker,
        cluster: ClusterSpec,
        replica: Replica,
        settings: SessionSettings,
        *,
        sync: SyncReplicas | None,
        pulled: Callable[[], None],
        counters: Counters,
        max_stage_bytes: int,
        switched: Callable[[Replica], None],
    ) -> None:
        self.layouts = relayout.Layouts(maker.place, maker.layout, max_stage_bytes)
        self.cluster, self.replica, self.sync = cluster, replica, sync
        self._maker, self._settings, self._counters, self._switched = maker, settings, counters, switched
        self._sync_training, self._pulled = sync is not None, pulled
        self.global_step = 0  # of the values last received
        self._client: PsClient | None = None
        self._closing: list[threading.Thread] = []  # the clients of layouts before, closing
        self.name = f"worker {settings.task_index}"  # in the log

    @property
    def client(self) -> PsClient:
        """The client of the ps tasks, made by :meth:`open`."""
        if self._client is None:
            raise PsframeError("the trainer is not connected: call connect() first, or use it in a with block")
        return self._client

    @property
    def placement(self) -> ShardPlacement:
        """Which ps task holds each shard, on the layout of the moment."""
        return self.replica.placement

    def relayout_settings(self, sync: SyncReplicas | None) -> relayout.Settings:
        """What the ps tasks of a new layout are told of the model, with ``sync``."""
        settings = self._settings
        return relayout.Settings(settings.optimizer, settings.table_optimizer, sync, settings.timeout)

    # ---- the session's life

    def open(self) -> None:
        """Make the client of the ps tasks."""
        self._client = self._maker.client(self.cluster)

    def attach(self) -> None:
        """The model's embedding tables look their rows up through :meth:`pull_rows` from now on
        (on every layout the session switches to)."""
        self.replica.tables.attach(self.pull_rows)

    def finish(self) -> None:
        """Tell the ps tasks this worker is done (where they moved, if they did since its last call)."""
        self.call(lambda at: control_calls.finish(at.client), lost=False)

    def close(self) -> None:
        """Release the channels; wait (a while) for those of the layouts before."""
        if self._client is not None:
            self._client.close()
        for closing in self._closing:  # each close ends by its calls' deadlines
            closing.join(CLOSE_WAIT_SECONDS)

    # ---- joining

    def join(self, connecting: bool = False, deadline: float | None = None) -> None:
        """Join the model on the ps tasks (:func:`startup.join`); where they moved (a re-layout, or
        a stage of one, taken before or meanwhile), follow ps 0 there; all by ``deadline``
        (``time.monotonic()``; default: ``connect_timeout`` from now). ``connecting``: the worker
        has not trained yet (nothing of a step to hand over)."""
        deadline = time.monotonic() + self._settings.timeout if deadline is None else deadline
        while True:
            try:
                self._join_layout(deadline)
                return
            except ClusterMismatchError:
                # Started with the ps tasks of before a re-layout (flags not yet updated), or the
                # ps tasks took a stage of one meanwhile: follow ps 0.
                status = relayout_calls.layout_status(self.client)
                if status.cluster is None or not status.moved:
                    raise
                if status.cluster.job_tasks("worker") != self.cluster.job_tasks("worker"):
                    raise
                if time.monotonic() >= deadline or self.layouts.where(status) == (self.cluster, self.placement):
                    raise
            layout = self.layouts.of(status)
            log.info(
                "%s: the ps tasks moved to %s%s; following them",
                self.name,
                layout.cluster.job_tasks("ps"),
                f" (stage {status.stage.stage} of {status.stage.stages} of a re-layout)" if status.stage else "",
            )
            if not connecting:  # training: its tables, prefetches and overlap follow too
                self.switch_to(layout, pull=False)
                continue
            self.client.close()
            self._client, self.replica, self.cluster = layout.client, layout.replica, layout.cluster
            self._counters.relayouts += layout.final

    def _join_layout(self, deadline: float) -> None:
        settings = self._settings
        self.client.async_parts = self._async_parts(self.replica)
        self.sync = startup.join(
            self.client,
            self.replica,
            is_chief=settings.is_chief,
            optimizer=settings.optimizer,
            sync=settings.sync,
            checkpoint_dir=settings.checkpoint_dir,
            deadline=deadline,
            table_optimizer=settings.table_optimizer,
            global_step=self.global_step,
            resume=self._resume_relayout,
        )

    def _async_parts(self, replica: Replica) -> frozenset[str]:
        return frozenset(slot.name for slot in replica.slots if slot.shard.variable in self._settings.async_tables)

    def _resume_relayout(self, sync: SyncReplicas | None) -> None:
        """The chief, connecting: finish a re-layout (or its stage) its run before had begun
        (:func:`relayout.resume`); its next stages follow at the next steps.

        Raises:
            ClusterMismatchError: the ps tasks are at another layout than this chief's: it follows them.
        """
        status = relayout_calls.layout_status(self.client)
        if status.moving and self.layouts.where(status) != (self.cluster, self.placement):
            stage = status.stage
            assert stage is not None
            raise ClusterMismatchError(
                f"the ps tasks are at stage {stage.stage} of {stage.stages} of a re-layout, not at this "
                f"chief's placement"
            )
        current = relayout.Layout(self.cluster, self.client, self.replica)
        relayout.resume(current, self.relayout_settings(sync), status)

    # ---- calls, and what they survive

    def call(
        self,
        attempt: Callable[[Attempt], T],
        *,
        pull: bool = False,
        lost: bool = True,
        moved: bool = True,
        then: str = "pulling the parameters",
    ) -> T:
        """``attempt`` on the layout of the moment; made again after the failures training goes
        on after, all by one deadline (``connect_timeout`` from the first failure):

        - a lost ps task (with ``lost``): wait until the ps tasks are back and join the model
          again (with ``pull``, take its values afresh, gradients dropped), then ``attempt``
          again (:attr:`Retry.LOST`); ``then`` says what, in the log;
        - the ps tasks moved (with ``moved``): follow them to the layout they moved to (with
          ``pull``, take its values), then ``attempt`` there (:attr:`Retry.MOVED`).

        Raises:
            ConnectTimeoutError: the ps tasks did not come back, or the new layout did not hold
                the model, by the deadline.
            PsframeError: ``attempt`` kept failing until the deadline, or failed otherwise.
        """
        failure: PsframeError | None = None
        retry: Retry | None = None
        deadline = 0.0
        recovered = False
        while True:
            try:
                if isinstance(failure, LayoutChangedError):
                    self._follow(failure, pull, deadline)
                elif failure is not None:
                    self._wait_for_lost(failure, then, pull, deadline)
                    recovered = True
                result = attempt(Attempt(self.client, self.replica, retry))
            except LOST as e:
                if not lost or (failure is not None and time.monotonic() >= deadline):
                    raise
                failure, retry = e, Retry.LOST
            except LayoutChangedError as e:
                if not moved or (failure is not None and time.monotonic() >= deadline):
                    raise
                failure, retry = e, Retry.MOVED
            else:
                self._counters.recoveries += recovered
                return result
            if not deadline:
                deadline = time.monotonic() + self._settings.timeout

    def _wait_for_lost(self, error: PsframeError, then: str, pull: bool, deadline: float) -> None:
        """Wait for the lost ps tasks (logging whom it waits for) and join the model again; with
        ``pull``, take the current values (restored from a checkpoint, or the chief's)."""
        log.warning(
            "%s: %s; waiting up to %.0fs for the ps tasks, then %s",
            self.name,
            error,
            self._settings.timeout,
            then,
        )
        self.client.reset_streams()
        # A restarted ps restores its shard from the checkpoint (or, with
        # none, takes the chief's current values); the others ignore the chief.
        self.join(deadline=deadline)
        if pull:
            self.replica.clear_gradients()
            self.pull_values()
            log.info("%s: the ps tasks are back; going on at global step %d", self.name, self.global_step)

    def _follow(self, error: LayoutChangedError, pull: bool, deadline: float) -> None:
        """Train on the layout ps 0 moved to (:func:`relayout.follow`), and with ``pull`` take its
        values; by ``deadline`` (``time.monotonic()``).

        Raises:
            ConnectTimeoutError: the new layout did not hold the model by the deadline.
        """
        log.info("%s: %s", self.name, error)
        start = time.monotonic()
        while True:
            layout = relayout.follow(self.client, self.layouts.of, self.sync, max(0.1, deadline - time.monotonic()))
            try:
                self.switch_to(layout, pull)
                break
            except LayoutChangedError:  # moved again before the pull: follow on
                if time.monotonic() >= deadline:
                    raise
        log.info(
            "%s: follows the re-layout to ps tasks %s%s in %.3f s",
            self.name,
            layout.cluster.job_tasks("ps"),
            "" if layout.stage is None else f" (stage {layout.stage.stage} of {layout.stage.stages})",
            time.monotonic() - start,
        )

    def switch_to(self, layout: relayout.Layout, pull: bool = True, let_go: Callable[[], None] | None = None) -> None:
        """Train on ``layout`` from now on: its client and placement, the step under way handed
        over; pull its values. The client of before is closed in a thread of its own: its streams
        and channels take milliseconds to close, which training need not wait for. ``let_go``:
        called in that thread first (a chief's stage: :func:`relayout.let_go`)."""
        old = self.client

        def close_before() -> None:
            if let_go is not None:
                let_go()
            old.close()

        self._closing = [c for c in self._closing if c.is_alive()]
        self._closing.append(threading.Thread(target=close_before, name="psframe-close-layout-before", daemon=True))
        self._closing[-1].start()
        before = self.replica.tables
        state = before.step_state()  # before detaching, which starts the tables afresh
        before.detach()
        client, replica = layout.client, layout.replica
        client.take_progress(old)  # a step sent again there still says how far it read
        self._client, self.replica, self.cluster = client, replica, layout.cluster
        client.async_parts = self._async_parts(replica)
        replica.tables.attach(self.pull_rows)
        replica.tables.take_over(before, state)  # once attached: attaching starts the tables afresh
        self._switched(replica)
        self._counters.relayouts += layout.final
        if pull:
            self.pull_values()

    # ---- a step, and the values received

    def push_step(
        self,
        pushed: bool,
        row_gradients: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None],
        prefetch: Mapping[int, Sequence[RowPull]],
        exchange: Exchange | None = None,
    ) -> tuple[bool, dict[int, list[torch.Tensor]]]:
        """One step's push (``pushed`` False: its pull) as a :meth:`call` (see the module), and the
        values received; with the tables' ``row_gradients``, the rows to ``prefetch`` behind it, and
        the ``exchange`` of the requests sent during backward (``overlap_backward``).

        Returns:
            Whether a reply says the step was dropped as late; the rows prefetched.
        """
        computed_at = self.global_step  # the step the gradients were computed at (sync: their round)
        sync = self._sync_training

        def attempt(at: Attempt) -> Sent:
            replica, client = at.replica, at.client
            requests = replica.plan.step if pushed else replica.plan.pull
            if exchange is not None and at.retry is None:  # some requests went during backward; the rest now
                return requests, client.finish_step(exchange), {}
            rows = None
            if pushed and replica.has_tables:
                rows = replica.tables.cut(row_gradients, every_table=sync, except_tables=self._settings.async_tables)
            # The gradients each request carries (views, no copies on a CPU replica).
            sent = [(r, replica.gradients(r) if pushed else ()) for r in requests]
            if at.retry is None:
                replies, prefetched = client.push_pull_and_prefetch(
                    sent, computed_at, prefetch, rows=rows, pulls_with_pushes=not sync
                )
                return requests, replies, prefetched
            # Sent again with its numbers on the client that first sent it; a client the rejoin made
            # anew (the ps tasks had moved meanwhile) never numbered this step: it goes there fresh.
            again = at.retry is Retry.LOST and client.push_numbers.holds_a_step
            replies, _ = client.push_pull_and_prefetch(sent, computed_at, {}, rows=rows, again=again)
            if again:
                log.info(
                    "%s: the ps tasks are back; step %d sent again (%d of its pushes had been applied before)",
                    self.name,
                    computed_at,
                    sum(reply.duplicate for reply in replies),
                )
            return requests, replies, {}

        requests, replies, prefetched = self.call(attempt, then=f"sending step {computed_at}'s pushes again")
        return self.receive(requests, replies), prefetched

    def receive(self, requests: Sequence[Request], replies: Sequence[DenseReply]) -> bool:
        """The replica takes the values of ``replies`` (to ``requests``); the global step follows
        them (see the module). Returns whether a reply says its gradients were dropped as late."""
        self.replica.assign(requests, replies)
        sync, dropped, ahead, steps = self._sync_training, False, -1, []
        for request, reply in zip(requests, replies):
            dropped = dropped or reply.dropped
            if request.end_of_step and reply.steps_ahead > ahead:
                ahead = reply.steps_ahead
            # Async: global_step lives on /job:ps/task:0, as in TF. Sync: every ps advances in
            # lockstep, but a reply may have been read just before a shard caught up; tagging the
            # next push with the lowest step makes a gradient computed on mixed versions stale
            # everywhere, never applied. A push-only request's answer carries the step before the
            # update: skipped.
            if request.pull and (sync or request.ps_task == 0):
                steps.append(reply.global_step)
        if not sync and ahead >= 0:  # how far ahead of the slowest live worker this step found this one
            self._counters.steps_ahead[ahead] += 1
        self._counters.dropped_steps += dropped
        if steps:
            self.global_step = min(steps) if sync else max(steps)
        return dropped

    def pull_values(self) -> None:
        """Every variable's current value into the replica, exactly (uncompressed, whatever the wire dtype)."""
        requests = self.replica.plan.pull
        replies = self.client.push_pull([(r, ()) for r in requests], self.global_step, compress=False)
        self.receive(requests, replies)
        self._pulled()

    # ---- the embedding tables' lookups

    def pull_rows(self, wanted: Mapping[int, Sequence[RowPull]], create: bool = True) -> dict[int, list[torch.Tensor]]:
        """Rows of embedding tables for a lookup (see :mod:`psframe.worker.model.tables`); a lost
        ps task is waited for, as in a step, and the rows asked of it again; parts that moved
        are read where they went."""
        before = self.replica.tables

        def attempt(at: Attempt) -> dict[int, list[torch.Tensor]]:
            if at.replica.tables is before:
                return at.client.pull_rows(wanted, self.global_step, create)
            # Asked of the parts before a re-layout: read where they went.
            return {ps_task: [self._rows_moved(before, asked) for asked in pulls] for ps_task, pulls in wanted.items()}

        pulled = self.call(attempt, pull=True)
        self._counters.rows_pulled += sum(int(rows.shape[0]) for answers in pulled.values() for rows in answers)
        return pulled

    def _rows_moved(self, before: EmbeddingTables, asked: RowPull) -> torch.Tensor:
        """A lookup's pull of a part placed before a re-layout, answered from the new layout."""
        name, ids = asked
        return self.replica.tables.rows_moved(
            before, name, ids, lambda wanted, create: self.client.pull_rows(wanted, self.global_step, create)
        )

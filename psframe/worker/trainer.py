"""``psframe.Trainer``: trains a replica of a ``torch.nn.Module`` against the ps tasks.

Lifecycle (``with trainer:`` or :meth:`Trainer.connect` / :meth:`Trainer.close`)::

    NEW --connect()--> RUNNING --close()--> CLOSED
          chief: create the variables on the ps tasks (or take up those there)
          others: wait until the ps tasks hold the model
          all: pull the parameters into the local model

Each :meth:`Trainer.step` runs backward, sends every ps task the gradients of
the variables it holds and receives their updated values in the same call,
to all ps tasks in parallel.

The trainer holds the lifecycle, the step and what callers do; its arguments, its parts
(each readable alone) and its read-only properties are its setup
(:mod:`psframe.worker.trainer_setup`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from psframe import checkpoint
from psframe.cluster import ClusterSpec
from psframe.config.options import DataRanges
from psframe.errors import DataRangeLostError, PsframeError, TaskStopped
from psframe.streams.source import StreamRecord, StreamSource
from psframe.worker.client import control_calls
from psframe.worker.client.streams import Exchange
from psframe.worker.leaving import LeaveOnSigterm, leave_on_sigterm
from psframe.worker.model.overlap import BackwardOverlap
from psframe.worker.session import metric_reporter
from psframe.worker.session.data_reader import Outcome
from psframe.worker.session.in_graph import Losses, Steps
from psframe.worker.session.session import Attempt
from psframe.worker.session.stream_reader import stream_batches
from psframe.worker.trainer_setup import TrainerSetup

log = logging.getLogger(__name__)


class TrainerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


class Trainer(TrainerSetup):
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

    _state = TrainerState.NEW
    _stop_requested = False
    _leaving: LeaveOnSigterm | None = None  # SIGTERM noted while connected (psframe.worker.leaving)
    # What a step does with its losses, chosen once connected: one loss goes straight to _step;
    # in-graph replicas take theirs first (psframe.worker.session.in_graph).
    _step_losses: Steps

    @property
    def state(self) -> TrainerState:
        """new (not connected yet), running, or closed."""
        return self._state

    # ---- lifecycle

    def connect(self) -> Trainer:
        """Connect to the ps tasks, create or wait for the model, pull parameters.

        Raises:
            ConnectTimeoutError: a ps task (or the model) did not come up in time.
            ClusterMismatchError: a ps task holds another model or cluster.
        """
        if self._state is not TrainerState.NEW:
            raise PsframeError(f"the trainer is {self._state.value}; connect() is called once")
        session = self._session
        session.open()
        self._state = TrainerState.RUNNING
        try:
            session.join(connecting=True)
            self._step_losses = self._replicas.steps(
                self._step, sync=session.sync is not None, recorded=self._feed.recorded
            )
            self.pull()
            session.attach()
            self._start_overlap()
            log.info(
                "worker %d connected to %d ps tasks at global step %d",
                self._task_index,
                session.cluster.num_ps,
                self.global_step,
            )
            for hook in self._hooks:
                hook.begin(self)
            self._leaving = leave_on_sigterm(
                f"worker {self._task_index}", lambda: control_calls.finish(self._session.client)
            )
        except BaseException:
            # Never started training: release the channels, report nothing.
            self._close_overlap()
            session.replica.tables.detach()
            session.close()
            self._state = TrainerState.CLOSED
            raise
        return self

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
            self._close_overlap()
            self._session.replica.tables.detach()
            self._replicas.close()
            self._session.finish()
            self._session.close()
            self._state = TrainerState.CLOSED
            if self._leaving is not None:  # SIGTERM's default action again
                leaving, self._leaving = self._leaving, None
                leaving.disarm()  # raises TaskStopped for a SIGTERM that came as the worker closed
        if failure is not None:
            raise failure

    def __enter__(self) -> Trainer:
        return self.connect()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, (KeyboardInterrupt, TaskStopped)):  # no failure: Ctrl-C or SIGTERM, which goes on
            log.info("worker %d stopped (%s); telling the ps tasks", self._task_index, type(exc).__name__)
            try:
                self.close()
            except PsframeError as e:  # the ps tasks were interrupted too, as a terminal's Ctrl-C does
                log.warning("worker %d could not tell the ps tasks it stopped: %s", self._task_index, e)
            return
        if exc is not None:
            log.error("worker %d stops on %s: %s", self._task_index, type(exc).__name__, exc)
        self.close()

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

    # ---- training

    def step(self, loss: Losses = None) -> int:
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
            TaskStopped: SIGTERM came; this step was applied and is the last (:mod:`psframe.worker.leaving`).
        """
        self._require_running()
        global_step = self._step_losses(loss)
        leaving = self._leaving
        if leaving is not None and leaving.asked:  # SIGTERM came: this step was the last (psframe.worker.leaving)
            leaving.check()
        return global_step

    def _step(self, loss: Losses, run_backward: bool = True) -> int:
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError("step() takes a list of losses only with replica_devices (in-graph replication)")
        for hook in self._before_step:
            hook.before_step(self)
        exchange = None
        if run_backward and loss is not None:
            if self._overlap is None:
                loss.backward()
            else:
                exchange = self._backward_overlapped(loss, self._overlap)
        for hook in self._before_push:
            hook.before_push(self, loss)
        counters, session, feed = self._counters, self._session, self._feed
        replica = session.replica
        tables = replica.tables if replica.has_tables else None  # none: nothing of them here
        if tables is not None:
            tables.drop_prefetched()  # rows pulled ahead for this step's lookups, not taken
        row_gradients: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        pushed = replica.has_gradients()
        if pushed and tables is not None:
            row_gradients = tables.take_row_gradients()
        elif not pushed:  # nothing was sent during backward either: no parameter had a gradient
            counters.skipped_steps += 1
            exchange = None
        if exchange is not None:
            counters.sent_during_backward += exchange.sent_early
        prefetch = self._prefetcher.requests() if tables is not None else {}
        try:
            try:
                dropped, prefetched = session.push_step(pushed, row_gradients, prefetch, exchange)
            except DataRangeLostError as e:
                feed.lost(e)  # raised again unless a batch of read() is out
                counters.dropped_steps += 1
                self.pull()  # the current values; read() asks for another range
                prefetched = {}
            else:
                applied = pushed and not dropped
                counters.pushed_steps += applied
                if feed.reading:  # a batch of read() is out: what became of it
                    feed.outcome(Outcome.APPLIED if applied else Outcome.AGAIN)
            if tables is not None:
                self._prefetcher.deliver(prefetched)
                counters.rows_pulled += sum(rows.shape[0] for answers in prefetched.values() for rows in answers)
        finally:
            if tables is not None:
                self._prefetcher.drop()
        counters.local_step += 1
        for hook in self._after_step:
            hook.after_step(self, session.global_step, loss)
        leader = self._leader
        if leader is not None:  # the chief: when to lead a re-layout (psframe.worker.relayout_leader)
            word = leader.word
            due = word.pending or leader.following or (not word.heard and time.monotonic() >= leader.next_poll)
            word.heard = word.pending = False
            if due:
                leader.lead()
        return session.global_step

    def _backward_overlapped(self, loss: torch.Tensor, overlap: BackwardOverlap) -> Exchange:
        """Run backward on ``loss`` while the step's requests whose gradients are complete are
        sent (``overlap_backward``); the step's exchange."""
        replica = self._session.replica
        requests = replica.plan.step
        exchange = self._session.client.begin_step(requests, self.global_step, lambda i: replica.gradients(requests[i]))
        overlap.begin(exchange)
        try:
            loss.backward()
        finally:
            overlap.end()
        return exchange

    def pull(self) -> int:
        """Copy the current values of the model's variables into the local model, exactly
        (uncompressed, whatever the ``wire_dtype``).

        Every dense variable is copied whole. An embedding table never travels whole: its
        local weight gets the current value of each row this worker looked up since
        :meth:`connect` (the rows it holds), and keeps the rows it never looked up as they
        were. A dynamic table has no local weight
        (each lookup pulls its rows).

        Returns:
            The global step of the values received.
        """
        self._require_running()
        session = self._session

        def attempt(at: Attempt) -> None:
            if at.retry is None:  # a lost ps task waited for, or a move followed: the values were pulled there
                session.pull_values()
            at.replica.tables.refresh(lambda wanted, create: at.client.pull_rows(wanted, session.global_step, create))

        session.call(attempt, pull=True)
        return self.global_step

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
        self._prefetcher.add(self._session.replica.tables, table, ids)

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
        yield from self._feed.read(ranges)

    def stream(self, source: StreamSource, batch_size: int, **options: Any) -> Iterator[list[StreamRecord]]:
        """This worker's batches of a stream: each record trained once across the workers, kills
        and restores (:mod:`psframe.streams`; asynchronous training). A batch is up to ``batch_size``
        records of one partition, in order; its step commits their offsets on ps 0 with its update.
        Options: :func:`~psframe.worker.session.stream_reader.stream_batches`'s (``idle_timeout``...).
        """
        self._require_running()
        yield from stream_batches(self._feed, self._session, source, batch_size, **options)

    # ---- a live re-layout (psframe.ps.elastic.relayout), and checkpoints

    def reshard(self, cluster: ClusterSpec | Mapping[str, Sequence[str]]) -> float:
        """Move the model to the ps tasks of ``cluster`` now, while training goes on (chief only).

        As a tool's ``relayout_calls.ask_reshard`` does from outside: ps tasks added at the end of
        the ps list (started with ``cluster``, empty) or the last ones drained (they stop).
        The parts move in stages (:mod:`psframe.cluster.moves`), each a cut of its own; the other
        workers follow each at their next step, and train between two. This call returns once
        every stage is taken (asked through ``relayout_calls.ask_reshard``, the chief takes one stage
        per step instead). ``stats.relayout_pauses`` holds the pause of each stage.

        Returns:
            The seconds training paused, all stages together: each from its cut until the layout
            after it held the model.

        Raises:
            ClusterSpecError: the re-layout cannot be taken live (the reason says what to do instead).
        """
        self._require_running()
        if self._leader is None:
            raise PsframeError(f"the chief (worker 0) leads a re-layout; this is worker {self._task_index}")
        return self._leader.reshard(cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster))

    def report_metric(self, value: float) -> int:
        """Step the ps tasks' ``ReduceLROnPlateau`` schedules with ``value`` (a validation loss, say), as
        ``scheduler.step(value)`` would in one process (chief): every ps task counts it from this
        worker's :attr:`global_step` on (:mod:`psframe.worker.session.metric_reporter`).

        Returns:
            The global step from which the ps tasks count it.

        Raises:
            PsframeError: not the chief, or the optimizer has no ``ReduceLROnPlateau`` schedule.
        """
        self._require_running()
        return metric_reporter.report_metric(self._session, value, self._task_index)

    def save_checkpoint(self) -> checkpoint.Manifest:
        """Have every ps task save its shard, then commit the checkpoint (chief).

        Returns:
            The committed checkpoint's manifest.

        Raises:
            CheckpointError: no checkpoint_dir, or a ps task could not write.
        """
        self._require_running()
        return self._checkpointer.save()

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
        return self._checkpointer.save_delta()

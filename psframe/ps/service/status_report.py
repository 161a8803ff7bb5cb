"""What a ps task reports of itself (GetInfo, ``psframe status``), read from its parts.

:func:`task_info` only reads: the model and its counters, the workers and
their pushes, the data sets, the re-layouts. The model, the step and the
re-layout are read under the store's lock, so a report sees the model whole
or not at all (Init makes it, with its definitions, under the same lock).
"""

from __future__ import annotations

import threading
import time

from psframe.ps.elastic.relayout import Relayout
from psframe.ps.protocol.data_ranges import RangeQueue
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import StalenessGate
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import messages
from psframe.wire import psframe_pb2 as pb


def task_info(
    info: pb.TaskInfo,
    *,
    store: VariableStore,
    model: ServedModel,
    roster: WorkerRoster,
    ledger: PushLedger,
    staleness: StalenessGate,
    data: RangeQueue,
    relayout: Relayout,
    over: threading.Event,
    checkpoint_dir: str | None,
    max_workers: int | None,
) -> pb.TaskInfo:
    """``info`` (what every task says of itself) filled in with what a ps task reports.

    Args:
        info: the task's own part (job, index, address, cluster, version).
        store, model: the variables, their definitions and the synchronous rounds.
        roster, ledger: the workers heard from and their pushes applied here.
        staleness: how far ahead each asynchronous step found its worker.
        data: the data sets read in ranges.
        relayout: the re-layouts taken and under way.
        over: set once training is over.
        checkpoint_dir: where the task restores from, if anywhere.
        max_workers: the worker slots of an elastic cluster; None for a fixed one.
    """
    with store.lock:
        if over.is_set():
            info.state = pb.TaskInfo.FINISHED
        elif not store.ready:
            info.state = pb.TaskInfo.WAITING_FOR_MODEL
        info.global_step = store.global_step
        info.variables.extend(model.defs)
        info.bytes_held = store.nbytes()
        if store.optimizer_spec is not None:
            info.optimizer.CopyFrom(messages.optimizer_to_proto(store.optimizer_spec))
        if store.table_optimizer_spec is not None:
            info.table_optimizer.CopyFrom(messages.optimizer_to_proto(store.table_optimizer_spec))
        info.applied_steps = sum(ledger.applied_steps(w) for w in range(ledger.num_workers))  # with the step
        info.rejected_pushes = store.rejected_pushes
        info.finished_workers.extend(roster.finished)
        if model.sync_def is not None:
            info.sync.CopyFrom(model.sync_def)
        if model.aggregator is not None:
            info.dropped_gradients = model.aggregator.dropped_gradients
        elif any(staleness.counts):
            info.steps_ahead_counts.extend(staleness.counts)
        info.restored_step = model.restored_step
        info.checkpoint_dir = checkpoint_dir or ""
        if max_workers is not None:
            info.max_workers = max_workers
        layout = relayout.reply()
        info.reshard_to, info.layout_version = layout.cluster_spec, layout.layout_version
        info.relayouts = relayout.relayouts
        if relayout.under_way:
            info.move_stage.CopyFrom(layout.stage)
        for name, counts in sorted(store.dynamic_counts().items()):
            info.dynamic_tables.add(name=name, **counts)
    out = data.ranges_out()
    for name, (consumed, total) in sorted(data.counts().items()):
        info.data_sets.add(name=name, consumed=consumed, total=total, ranges_out=out.get(name, 0))
    for name, (applied, readers) in data.streams.report().items():
        info.streams.add(name=name, applied=applied, readers=readers)
    now = time.monotonic()
    for change in roster.changes:
        info.membership.add(
            worker=change.worker,
            kind=pb.MembershipChange.Kind.Value(change.change.name),
            global_step=change.global_step,
            seconds_ago=now - change.when,
        )
    for worker, seconds_ago, done in roster.seen():
        info.workers.add(
            task_index=worker,
            seconds_ago=seconds_ago,
            finished=done,
            applied_steps=ledger.applied_steps(worker),
            last_push_id=ledger.last_push(worker),
        )
    return info

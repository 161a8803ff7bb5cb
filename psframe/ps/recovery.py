"""A ps task's part in checkpoints: writing its shard, and restoring from one.

The format itself (files, manifest, checksums) is :mod:`psframe.checkpoint.files`
and the shard record :mod:`psframe.checkpoint.shard`; this module turns a
:class:`VariableStore` into a shard and back, including onto a different
partitioning when the number of ps tasks changed. It is also where records
meet wire messages: :class:`VariableData` and :class:`SyncData` share their
field names with ``pb.VariableDef`` and ``pb.SyncDef``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from psframe.checkpoint import deltas
from psframe.checkpoint import files as checkpoint_io
from psframe.checkpoint.dynamic import dynamic_parts_of, gather
from psframe.checkpoint.shard import OptimizerData, ShardData, SyncData, VariableData
from psframe.checkpoint.slices import slice_rows, strided_rows
from psframe.errors import CheckpointError
from psframe.optim import OptimizerSpec
from psframe.optim.lr_scheduler import ScheduleSpec
from psframe.ps.protocol.data_ranges import STATE_PREFIX
from psframe.ps.store import VariableStore
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What a ps task takes from a checkpoint."""

    step: int  # the checkpoint's id
    global_step: int
    defs: list[pb.VariableDef]
    optimizer: OptimizerSpec
    sync: pb.SyncDef | None
    values: dict[str, torch.Tensor]
    states: Mapping[str, Mapping[str, Any]]
    table_optimizer: OptimizerSpec | None = None  # of the embedding tables, if any
    dynamic: dict[str, dict] = field(default_factory=dict)  # dynamic table parts' exports, by name
    pushes: dict | None = None  # the workers' pushes the values hold (psframe.ps.protocol.ledger), if recorded
    num_shards: int = 0  # of the checkpoint it came from
    # Where the optimizers' learning-rate schedules stood, by optimizer (psframe.ps.store.schedules).
    schedules: dict[str, Any] = field(default_factory=dict)

    @property
    def tables(self) -> list[str]:
        return [d.name for d in self.defs if d.table and not d.HasField("dynamic")]


class PushRecord(Protocol):
    """What keeps the pushes a ps task's values hold: the push ledger, and the data they consumed."""

    def state_dict(self) -> dict[str, list[int]]: ...


def save_shard(
    store: VariableStore,
    defs: Sequence[pb.VariableDef],
    sync: pb.SyncDef | None,
    url: str,
    step: int,
    ps_task: int,
    num_shards: int,
    ledger: PushRecord | None = None,
    cut: Callable[[], None] | None = None,
) -> checkpoint_io.ShardRecord:
    """Write the store's variables, optimizer state and global step as one shard.

    Args:
        store: this ps task's variables (copied first, so pushes go on while
            the shard is written).
        defs: the variables the store holds, as the chief placed them.
        sync: the synchronous-training settings, or None when asynchronous.
        url: the checkpoint directory.
        step: the checkpoint's step.
        ps_task: this ps task's index.
        num_shards: the number of ps tasks.
        ledger: the workers' pushes applied (and the data they consumed), taken at the same
            instant as the values.
        cut: called under the store's lock right before the snapshot (a
            checkpoint's cut: it raises if pushes went past it).

    Returns:
        The record the chief commits in the manifest.

    Raises:
        CheckpointError: the shard cannot be written.
    """
    shard = snapshot_shard(store, defs, sync, ps_task, num_shards, ledger, cut, step=step)
    return checkpoint_io.write_shard(url, step, shard)


def snapshot_shard(
    store: VariableStore,
    defs: Sequence[pb.VariableDef],
    sync: pb.SyncDef | None,
    ps_task: int,
    num_shards: int,
    ledger: PushRecord | None = None,
    cut: Callable[[], None] | None = None,
    *,
    step: int | None = None,
    then: Callable[[], None] | None = None,
    copy: bool = True,
) -> ShardData:
    """The shard record of the store at one instant, in memory (:func:`save_shard` writes it).

    ``step``: the checkpoint it is for (a delta from it then holds what changes from
    now on); None: no checkpoint (a re-layout's). ``then``: called under the store's
    lock right after the snapshot, before a push can apply (a re-layout stops them).
    Without ``copy`` the record holds the store's own tensors: for a ``then`` that
    makes the store let go of them (a re-layout's cut clears it).

    Raises:
        CheckpointError: the store holds no model.
    """
    with store.lock:  # the values and the record of the pushes they hold, at one instant
        if cut is not None:
            cut()
        global_step, values, states = store.snapshot(copy=copy)
        pushes = None if ledger is None else ledger.state_dict()
        dynamic = store.export_dynamic()
        if step is not None:
            store.mark_snapshot(step)  # a delta from this checkpoint holds what changes from now on
        spec, table_spec = store.optimizer_spec, store.table_optimizer_spec
        schedules = store.schedules.state_dict()
        if then is not None:
            then()
    if spec is None:
        raise CheckpointError(f"ps task {ps_task} holds no model yet: there is nothing to save")
    return ShardData(
        global_step=global_step,
        ps_task=ps_task,
        num_shards=num_shards,
        optimizer=_optimizer_data(spec, schedules.get("optimizer")),
        sync=None if sync is None else _record(SyncData, sync),
        variables=tuple(
            _dynamic_record(d, dynamic[d.name])
            if d.HasField("dynamic")
            else _record(VariableData, d, value=values[d.name], state=states[d.name], dynamic=None)
            for d in defs
        ),
        table_optimizer=None if table_spec is None else _optimizer_data(table_spec, schedules.get("table_optimizer")),
        pushes=pushes,
    )


def save_delta_shard(
    store: VariableStore,
    url: str,
    step: int,
    parent: int,
    ps_task: int,
    num_shards: int,
    ledger: PushRecord | None = None,
    cut: Callable[[], None] | None = None,
) -> checkpoint_io.ShardRecord:
    """Write what the store changed since checkpoint ``parent`` as this task's shard of delta ``step``.

    The changed values, their optimizer state, the evicted ids, the global
    step and the pushes applied are all taken under the store's lock: one instant.

    Raises:
        CheckpointError: the store holds no snapshot of ``parent`` (made anew
            or restarted since): a full checkpoint is needed.
    """
    with store.lock:
        if cut is not None:
            cut()  # as for save_shard
        changes = store.changes_since(parent)
        pushes = None if ledger is None else ledger.state_dict()
        schedules = store.schedules.state_dict()
        store.mark_snapshot(step)
    delta = deltas.DeltaShard(
        global_step=changes.global_step,
        ps_task=ps_task,
        num_shards=num_shards,
        parent_step=parent,
        variables={name: (value, changes.states[name]) for name, value in changes.values.items()},
        rows={name: deltas.RowChanges(*rows) for name, rows in changes.rows.items()},
        dynamic=changes.dynamic,
        pushes=pushes,
        schedules=schedules,
    )
    return deltas.write_delta_shard(url, step, delta)


def restore_own_shard(url: str, ps_task: int, num_ps: int) -> Restored | None:
    """This task's shard of the latest valid checkpoint, if it was made by as many ps tasks.

    With another number of ps tasks the shard boundaries moved, and only the
    chief knows the new ones: :func:`restore_onto` does that once it says.

    Returns:
        What to restore, or None when there is no such checkpoint.

    Raises:
        CheckpointError: the checkpoint's shard cannot be read.
    """
    chain = deltas.latest_chain(url)
    if chain is None or chain.num_shards != num_ps:
        return None
    shard = chain.read_shard(ps_task)
    static = [v for v in shard.variables if v.dynamic is None]
    return Restored(
        step=chain.step,
        global_step=shard.global_step,
        defs=[_definition(v) for v in shard.variables],
        optimizer=optimizer_spec(shard.optimizer),
        sync=None if shard.sync is None else _message(pb.SyncDef, shard.sync),
        values={v.name: v.value for v in static},
        states={v.name: v.state for v in static},
        table_optimizer=None if shard.table_optimizer is None else optimizer_spec(shard.table_optimizer),
        dynamic={v.name: gather([v]) for v in shard.variables if v.dynamic is not None},
        pushes=None if shard.pushes is None else dict(shard.pushes),
        num_shards=chain.num_shards,
        schedules=schedule_states(shard),
    )


def restore_onto(
    url: str,
    defs: Sequence[pb.VariableDef],
    optimizer: OptimizerSpec,
    table_optimizer: OptimizerSpec | None = None,
    *,
    keeps_data: bool = False,
) -> Restored | None:
    """The rows of the latest valid checkpoint that ``defs`` ask for, from whichever shards hold them.

    Optimizer state is kept only if the checkpoint ran the same optimizer
    (for embedding tables, the same table optimizer). The push ledger is not:
    its numbers are per ps task, and the layout changed. ``keeps_data``: the
    task keeps the data queues (ps 0), and takes them from the first shard's
    record, where ps 0 saved them (:mod:`psframe.ps.protocol.data_ranges`).

    Returns:
        What to restore, or None when there is no checkpoint.

    Raises:
        CheckpointError: a shard cannot be read, or does not hold the rows.
    """
    chain = deltas.latest_chain(url)
    if chain is None:
        return None
    restored = restore_from_shards(
        chain.read_shards(),
        defs,
        optimizer,
        table_optimizer,
        keeps_data=keeps_data,
        source=f"checkpoint {chain.last.folder}",
    )
    restored.step = chain.step
    return restored


def restore_from_shards(
    shards: Sequence[ShardData],
    defs: Sequence[pb.VariableDef],
    optimizer: OptimizerSpec,
    table_optimizer: OptimizerSpec | None = None,
    *,
    keeps_data: bool = False,
    source: str = "the snapshot",
) -> Restored:
    """The rows ``defs`` ask for, re-sliced from the parts ``shards`` hold (a checkpoint's,
    or a live re-layout's snapshots: :mod:`psframe.ps.elastic.relayout`); as :func:`restore_onto`.

    ``step`` of the result is -1 (no checkpoint); ``num_shards`` that of the shards.

    Raises:
        CheckpointError: the shards do not hold the rows.
    """
    saved_with = shards[0].optimizer.name
    same_optimizer = saved_with == optimizer.name
    if not same_optimizer:
        log.warning("%s ran %s, now %s: its optimizer state is not restored", source, saved_with, optimizer.name)
    saved_tables = shards[0].table_optimizer
    same_table_optimizer = (
        table_optimizer is not None and saved_tables is not None and saved_tables.name == table_optimizer.name
    )
    values, states, dynamic = {}, {}, {}
    saved_dynamic = dynamic_parts_of(shards)
    for d in defs:
        if d.HasField("dynamic"):
            held = gather(saved_dynamic[d.variable], d.part_index, d.num_parts) if d.variable in saved_dynamic else None
            if held is not None:
                held["state"] = held["state"] if same_table_optimizer else {}
                dynamic[d.name] = held
            continue
        whole = _same_part(shards, d)
        if whole is not None:  # kept as it was (a re-layout): the part itself, not a copy
            value, state = whole.value, dict(whole.state)
        elif d.row_stride > 1 or any(
            v.variable == d.variable and v.row_stride > 1 for s in shards for v in s.variables
        ):
            value, state = strided_rows(shards, d.variable, d.row_start, d.shape[0], max(1, d.row_stride))
        else:
            value, state = slice_rows(shards, d.variable, d.row_start, d.row_start + d.shape[0])
        values[d.name] = value.reshape(tuple(d.shape))
        states[d.name] = state if (same_table_optimizer if d.table else same_optimizer) else {}
    return Restored(
        step=-1,
        # A ps task that held no part (a stage of a re-layout can leave one empty) counted no step.
        global_step=min(s.global_step for s in [s for s in shards if s.variables] or shards),
        defs=list(defs),
        optimizer=optimizer,
        sync=None,
        values=values,
        states=states,
        table_optimizer=table_optimizer,
        dynamic=dynamic,
        pushes={k: list(v) for k, v in (shards[0].pushes or {}).items() if k.startswith(STATE_PREFIX)}
        if keeps_data
        else None,
        num_shards=shards[0].num_shards,
        # Every ps task's schedules stood alike; one that held parts stepped them.
        schedules=schedule_states(next((s for s in shards if s.variables), shards[0]), optimizer, table_optimizer),
    )


def _optimizer_data(spec: OptimizerSpec, schedule_state: dict | None) -> OptimizerData:
    """The record of an optimizer, with its schedule and where it stood."""
    schedule = None if spec.schedule is None else spec.schedule.to_dict()
    return OptimizerData(spec.name, dict(spec.kwargs), schedule, schedule_state)


def optimizer_spec(record: OptimizerData) -> OptimizerSpec:
    """The optimizer a shard's record names, with its schedule."""
    schedule = None if record.schedule is None else ScheduleSpec.from_dict(record.schedule)
    return OptimizerSpec(record.name, record.kwargs, schedule)


def schedule_states(
    shard: ShardData, optimizer: OptimizerSpec | None = None, table_optimizer: OptimizerSpec | None = None
) -> dict[str, Any]:
    """Where the shard's schedules stood, by optimizer; given the optimizers now, only those whose
    schedule is the one saved (another schedule starts from global step 0)."""
    states = {}
    for name, record, now in (
        ("optimizer", shard.optimizer, optimizer),
        ("table_optimizer", shard.table_optimizer, table_optimizer),
    ):
        if record is None or record.schedule_state is None:
            continue
        if now is not None and (now.schedule is None or now.schedule.to_dict() != record.schedule):
            continue
        states[name] = dict(record.schedule_state)
    return states


def _same_part(shards: Sequence[ShardData], definition: pb.VariableDef) -> VariableData | None:
    """The part of ``shards`` that holds exactly the rows ``definition`` asks for, if one does."""
    shape, stride = tuple(definition.shape), max(1, definition.row_stride)
    for shard in shards:
        for part in shard.variables:
            if (
                part.variable == definition.variable
                and part.dynamic is None
                and max(1, part.row_stride) == stride
                and part.row_start == definition.row_start
                and tuple(part.shape) == shape
            ):
                return part
    return None


# ---- records <-> wire messages: fields pair up by name, so neither side lists them


def part_record(definition: pb.VariableDef) -> VariableData:
    """The record of a fixed part of ``definition``, its values not read yet (empty)."""
    return _record(VariableData, definition, value=torch.empty(0), state={}, dynamic=None)


def _record(cls: type, message: Any, **rest: Any) -> Any:
    """A ``cls`` record from a wire message with the same field names, plus
    the fields the message does not carry (``rest``); repeated fields become
    tuples."""
    shared = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields if f.name not in rest}
    shared = {k: x if isinstance(x, (bool, int, float, str)) else tuple(x) for k, x in shared.items()}
    return cls(**shared, **rest)


def _message(cls: Any, record: Any) -> Any:
    """A ``cls`` wire message with its fields taken from ``record`` by name."""
    return cls(**{f.name: getattr(record, f.name) for f in cls.DESCRIPTOR.fields})


def _dynamic_record(definition: pb.VariableDef, held: dict) -> VariableData:
    """The record of a dynamic table's part: the rows it holds, their state and ages."""
    spec = {f.name: getattr(definition.dynamic, f.name) for f in pb.DynamicTableDef.DESCRIPTOR.fields}
    return _record(
        VariableData,
        definition,
        value=held["rows"],
        state=held["state"],
        shape=tuple(held["rows"].shape),
        dynamic={
            "spec": spec,
            "ids": held["ids"],
            "updated": held["updated"],
            "updates": held["updates"],
            "clock": held["clock"],
            "seen": held["seen"],
            "counts": held["counts"],
            "admission": held["admission"],
        },
    )


def _definition(record: VariableData) -> pb.VariableDef:
    """The definition a saved part was made from."""
    if record.dynamic is None:
        return _message(pb.VariableDef, record)
    fields = {f.name: getattr(record, f.name) for f in pb.VariableDef.DESCRIPTOR.fields if f.name != "dynamic"}
    fields["shape"] = record.full_shape  # a dynamic part is defined empty
    return pb.VariableDef(**fields, dynamic=pb.DynamicTableDef(**record.dynamic["spec"]))

"""A task's ``TaskInfo`` read without torch: who it is, what it holds, its counters.

:func:`status_without_settings` converts every field of a ``TaskInfo`` but
the task's training settings (its optimizers and sync settings: an optimizer
spec is checked by building it, which takes torch);
:func:`psframe.wire.messages.task_status` adds them. A tool that shows no
settings (``psframe status``) reads a running cluster with this module,
gRPC and protobuf only.
"""

from __future__ import annotations

from psframe.status import (
    DataSetStatus,
    DynamicTableStatus,
    MembershipEvent,
    StreamStatus,
    TaskState,
    TaskStatus,
    VariableStatus,
    WorkerStatus,
)
from psframe.wire import psframe_pb2 as pb


def status_without_settings(info: pb.TaskInfo) -> TaskStatus:
    """A task's ``TaskInfo`` as a :class:`~psframe.status.TaskStatus` whose ``optimizer``,
    ``table_optimizer`` and ``sync`` are left None (unread), whatever the task trains with."""
    return TaskStatus(
        job_name=info.job_name,
        task_index=info.task_index,
        address=info.address,
        cluster_spec=info.cluster_spec,
        cluster_fingerprint=info.cluster_fingerprint,
        state=TaskState[pb.TaskInfo.State.Name(info.state)],
        version=info.version,
        pid=info.pid,
        global_step=info.global_step,
        variables=tuple(
            VariableStatus(d.name, d.dtype, tuple(d.shape), d.variable, d.table, d.HasField("dynamic"))
            for d in info.variables
        ),
        bytes_held=info.bytes_held,
        applied_steps=info.applied_steps,
        rejected_pushes=info.rejected_pushes,
        dropped_gradients=info.dropped_gradients,
        finished_workers=tuple(info.finished_workers),
        workers=tuple(
            WorkerStatus(
                w.task_index,
                None if w.seconds_ago < 0 else w.seconds_ago,
                w.finished,
                w.applied_steps,
                w.last_push_id,
            )
            for w in info.workers
        ),
        restored_step=info.restored_step if info.restored_step >= 0 else None,
        checkpoint_dir=info.checkpoint_dir or None,
        dynamic_tables=tuple(
            DynamicTableStatus(t.name, t.rows, t.admitted, t.filtered, t.evicted, t.rows_on_disk)
            for t in info.dynamic_tables
        ),
        steps_ahead_counts=tuple(info.steps_ahead_counts),
        max_workers=info.max_workers or None,
        layout_version=info.layout_version,
        relayouts=info.relayouts,
        move_stage=(info.move_stage.stage, info.move_stage.stages) if info.HasField("move_stage") else None,
        reshard_to=info.reshard_to,
        membership=tuple(
            MembershipEvent(c.worker, pb.MembershipChange.Kind.Name(c.kind).lower(), c.global_step, c.seconds_ago)
            for c in info.membership
        ),
        data_sets=tuple(DataSetStatus(d.name, d.consumed, d.total, d.ranges_out) for d in info.data_sets),
        streams=tuple(StreamStatus(s.name, tuple(s.applied), tuple(s.readers)) for s in info.streams),
    )

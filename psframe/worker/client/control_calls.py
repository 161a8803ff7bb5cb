"""A worker's (or a tool's) control calls to the ps tasks, around the steps rather than in them.

Functions over a :class:`~psframe.worker.client.ps_client.PsClient`'s
connections: waiting for the ps tasks and asking each who it is
(:func:`wait_for_ps`, :func:`get_info`; :func:`ping` asks a task at an
address), the chief making the model (:func:`create`) and a worker checking
it (:func:`check_model`), data read in ranges (:func:`data_range`), metrics for
plateau schedules (:func:`report_metric`) and the end (:func:`finish`,
:func:`shutdown`). Every wait has a deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psframe import errors
from psframe.cluster import ClusterSpec
from psframe.config.security import Security
from psframe.errors import ConnectTimeoutError
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.status import TaskState, TaskStatus
from psframe.wire import codec, messages, row_tensors, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client import reports
from psframe.worker.client.ps_client import PsClient
from psframe.worker.plan.step_plan import Slot

log = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 5.0
# A wait for the ps tasks is said at once at INFO; once it lasts this long, at WARNING (seen with no logging set up).
WAIT_WARNING_AFTER_S = 2.0


def wait_for_ps(
    client: PsClient,
    timeout: float,
    *,
    ready: bool = False,
    tasks: Sequence[int] | None = None,
    poll: float = 0.1,
    max_poll: float | None = None,
) -> list[TaskStatus]:
    """Wait until every ps task (or those of ``tasks``) answers (and, with ``ready``, holds the model).

    Asks again after ``poll`` seconds, the wait doubling each time up to ``max_poll`` (None: every
    ``poll`` seconds); logs whom it waits for at once (INFO), and at WARNING
    once the wait lasts :data:`WAIT_WARNING_AFTER_S`, then every :data:`LOG_EVERY_SECONDS`.

    Returns:
        Each ps task's (of ``tasks``) :class:`~psframe.status.TaskStatus`, by task index.

    Raises:
        ConnectTimeoutError: naming the tasks still missing after ``timeout``.
        ClusterMismatchError: a ps task was started with another cluster.
        TrainingFinishedError: a ps task has seen every worker finish.
    """
    start = time.monotonic()
    deadline = start + timeout
    next_log = start  # say at once whom we wait for, then (at WARNING) every few seconds
    infos: dict[int, TaskStatus] = {}
    pending = list(range(client.num_ps)) if tasks is None else list(tasks)
    # A worker asks to take part (an elastic ps task counts it, even after it had left).
    request = pb.InfoRequest(caller=client.caller, joining=client.caller.job_name == "worker")
    while True:
        asked = list(pending)
        timeout_each = max(0.1, min(2.0, deadline - time.monotonic()))
        replies = transport.call_each([(client.connections[k], "GetInfo", request) for k in asked], timeout_each)
        for k, (reply, error) in zip(asked, replies):
            if isinstance(error, (errors.TaskUnavailableError, errors.RpcTimeoutError)):
                continue
            if error is not None:
                raise error
            info = messages.task_status(reply)
            messages.check_identity(info, client.cluster, "ps", k, client.connections[k].address)
            if client.caller.job_name == "worker":  # number pushes above those the task applied already
                last = next((w.last_push_id for w in info.workers if w.task_index == client.task_index), 0)
                client.push_numbers.start_after(k, last)
            if info.state is TaskState.FINISHED:
                raise errors.TrainingFinishedError(
                    f"{client.describe(k)} has seen every worker finish; training is over"
                )
            if ready and info.state is not TaskState.READY:
                continue
            infos[k] = info
            pending.remove(k)
        if not pending:
            if 0 in infos:  # a push carries the layout the ps tasks are at: one of a layout before is refused
                client.caller.layout_version = infos[0].layout_version
            return [infos[k] for k in sorted(infos)]
        now = time.monotonic()
        what = "hold the model (the chief creates it)" if ready else "come up"
        missing = ", ".join(client.describe(k) for k in pending)
        if now >= deadline:
            raise ConnectTimeoutError(
                f"{client.name} waited {now - start:.1f}s for {missing} to {what}; {_what_to_check(ready, pending)}"
            )
        if now >= next_log:
            late = now - start >= WAIT_WARNING_AFTER_S
            level = logging.WARNING if late else logging.INFO
            log.log(level, "%s waiting for %s to %s (%.0fs of %.0fs)", client.name, missing, what, now - start, timeout)
            next_log = now + LOG_EVERY_SECONDS if late else start + WAIT_WARNING_AFTER_S
        time.sleep(min(poll, max(0.0, deadline - now)))
        if max_poll is not None:
            poll = min(2 * poll, max_poll)


def get_info(client: PsClient, ps_task: int) -> TaskStatus:
    """One ps task's :class:`~psframe.status.TaskStatus` (who it is, what it holds, its counters)."""
    info = client.connections[ps_task].call("GetInfo", pb.InfoRequest(caller=client.caller), timeout=client.rpc_timeout)
    return messages.task_status(info)


def create(
    client: PsClient,
    ps_task: int,
    slots: Sequence[Slot],
    values: Sequence[tuple[str, torch.Tensor]],
    optimizer: OptimizerSpec,
    sync: SyncReplicas | None,
    checkpoint_dir: str | None,
    *,
    rows: Sequence[row_tensors.RowPush] = (),
    table_optimizer: OptimizerSpec | None = None,
    global_step: int = 0,
) -> bool:
    """Ask a ps task to create its variables (chief only), with some of their initial values.

    ``slots`` are every variable the ps task holds; ``values`` (CPU
    tensors, by shard name) may be a part of them, and ``rows`` some
    rows of its embedding tables' parts, as ``(part, ids, rows)``: the
    ps creates the variables once it has them all, so a large model
    travels in several calls. A ps task that holds the model already
    (or restores it from ``checkpoint_dir``) keeps what it has.
    ``table_optimizer`` updates the tables (needed if there are any).
    ``global_step``: the chief's (0 at the start of a job); a ps task that
    lost its variables and has no checkpoint goes on from it.

    Returns:
        True if this call created the variables.
    """
    header = pb.InitHeader(
        caller=client.caller,
        variables=messages.variable_defs(slots),
        optimizer=messages.optimizer_to_proto(optimizer),
        sync=messages.sync_def(sync),
        checkpoint_dir=checkpoint_dir or "",
        global_step=global_step,
    )
    if table_optimizer is not None:
        header.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
    pushed_rows, row_kinds = row_tensors.push_tensors(rows)
    tensors = list(values) + pushed_rows
    data = client.connections[ps_task].call(
        "Init",
        codec.encode(header, tensors, [row_tensors.VALUE] * len(values) + row_kinds),
        timeout=client.rpc_timeout,
    )
    return codec.decode(data, pb.InitReplyHeader)[0].created


def check_model(
    client: PsClient, infos: Sequence[TaskStatus], slots: Sequence[Slot], sync: SyncReplicas | None
) -> None:
    """Check that every ps task holds exactly these variables, trained with these sync settings.

    Raises:
        ClusterMismatchError: naming the ps task and the first differences.
    """
    for ps_task, info in enumerate(infos):
        where = f"the model of {client.name} does not match {client.describe(ps_task)}"
        messages.check_same_sync(where, messages.sync_def(sync), messages.sync_def(info.sync))
        mine = messages.variable_defs(s for s in slots if s.shard.ps_task == ps_task)
        messages.check_same_variables(where, messages.keys_of_defs(mine), [v.key for v in info.variables])


def data_range(
    client: PsClient, ps_task: int, name: str, num_examples: int, range_size: int, epochs: int
) -> RangeGrant:
    """A range of data set ``name`` to train on, from the ps task that keeps its queue
    (:mod:`psframe.ps.protocol.data_ranges`): a lease, or none yet (``retry_after``), or ``exhausted``."""
    request = pb.DataRangeRequest(
        caller=client.caller, name=name, num_examples=num_examples, range_size=range_size, epochs=epochs
    )
    reply = client.connections[ps_task].call("DataRange", request, timeout=client.rpc_timeout)
    return RangeGrant(
        reply.lease,
        reply.epoch,
        reply.start,
        reply.end,
        reply.offset,
        reply.exhausted,
        reply.retry_after,
        reply.consumed,
        reply.total,
    )


@dataclass(frozen=True)
class StreamLease:
    """A partition of a stream out with this worker; ``give_back``: beyond the worker's share, to
    give back between two batches (where to read it from, every ps task says: :func:`stream_offsets`)."""

    lease: int
    partition: int
    give_back: bool


def stream_partitions(
    client: PsClient, ps_task: int, name: str, partitions: int, given_back: Sequence[int] = (), leaving: bool = False
) -> list[StreamLease]:
    """This worker's partitions of stream ``name``, from the ps task that keeps its offsets
    (:mod:`psframe.ps.protocol.stream_partitions`), lowest partition first."""
    request = pb.StreamPartitionsRequest(
        caller=client.caller, name=name, partitions=partitions, given_back=list(given_back), leaving=leaving
    )
    reply = client.connections[ps_task].call("StreamPartitions", request, timeout=client.rpc_timeout)
    return [StreamLease(lease.lease, lease.partition, lease.give_back) for lease in reply.leases]


def stream_offsets(client: PsClient, name: str) -> list[dict[int, int]]:
    """Where each ps task's updates of each partition of stream ``name`` reached (partition:
    offset; a partition it applied nothing of is absent), asked of every ps task at once."""
    request = pb.StreamOffsetsRequest(caller=client.caller, name=name)
    calls = [(connection, "StreamOffsets", request) for connection in client.connections]
    return [dict(reply.applied) for reply in transport.call_all(calls, client.rpc_timeout)]


def report_metric(
    client: PsClient, value: float, step: int, tasks: Sequence[int]
) -> list[tuple[pb.ReportMetricReply | None, errors.PsframeError | None]]:
    """Report a metric to ps tasks ``tasks``, in parallel, for their ``ReduceLROnPlateau`` schedules,
    counted from global step ``step`` on; each one's reply or error, in order."""
    request = pb.ReportMetricRequest(caller=client.caller, value=value, global_step=step)
    return transport.call_each([(client.connections[k], "ReportMetric", request) for k in tasks], client.rpc_timeout)


def shutdown(client: PsClient, ps_task: int) -> None:
    """Ask a ps task to stop serving (it exits 0)."""
    client.connections[ps_task].call(
        "Shutdown", pb.ShutdownRequest(caller=client.caller), timeout=min(client.rpc_timeout, 30.0)
    )


def finish(client: PsClient) -> None:
    """Tell every ps task this worker is done; a ps that is gone is only logged."""
    request = pb.FinishRequest(caller=client.caller)
    for ps in client.connections:
        try:
            ps.call("Finish", request, timeout=min(client.rpc_timeout, 30.0))
        except (errors.TaskUnavailableError, errors.RpcTimeoutError) as e:
            log.warning("%s could not report that it finished: %s", client.name, e)


@dataclass(frozen=True)
class RangeGrant:
    """A ps task's answer to a worker asking for a range of a data set (``lease`` 0: none now)."""

    lease: int
    epoch: int
    start: int
    end: int
    offset: int  # consumed up to here: train from it
    exhausted: bool  # every example of every epoch consumed
    retry_after: float  # every range left is out with live workers: ask again after this many seconds
    consumed: int
    total: int


def _what_to_check(ready: bool, pending: Sequence[int]) -> str:
    """What to do about ps tasks that did not come up (or hold no model) in time, for the error."""
    if ready:
        return f"is the chief, {ClusterSpec.task_name('worker', 0)}, running? (raise connect_timeout to wait longer)"
    if len(pending) == 1:
        return "is it started, and is the address right? (raise connect_timeout to wait longer)"
    return "are they started, and are the addresses right? (raise connect_timeout to wait longer)"


def ping(target: str, timeout: float = 5.0, security: Security | None = None) -> TaskStatus:
    """Ask the task at ``target`` (``grpc://host:port`` or ``host:port``) who it is.

    Raises:
        ConnectTimeoutError: nothing answered within ``timeout`` seconds.
        AuthenticationError: the task refused the call (``security``'s token is missing or wrong).
        PsframeError: something answered, but not as a psframe task.
    """
    return messages.task_status(reports.ask(target, timeout, security))

"""The DataRange, StreamPartitions and StreamOffsets handlers: a worker's next range of a data
set read in ranges, its partitions of a stream, and where this task's updates of them reached.

The queues are :class:`psframe.ps.protocol.data_ranges.RangeQueue`'s (they live
on ps task 0); a push records what its worker consumed of its range
(:mod:`~psframe.ps.service.push_pull_handler`). In synchronous training the
rounds do not wait for a worker that has no range to read, and wait for it
again once it has one. Streams are read in asynchronous training only (the
worker side refuses them with synchronous rounds).
"""

from __future__ import annotations

from psframe.ps.protocol.data_ranges import DataSpec, RangeQueue
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.service.membership import Membership
from psframe.ps.service.served_model import ServedModel
from psframe.wire import psframe_pb2 as pb


class DataRangeHandler:
    """Hands ranges of ``data``'s data sets to the workers ``membership`` admits.

    Args:
        membership: admits the worker.
        roster: the worker is alive while its call runs.
        data: the task's data queues.
        model: the synchronous rounds, when training is synchronous.
    """

    def __init__(self, membership: Membership, roster: WorkerRoster, data: RangeQueue, model: ServedModel) -> None:
        self._membership, self._roster, self._data, self._model = membership, roster, data, model

    def data_range(self, request: pb.DataRangeRequest) -> pb.DataRangeReply:
        """A range for the calling worker (or when to ask again, or that the data set is read)."""
        self._membership.check_caller(request.caller)
        worker = request.caller.task_index
        spec = DataSpec(request.num_examples, request.range_size, request.epochs)
        with self._roster.call(worker):
            grant = self._data.acquire(worker, request.name, spec)
        aggregator = self._model.aggregator
        if aggregator is not None:  # sync rounds do not wait for a worker without data
            if grant.lease is None:
                aggregator.pause(worker)
            else:
                aggregator.resume(worker)
        reply = pb.DataRangeReply(
            exhausted=grant.exhausted, retry_after=grant.retry_after, consumed=grant.consumed, total=grant.total
        )
        if grant.lease is not None:
            lease = grant.lease
            reply.lease, reply.epoch, reply.start, reply.end, reply.offset = (
                lease.lease_id,
                lease.epoch,
                lease.start,
                lease.end,
                lease.offset,
            )
        return reply

    def stream_partitions(self, request: pb.StreamPartitionsRequest) -> pb.StreamPartitionsReply:
        """The calling worker's partitions of a stream (and those it should give back)."""
        self._membership.check_caller(request.caller)
        worker = request.caller.task_index
        with self._roster.call(worker):
            assignment = self._data.assign_stream(
                worker, request.name, request.partitions, tuple(request.given_back), leaving=request.leaving
            )
        give_back = set(assignment.give_back)
        return pb.StreamPartitionsReply(
            leases=[
                pb.StreamLease(
                    lease=lease.lease_id,
                    partition=lease.partition,
                    give_back=lease.lease_id in give_back,
                )
                for lease in assignment.leases
            ]
        )

    def stream_offsets(self, request: pb.StreamOffsetsRequest) -> pb.StreamOffsetsReply:
        """How far this task's updates of each partition of a stream reached."""
        self._membership.check_caller(request.caller)
        return pb.StreamOffsetsReply(applied=self._data.streams.applied(request.name))

"""The values a worker received from the ps tasks, and the global step they are at.

Every reply a worker reads goes through :meth:`Values.receive`: the replica takes the values,
and the global step follows the rule of the training: asynchronous, ``/job:ps/task:0`` keeps
it (as in TF); synchronous, the lowest over the ps tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from psframe.worker.client.operations import DenseReply
from psframe.worker.client.ps_client import PsClient
from psframe.worker.model.replica import Replica
from psframe.worker.plan.step_plan import Request
from psframe.worker.session.stats import Counters


class Values:
    """The global step of the values last received, and how replies and pulls set it.

    Args:
        sync: synchronous training.
        counters: where the steps dropped as late, and the steps ahead of the slowest worker, are counted.
        pulled: called after every pull of all the values (in-graph replication: the other
            replicas take them).
    """

    def __init__(self, sync: bool, counters: Counters, pulled: Callable[[], None]) -> None:
        self._sync, self._counters, self._pulled = sync, counters, pulled
        self.global_step = 0

    def receive(self, replica: Replica, requests: Sequence[Request], replies: Sequence[DenseReply]) -> None:
        """``replica`` takes the values of ``replies`` (to ``requests``); the global step follows them."""
        replica.assign(requests, replies)
        if not self._sync and any(r.end_of_step for r in requests):
            # How far ahead of the slowest live worker this step found this one (the most over the ps tasks).
            ahead = max(reply.steps_ahead for r, reply in zip(requests, replies) if r.end_of_step)
            self._counters.steps_ahead[ahead] += 1
        self._counters.dropped_steps += any(reply.dropped for reply in replies)
        # Async: global_step lives on /job:ps/task:0, as in TF. Sync: every ps
        # advances in lockstep, but a reply may have been read just before a
        # shard caught up; tagging the next push with the lowest step makes a
        # gradient computed on mixed versions stale everywhere, never applied.
        # A push-only request's answer carries the step before the update: skipped.
        steps = [
            reply.global_step
            for request, reply in zip(requests, replies)
            if request.pull and (request.ps_task == 0 or self._sync)
        ]
        if steps:
            self.global_step = max(steps) if not self._sync else min(steps)

    def pull(self, client: PsClient, replica: Replica) -> None:
        """Every variable's current value into ``replica``, exactly (uncompressed, whatever the wire dtype)."""
        requests = replica.plan.pull
        replies = client.push_pull([(r, ()) for r in requests], self.global_step, compress=False)
        self.receive(replica, requests, replies)
        self._pulled()

"""A worker's side of data read in ranges (:class:`psframe.DataRanges`, :meth:`psframe.Trainer.read`).

The worker asks the ps task that keeps the data set's queue for a range
(:mod:`psframe.ps.protocol.data_ranges`), cuts it into batches in the epoch's order,
and before each batch tells its client how far the step on that batch takes
it; the client puts that in the step's push to the queue's ps task, where it
is recorded with the update. After the step the trainer says what became
of the batch (:class:`Outcome`): applied (go on), not applied (a synchronous
step dropped as late, or a step that pushed nothing: the same batch again),
or the range lost (it went to another worker while this one was presumed
dead: ask for another).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator

import torch

from psframe.config.options import DataRanges
from psframe.errors import BarrierTimeoutError
from psframe.worker.client.ps_client import RangeGrant

log = logging.getLogger(__name__)

LOG_WAIT_EVERY_S = 10.0


class Outcome(enum.Enum):
    """What became of a batch's step."""

    APPLIED = "applied"  # its update was applied: the examples are consumed
    AGAIN = "again"  # not applied (dropped as late, or nothing pushed): the batch is trained again
    LOST = "lost"  # the range is no longer this worker's: nothing of the step applied there


class RangeReader:
    """The ranges of one data set, as one worker gets them.

    Args:
        ask: asks the queue's ps task for a range (``PsClient.data_range``'s arguments), through
            the worker's client of the moment (another after a re-layout: ps tasks added or drained).
        name: the worker's name, for messages.
        ranges: the data set.
        queue_task: the ps task that keeps its queue (ps 0).
    """

    def __init__(self, ask: Callable[..., RangeGrant], name: str, ranges: DataRanges, queue_task: int) -> None:
        self._ask = ask
        self.name = name
        self.ranges = ranges
        self.queue_task = queue_task
        self._orders: dict[int, torch.Tensor] = {}

    def leases(self) -> Iterator[RangeGrant]:
        """Ranges to train on until every example of every epoch was consumed.

        Raises:
            BarrierTimeoutError: the last ranges, out with other workers, were not consumed
                within the data set's timeout.
        """
        ranges = self.ranges
        waiting_since: float | None = None
        next_log = 0.0
        while True:
            grant = self._ask(
                self.queue_task, ranges.name, ranges.num_examples, ranges.examples_per_range, ranges.epochs
            )
            if grant.exhausted:
                return
            if grant.lease:
                waiting_since = None
                yield grant
                continue
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
            waited = now - waiting_since
            if waited > ranges.timeout:
                raise BarrierTimeoutError(
                    f"{self.name} waited {waited:.0f}s for the last ranges of data set {ranges.name!r}, "
                    f"out with other workers, to be consumed ({grant.consumed} of {grant.total} examples are)"
                )
            if now >= next_log:
                log.info(
                    "%s: every range of %r left is out with other workers (%d of %d examples consumed); "
                    "waiting in case one of them is lost",
                    self.name,
                    ranges.name,
                    grant.consumed,
                    grant.total,
                )
                next_log = now + LOG_WAIT_EVERY_S
            time.sleep(grant.retry_after)

    def order(self, epoch: int) -> torch.Tensor:
        """The examples of ``epoch`` in the order every worker reads them (drawn from the seed)."""
        order = self._orders.get(epoch)
        if order is None:
            ranges = self.ranges
            if ranges.shuffle:
                generator = torch.Generator().manual_seed(ranges.seed * 1_000_003 + epoch)
                order = torch.randperm(ranges.num_examples, generator=generator)
            else:
                order = torch.arange(ranges.num_examples)
            self._orders = {epoch: order}  # one epoch at a time is enough
        return order

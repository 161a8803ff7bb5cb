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

:class:`RangeReader` gets the ranges of one data set; :class:`RangeFeed` is the trainer's
part: it cuts them into batches (``Trainer.read``), and the step tells it each batch's outcome.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, TypeVar

import torch

from psframe.config.options import DataRanges
from psframe.errors import BarrierTimeoutError, DataRangeLostError, PsframeError
from psframe.worker.client import control_calls
from psframe.worker.client.control_calls import RangeGrant
from psframe.worker.client.operations import StreamProgress
from psframe.worker.session.session import Session

log = logging.getLogger(__name__)
T = TypeVar("T")

LOG_WAIT_EVERY_S = 10.0


class Outcome(enum.Enum):
    """What became of a batch's step."""

    APPLIED = "applied"  # its update was applied: the examples are consumed
    AGAIN = "again"  # not applied (dropped as late, or nothing pushed): the batch is trained again
    LOST = "lost"  # the range is no longer this worker's: nothing of the step applied there


class RangeReader:
    """The ranges of one data set, as one worker gets them.

    Args:
        ask: asks the queue's ps task for a range (``control_calls.data_range``'s arguments), through
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


class RangeFeed:
    """A worker's batches of data sets read in ranges, and what became of each: the step on a
    batch tells it (:meth:`outcome`, :meth:`lost`).

    Args:
        session: the worker's session: its client of the moment asks for ranges and reports how
            far a batch takes its range.
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self._outcome: Outcome | None = None  # what became of the batch the last step trained on
        self.carried: set[int] = set()  # the ps tasks whose push carried the last batch's progress
        # A batch is out: the next step reports its progress, and tells its outcome (a step
        # reads this, and calls nothing here without it).
        self.reading = False

    def read(self, ranges: DataRanges) -> Iterator[torch.Tensor]:
        """The batches of ``ranges`` (``Trainer.read``): the indices of their examples.

        Raises:
            PsframeError: the batch before was not stepped on, or /job:ps/task:0 (which keeps
                the queue) holds no dense variable of the model.
            BarrierTimeoutError: the last ranges, out with other workers, were not consumed in time.
        """
        self.check_queue_task("read()")
        reader = RangeReader(self._ask, self._session.client.name, ranges, 0)
        for grant in reader.leases():
            order, offset = reader.order(grant.epoch), grant.offset
            while offset < grant.end:
                stop = min(offset + ranges.batch_size, grant.end)
                outcome = yield from self.out(ranges.name, grant.lease, stop, order[offset:stop])
                if outcome is Outcome.LOST:
                    break
                if outcome is Outcome.APPLIED:
                    offset = stop

    def check_queue_task(self, what: str) -> None:
        """Raise unless the step pushes to /job:ps/task:0, which keeps the data's queues.

        Raises:
            PsframeError: /job:ps/task:0 holds no dense variable of the model.
        """
        if not any(request.ps_task == 0 and request.end_of_step for request in self._session.replica.plan.step):
            raise PsframeError(
                f"{what} needs a dense variable on /job:ps/task:0, which keeps the data's queue: the step's push "
                "there carries the data consumed (place one there, e.g. Placement(variable_devices=...))"
            )

    def out(
        self, name: str, lease: int, stop: int, batch: T, stream: Mapping[int, StreamProgress] | None = None
    ) -> Generator[T, None, Outcome]:
        """Give ``batch`` out for one step, whose push to ps 0 says that it takes lease ``lease``
        of ``name`` to ``stop`` (a stream's batch: whose push to each ps task ``k`` carries
        ``stream[k]``); what became of the step (``outcome = yield from feed.out(...)``), and in
        :attr:`carried` the ps tasks whose push carried it.

        Raises:
            PsframeError: the batch was not stepped on.
        """
        self._outcome = None
        self.reading = True
        client = self._session.client
        if stream is None:
            client.report_progress(0, name, lease, stop)
        else:
            client.report_stream_progress(stream)
        try:
            yield batch
        finally:
            self.reading = False
            client = self._session.client  # another after a re-layout (it took the progress)
            self.carried = client.progress_carried()
            client.clear_progress()
        outcome = self._outcome
        if outcome is None:
            raise PsframeError(
                f"read() and stream() give one batch per step: call trainer.step(loss) on each batch of "
                f"{name!r} before taking the next"
            )
        return outcome

    def _ask(self, *asked: Any) -> RangeGrant:
        """A range to read (``control_calls.data_range``), from the layout the ps tasks are at."""
        return self._session.call(lambda at: control_calls.data_range(at.client, *asked), lost=False)

    def outcome(self, outcome: Outcome) -> None:
        """What became of the step on the batch out (with none out, nothing: see :attr:`reading`)."""
        if self.reading:
            self._outcome = outcome

    def lost(self, error: DataRangeLostError) -> None:
        """The step's range went to another worker: nothing of the step applied on the queue's
        ps task; the iteration asks for another range.

        Raises:
            DataRangeLostError: ``error``, with no batch out.
        """
        if not self.reading:
            raise error
        log.warning("%s: %s", self._session.name, error)
        self._outcome = Outcome.LOST

    def recorded(self) -> None:
        """The batch's progress went with a push: the pushes after it carry none."""
        self._session.client.clear_progress()

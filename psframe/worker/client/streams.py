"""A worker's PushPull streams: one long-lived stream per ps task, a window of requests on each.

:class:`PushPullStreams` is what :class:`psframe.worker.client.ps_client.PsClient`
sends a step's operations through (:mod:`psframe.worker.client.operations`). Each
ps task is reached over one bidirectional stream (opened on first use,
reopened after a failure) that answers its messages in order; at most
:data:`WINDOW` messages are in flight on a stream: enough to keep sending
while the ps task works, few enough that neither side buffers a whole large
model. The operations' messages and replies go through one
:class:`~psframe.worker.client.operations.OperationEncoder`, which on the ps task's
host moves planned requests' tensors through a shared region until the task
says it cannot map it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence

import torch

from psframe import errors
from psframe.config.options import BoundedStaleness
from psframe.errors import PsframeError
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport
from psframe.worker.client.operations import (
    Gradients,
    Operation,
    OperationEncoder,
    PushPull,
    RelayoutWord,
    Reply,
)

log = logging.getLogger(__name__)

# PushPull requests in flight on one stream.
WINDOW = 4


class PushNumbers:
    """The numbers of a worker's pushes to each ps task: 1, 2, 3... in the order sent.

    A ps task applies each number once (:mod:`psframe.ps.protocol.ledger`). The pushes
    of a step take their numbers before they are sent; when the step fails
    on the way (a stream died), the same pushes are sent again with the same
    numbers (:meth:`assign` with ``again``), so that the ps task answers those
    it applied already without applying them twice. A step given up takes no
    number back: the next one goes on after it.
    """

    def __init__(self, num_ps: int) -> None:
        self._next = [1] * num_ps
        self._taken: dict[int, tuple[int, int]] = {}  # the last take: ps task -> (first number, count)

    def start_after(self, ps_task: int, last: int) -> None:
        """Number the next pushes to ``ps_task`` above ``last``, the last push of this
        worker the task applied: a worker started again (whose numbering started
        at 1) must not reuse the numbers of its earlier run. Numbers already taken
        are kept, and so is what :meth:`assign` gives ``again``."""
        self._next[ps_task] = max(self._next[ps_task], last + 1)

    @property
    def holds_a_step(self) -> bool:
        """Whether numbers were taken for a step's pushes on these streams (one that may be sent again)."""
        return bool(self._taken)

    def assign(self, targets: Sequence[int | None], again: bool = False) -> list[int]:
        """A number for each message of a step, in the order they are sent: ``targets``
        holds the ps task each one pushes to, or None for one that pushes nothing (0).

        Args:
            targets: per message, its ps task, or None.
            again: the same pushes as the last step that pushed, sent again: the same numbers.

        Raises:
            ValueError: ``again`` with other pushes than the last step's.
        """
        counts = collections.Counter(t for t in targets if t is not None)
        if again:
            if {k: count for k, (_, count) in self._taken.items()} != dict(counts):
                raise ValueError(
                    f"pushes sent again must be those of the last step: {dict(counts)} against {self._taken}"
                )
        elif counts:  # a pull numbers nothing, and keeps the last pushes' numbers for a resend
            self._taken = {}
            for ps_task, count in counts.items():
                self._taken[ps_task] = (self._next[ps_task], count)
                self._next[ps_task] += count
        following = {k: first for k, (first, _) in self._taken.items()} if counts else {}
        numbers = []
        for target in targets:
            if target is None:
                numbers.append(0)
            else:
                numbers.append(following[target])
                following[target] += 1
        return numbers


class PushPullStreams:
    """The PushPull streams of one client to every ps task.

    Args:
        connections: one per ps task, by index.
        caller: who sends (every header names it).
        wire_dtype: the dtype compressed requests move floating-point tensors in; None: none.
        share_with: whether the ps tasks may take shared regions (they are on
            this host, and shared memory is available); a task that says it
            cannot map them is sent messages from then on.
        staleness: the bound every step-ending push carries; None: none.
        relayout_word: where what ps 0's replies say of re-layouts is kept; None: a word of its own.
    """

    def __init__(
        self,
        connections: Sequence[transport.Connection],
        caller: pb.Caller,
        wire_dtype: torch.dtype | None,
        *,
        share_with: bool,
        staleness: BoundedStaleness | None = None,
        relayout_word: RelayoutWord | None = None,
    ) -> None:
        self._ps = connections
        self._streams: dict[int, transport.Stream] = {}
        self._watchdog = transport.Watchdog()
        shared = set(range(len(connections))) if share_with else set()
        self.encoder = OperationEncoder(caller, wire_dtype, shared, staleness, relayout_word)
        self.numbers = PushNumbers(len(connections))

    def exchange(
        self,
        operations: Sequence[Operation],
        step: int,
        compress: bool,
        timeout: float,
        push_ids: Sequence[int] = (),
    ) -> list[Reply | None]:
        """Send ``operations``, each ps task's in the order given, and wait for every reply.

        Args:
            operations: what to ask, each of one ps task.
            step: the global step the worker is at (gradients were computed at).
            compress: :class:`~psframe.worker.client.operations.PushPull` tensors travel in the wire dtype.
            timeout: the deadline of each message, in seconds.
            push_ids: per operation, its push number (0 for one that pushes nothing); by default all 0.

        Returns:
            Per operation, its reply (:class:`~psframe.worker.client.operations.DenseReply`,
            ``RowsPushed`` or ``RowsPulled``, as the operation). A read answered
            behind a push the ps task refused for its shared region is sent again
            behind that push, so every reply reads what the pushes ahead of it left.

        Raises:
            PsframeError: the first error a ps task answered, or a transport error
                naming the task; RpcTimeoutError after ``timeout`` seconds.
        """
        return Exchange(self, operations, step, compress, timeout, push_ids).finish()

    def begin(
        self,
        operations: Sequence[PushPull],
        grads_of: Callable[[int], Gradients],
        step: int,
        compress: bool,
        timeout: float,
        push_ids: Sequence[int],
    ) -> Exchange:
        """An exchange of planned requests whose gradients are not all there yet:
        :meth:`Exchange.send_ready` sends operation ``i`` as soon as ``grads_of(i)`` can give its
        gradients (while backward still runs), :meth:`Exchange.finish` the rest."""
        return Exchange(self, operations, step, compress, timeout, push_ids, grads_of=grads_of)

    def _stream(self, ps_task: int) -> transport.Stream:
        stream = self._streams.get(ps_task)
        if stream is None:
            stream = self._streams[ps_task] = self._ps[ps_task].open_stream("PushPull", self._watchdog)
        return stream

    def reset(self) -> None:
        """Close the streams (after a ps task went away): new ones open on next use, and
        shared regions are offered anew."""
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self.encoder.drop_all_regions()

    def close(self) -> None:
        """Close the streams and stop their deadlines' watchdog."""
        self.reset()
        self._watchdog.stop()


class Exchange:
    """The operations of one step (or pull) and their replies, each ps task's in order.

    Each operation is encoded when it is sent, at most :data:`WINDOW` in
    flight per ps task. With ``grads_of``, a planned request's gradients come
    from ``grads_of(i)`` once :meth:`send_ready` says they are complete: it may
    send a request before :meth:`finish` (while backward still runs:
    :mod:`psframe.worker.model.overlap`), as long as every message ahead of it on its
    stream has gone and the window allows; :meth:`finish` sends the rest and
    waits for every reply. A failure to send early is left to :meth:`finish`
    (nothing is lost: a message leaves its queue once sent).
    """

    def __init__(
        self,
        streams: PushPullStreams,
        operations: Sequence[Operation],
        step: int,
        compress: bool,
        timeout: float,
        push_ids: Sequence[int] = (),
        *,
        grads_of: Callable[[int], Gradients] | None = None,
    ) -> None:
        self._streams = streams
        self._encoder = streams.encoder
        self._operations = operations
        self._grads_of = grads_of
        self._step, self._compress, self._timeout = step, compress, timeout
        self._push_ids = push_ids
        self._unsent: dict[int, collections.deque[int]] = {}
        for i, operation in enumerate(operations):
            self._unsent.setdefault(operation.ps_task, collections.deque()).append(i)
        self._in_flight: dict[int, collections.deque[int]] = {ps_task: collections.deque() for ps_task in self._unsent}
        # Requests refused for a shared region, sent again (in messages) before the
        # rest, in the order first sent: a ps task applies a worker's pushes in order.
        self._again: dict[int, collections.deque[int]] = {ps_task: collections.deque() for ps_task in self._unsent}
        # Operations whose gradients are there; None: all (always, without grads_of).
        self._ready: set[int] | None = set() if grads_of is not None else None
        self.sent_early = 0  # requests sent before finish()

    def send_ready(self, i: int) -> None:
        """Operation ``i``'s gradients are complete: send it now if its turn and the window allow."""
        if self._ready is None:
            return
        self._ready.add(i)
        ps_task = self._operations[i].ps_task
        before = len(self._in_flight[ps_task])
        try:
            self._send_more(ps_task)
        except Exception as e:  # noqa: BLE001 - finish() sends it, and raises what it raises then
            log.debug("sending a request early failed (it is sent after backward): %r", e)
        self.sent_early += len(self._in_flight[ps_task]) - before

    def _send_more(self, ps_task: int) -> None:
        again, unsent, in_flight = self._again[ps_task], self._unsent[ps_task], self._in_flight[ps_task]
        while (again or unsent) and len(in_flight) < WINDOW:
            queue = again or unsent
            i = queue[0]
            if self._ready is not None and i not in self._ready:
                return  # its gradients are not all there yet: it, and what follows, wait
            grads = self._grads_of(i) if self._grads_of is not None else ()
            push_id = self._push_ids[i] if self._push_ids else 0
            data = self._encoder.encode(self._operations[i], self._step, self._compress, push_id, grads)
            self._streams._stream(ps_task).send(data, self._timeout)
            queue.popleft()  # only once sent: a failure leaves it to be sent again
            in_flight.append(i)

    def finish(self) -> list[Reply | None]:
        """Send what is left and wait for every reply (see :meth:`PushPullStreams.exchange`)."""
        streams, operations = self._streams, self._operations
        self._ready = None
        replies: list[Reply | None] = [None] * len(operations)
        failure: PsframeError | None = None
        resent: set[int] = set()  # ps tasks to which a planned request went again
        pulled_again: set[int] = set()  # pulls sent again behind them
        for ps_task in self._unsent:
            self._send_more(ps_task)
        while any(self._in_flight.values()):
            for ps_task, waiting in self._in_flight.items():
                if not waiting:
                    continue
                i = waiting.popleft()
                try:
                    data = streams._streams[ps_task].receive()
                except PsframeError as e:
                    streams._streams.pop(ps_task).close()
                    failure = failure or e
                    waiting.clear()
                    self._unsent[ps_task].clear()
                    self._again[ps_task].clear()
                    continue
                peer = streams._ps[ps_task].peer
                operation = operations[i]
                header, replies[i] = self._encoder.decode(operation, data, self._compress)
                if header.region_unusable:
                    if isinstance(operation, PushPull):
                        # The task could not map the region (it was replaced, or another of its
                        # processes answered), or refused a push that came after one it could
                        # not map: nothing was applied; the tensors go in the message.
                        log.debug("%s: %s", peer, header.region_unusable)
                        self._again[ps_task].append(i)
                        resent.add(ps_task)
                    else:  # refused behind a push refused for its region: not sent again
                        failure = failure or errors.SharedRegionError(header.region_unusable)
                elif header.error_class:
                    failure = failure or transport.decode_error(header.error_class, header.error_message, peer)
                elif not operation.pushes and ps_task in resent and i not in pulled_again:
                    # A read (values after a round, rows prefetched) answered before the pushes
                    # ahead of it, refused and sent again, were applied: it goes again behind them.
                    self._again[ps_task].append(i)
                    pulled_again.add(i)
                self._send_more(ps_task)
        if failure is not None:
            self._encoder.drop_regions(operations, self._compress)
            raise failure
        return replies

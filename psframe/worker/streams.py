"""A worker's PushPull streams: one long-lived stream per ps task, a window of requests on each.

:class:`PushPullStreams` is what :class:`psframe.worker.ps_client.PsClient`
sends a step through. Each ps task is reached over one bidirectional stream
(opened on first use, reopened after a failure) that answers its messages
in order; at most :data:`WINDOW` requests are in flight on a stream: enough
to keep sending while the ps task works, few enough that neither side
buffers a whole large model. Planned requests are encoded through their
:class:`~psframe.worker.prepared.PreparedRequest` (made once per request and
compression), which on the ps task's host moves their tensors through a
shared region until the task says it cannot map it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from psframe import errors
from psframe.errors import PsframeError
from psframe.wire import codec, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.prepared import PreparedRequest
from psframe.worker.step_plan import Request

log = logging.getLogger(__name__)

# PushPull requests in flight on one stream.
WINDOW = 4


@dataclass(slots=True)
class Reply:
    """A ps task's answer to one request: its global step and the values pulled."""

    global_step: int
    dropped: bool  # sync: the gradients were stale or late, and not applied
    values: list[torch.Tensor]  # in the order of the request's ``pull``; read-only views of the reply
    duplicate: bool = False  # a push sent again whose first copy the ps task had applied (not applied again)


class PushNumbers:
    """The numbers of a worker's pushes to each ps task: 1, 2, 3... in the order sent.

    A ps task applies each number once (:mod:`psframe.ps.ledger`). The pushes
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
    """

    def __init__(
        self,
        connections: Sequence[transport.Connection],
        caller: pb.Caller,
        wire_dtype: torch.dtype | None,
        *,
        share_with: bool,
    ) -> None:
        self._ps = connections
        self._caller = caller
        self._wire_dtype = wire_dtype
        self._wire_name = codec.dtype_name(wire_dtype) if wire_dtype is not None else ""
        self._streams: dict[int, transport.Stream] = {}
        self._watchdog = transport.Watchdog()
        # Made once per planned request (and compression): see PreparedRequest.
        self.prepared: dict[tuple[Request, bool], PreparedRequest] = {}
        self._share_with = set(range(len(connections))) if share_with else set()
        self.numbers = PushNumbers(len(connections))

    def exchange(
        self,
        first: Sequence[tuple[int, bytes]],
        requests: Sequence[tuple[Request, Sequence[tuple[str, torch.Tensor]]]],
        step: int,
        compress: bool,
        timeout: float,
        last: Sequence[tuple[int, bytes]] = (),
        push_ids: Sequence[int] = (),
    ) -> list:
        """Send encoded messages (``first``, each to its ps task ahead of the rest),
        then planned requests (``compress``: in the wire dtype; ``push_ids``: their
        push numbers, 0 for one that pushes nothing, by default all 0), then
        encoded messages ``last``, and wait for every reply.

        Returns:
            For each message of ``first``, its reply's ``(header, tensors)``;
            then a :class:`Reply` for each request; then ``(header, tensors)``
            for each message of ``last``, or None for each if a request had to
            be sent again (its answer may then have come first).

        Raises:
            PsframeError: the first error a ps task answered, or a transport
                error naming the task; RpcTimeoutError after ``timeout`` seconds.
        """
        return Exchange(
            self,
            [r for r, _ in requests],
            lambda i: requests[i][1],
            step,
            compress,
            timeout,
            first=first,
            last=last,
            push_ids=push_ids,
        ).finish()

    def begin(
        self,
        requests: Sequence[Request],
        grads_of: Callable[[int], Sequence[tuple[str, torch.Tensor]]],
        step: int,
        compress: bool,
        timeout: float,
        push_ids: Sequence[int],
    ) -> Exchange:
        """An exchange of planned ``requests`` whose gradients are not all there yet:
        :meth:`Exchange.send_ready` sends a request as soon as ``grads_of(i)`` can give its
        gradients (while backward still runs), :meth:`Exchange.finish` the rest."""
        return Exchange(self, requests, grads_of, step, compress, timeout, push_ids=push_ids)

    def _encode(
        self, request: Request, grads: Sequence[tuple[str, torch.Tensor]], step: int, compress: bool, push_id: int
    ) -> bytes:
        prepared = self.prepared.get((request, compress))
        if prepared is None:  # every step sends the same header but for the step number
            prepared = self.prepared[(request, compress)] = PreparedRequest(
                pb.PushPullHeader(
                    caller=self._caller,
                    pull=[s.name for s in request.pull],
                    end_of_step=request.end_of_step,
                    wire_dtype=self._wire_name if compress else "",
                ),
                share=request.ps_task in self._share_with,
            )
        elif prepared.share and request.ps_task not in self._share_with:
            prepared.share = False
            prepared.drop_region()
        if compress:
            grads = [(name, codec.to_wire(grad, self._wire_dtype)) for name, grad in grads]
        return prepared.encode(step, grads, push_id)

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
        for prepared in self.prepared.values():
            prepared.drop_region()

    def close(self) -> None:
        """Close the streams and stop their deadlines' watchdog."""
        self.reset()
        self._watchdog.stop()


class Exchange:
    """The messages of one step (or pull) and their replies, each ps task's in order.

    Each ps task is sent ``first`` (encoded messages), then the planned
    ``requests``, then ``last``, at most :data:`WINDOW` in flight; a request is
    encoded when it is sent, from ``grads_of(i)``. :meth:`send_ready` may send
    a request before :meth:`finish` (its gradients are ready while backward
    still runs: :mod:`psframe.worker.overlap`), as long as every message ahead
    of it on its stream has gone and the window allows; :meth:`finish` sends
    the rest and waits for every reply. A failure to send early is left to
    :meth:`finish` (nothing is lost: a message leaves its queue once sent).
    """

    def __init__(
        self,
        streams: PushPullStreams,
        requests: Sequence[Request],
        grads_of: Callable[[int], Sequence[tuple[str, torch.Tensor]]],
        step: int,
        compress: bool,
        timeout: float,
        *,
        first: Sequence[tuple[int, bytes]] = (),
        last: Sequence[tuple[int, bytes]] = (),
        push_ids: Sequence[int] = (),
    ) -> None:
        self._streams = streams
        self._requests = requests
        self._grads_of = grads_of
        self._step, self._compress, self._timeout = step, compress, timeout
        self._push_ids = push_ids
        self._count, self._end = len(first), len(first) + len(requests)
        self._last = len(last)
        self._encoded = {j: data for j, (_, data) in enumerate(first)}
        self._encoded.update({self._end + k: data for k, (_, data) in enumerate(last)})
        self._unsent: dict[int, collections.deque[int]] = {}
        for j, (ps_task, _) in enumerate(first):
            self._unsent.setdefault(ps_task, collections.deque()).append(j)
        for i, request in enumerate(requests):
            self._unsent.setdefault(request.ps_task, collections.deque()).append(self._count + i)
        for k, (ps_task, _) in enumerate(last):
            self._unsent.setdefault(ps_task, collections.deque()).append(self._end + k)
        self._in_flight: dict[int, collections.deque[int]] = {ps_task: collections.deque() for ps_task in self._unsent}
        # Requests refused for a shared region, sent again (in messages) before the
        # rest, in the order first sent: a ps task applies a worker's pushes in order.
        self._again: dict[int, collections.deque[int]] = {ps_task: collections.deque() for ps_task in self._unsent}
        self._ready: set[int] | None = set()  # requests whose gradients are there; None: all
        self.sent_early = 0  # requests sent before finish()

    def send_ready(self, i: int) -> None:
        """Request ``i``'s gradients are complete: send it now if its turn and the window allow."""
        if self._ready is None:
            return
        self._ready.add(i)
        ps_task = self._requests[i].ps_task
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
            j = queue[0]
            if j in self._encoded:
                data = self._encoded[j]
            else:
                i = j - self._count
                if self._ready is not None and i not in self._ready:
                    return  # its gradients are not all there yet: it, and what follows, wait
                data = self._streams._encode(
                    self._requests[i],
                    self._grads_of(i),
                    self._step,
                    self._compress,
                    self._push_ids[i] if self._push_ids else 0,
                )
            self._streams._stream(ps_task).send(data, self._timeout)
            queue.popleft()  # only once sent: a failure leaves it to be sent again
            in_flight.append(j)

    def finish(self) -> list:
        """Send what is left and wait for every reply (see :meth:`PushPullStreams.exchange`)."""
        streams, count, end = self._streams, self._count, self._end
        self._ready = None
        replies: list = [None] * (end + self._last)
        failure: PsframeError | None = None
        resent = False
        for ps_task in self._unsent:
            self._send_more(ps_task)
        while any(self._in_flight.values()):
            for ps_task, waiting in self._in_flight.items():
                if not waiting:
                    continue
                j = waiting.popleft()
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
                if j in self._encoded:  # a message of `first` or `last`
                    header, tensors = replies[j] = codec.decode(data, pb.PushPullReplyHeader)
                    if header.region_unusable:  # refused behind a push refused for its region: not sent again
                        failure = failure or errors.SharedRegionError(header.region_unusable)
                    elif header.error_class:
                        failure = failure or transport.decode_error(header.error_class, header.error_message, peer)
                    self._send_more(ps_task)
                    continue
                prepared = streams.prepared[(self._requests[j - count], self._compress)]
                header, tensors = prepared.decode(data)
                if header.region_refused:
                    streams._share_with.discard(ps_task)
                if header.region_unusable:
                    # The task could not map the region (it was replaced, or another of its
                    # processes answered), or refused a push that came after one it could
                    # not map: nothing was applied; send the tensors in the message.
                    log.debug("%s: %s", peer, header.region_unusable)
                    prepared.drop_region()
                    self._again[ps_task].append(j)
                    resent = True
                elif header.error_class:
                    failure = failure or transport.decode_error(header.error_class, header.error_message, peer)
                replies[j] = Reply(header.global_step, header.dropped, tensors, header.duplicate)
                self._send_more(ps_task)
        if failure is not None:
            # A ps task may still hold the gradients a failed step left in regions
            # (a sync round waits for them): the next requests get regions of their own.
            for request in self._requests:
                left = streams.prepared.get((request, self._compress))
                if left is not None:
                    left.drop_region()
            raise failure
        if resent:  # a message of `last` may have been answered before a request sent again ahead of it
            replies[end:] = [None] * self._last
        return replies

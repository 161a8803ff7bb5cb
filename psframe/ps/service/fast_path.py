"""A stream's PushPull requests, worked out once: the ps task's fast path.

A worker's PushPull stream repeats a few kinds of request, one per message
of its step plan (:mod:`psframe.worker.plan.step_plan`): the same gradients, the same
pulls, every step. The first request of a kind is handled the general way,
every name, dtype and shape checked against the store, and leaves a
:class:`CachedRequest` behind: the request's layout, the variables its
gradients update, and the reply's layout with views of the variables it
pulls. A later request that matches a cached one skips all of that: its gradients
are read in place, applied, and the reply is written from the views.

A cached request holds for one generation of the store's variables
(:attr:`VariableStore.generation`); when the store makes its variables anew
(the chief created them again, a checkpoint was restored), cached requests of the
generation before are dropped and made again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psframe.errors import SharedRegionError
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion


@dataclass(eq=False)
class CachedRequest:
    """One kind of asynchronous PushPull request, checked once against a store.

    Attributes:
        caller: who sends it (checked when it was cached).
        pull: the names it pulls.
        request: where its gradients lie in the request.
        variables: the variables its gradients update, in request order.
        reply: where the pulled variables lie in the reply.
        reply_buffers: views of the pulled variables' bytes.
        generation: the store's generation of variables it was checked against.
    """

    caller: pb.Caller
    pull: list[str]
    request: MessageEncoding
    variables: list[torch.Tensor]
    reply: MessageEncoding
    reply_buffers: list
    generation: int

    @classmethod
    def make(
        cls,
        header: pb.PushPullHeader,
        variables: Sequence[torch.Tensor],
        pulled: Sequence[torch.Tensor],
        generation: int,
    ) -> CachedRequest:
        """The cached form of a request the store just answered: ``variables`` are those its
        gradients updated, ``pulled`` those it read (live, updated in place)."""
        request = MessageEncoding(
            pb.PushPullHeader,
            [(meta.name, codec.dtype_from_name(meta.dtype), tuple(meta.shape)) for meta in header.tensors],
        )
        reply = MessageEncoding(
            pb.PushPullReplyHeader,
            [(name, value.dtype, tuple(value.shape)) for name, value in zip(header.pull, pulled)],
        )
        caller = pb.Caller()
        caller.CopyFrom(header.caller)
        return cls(caller, list(header.pull), request, list(variables), reply, reply.buffers(pulled), generation)

    def matches(self, header: pb.PushPullHeader) -> bool:
        """Whether ``header`` is a request of this kind (the step and end-of-step may differ)."""
        return (
            not header.wire_dtype
            and header.caller == self.caller
            and header.pull == self.pull
            and self.request.matches(header)
        )


class StreamCache:
    """The cached requests of one PushPull stream, tried from the one after the last used,
    and the shared regions its requests named (:mod:`psframe.wire.same_host`).

    A stream's requests come in the same order every step, so the next
    request is almost always of the kind after the last one.
    """

    MAX_REQUESTS = 256  # a step of 1 GiB in 4 MiB messages; beyond, the general path

    def __init__(self) -> None:
        self._requests: list[CachedRequest] = []
        self._next = 0
        self._regions: dict[str, SameHostRegion] = {}
        # The number of a push refused for its region, until it comes again: the pushes
        # after it on this stream are refused too, so that a worker's pushes are applied
        # in the order it numbered them (the ledger's rule, psframe.ps.protocol.ledger).
        self._refused_push = 0

    def check_order(self, push_id: int) -> None:
        """Refuse a push that comes after one refused for its region, until that one came again.

        Raises:
            SharedRegionError: the worker sends it again, after the refused one.
        """
        if self._refused_push and push_id > self._refused_push:
            raise SharedRegionError(
                f"push {push_id} follows push {self._refused_push}, refused for its "
                f"shared region: both are sent again, in order"
            )
        if push_id == self._refused_push:
            self._refused_push = 0

    def open_region(self, envelope: codec.Envelope) -> tuple[codec.Envelope, SameHostRegion | None, str]:
        """Where the tensors of a request that names a shared region lie, the region, and why
        the region is refused (empty if it is not).

        Raises:
            SharedRegionError: the tensors are in a region that cannot be used
                (the worker then sends them in the message).
        """
        message = envelope.header.same_host
        try:
            region = self.region(message)
        except SharedRegionError as e:
            if message.in_region:
                push_id = envelope.header.push_id
                if push_id and not self._refused_push:
                    self._refused_push = push_id
                raise
            return envelope, None, str(e)  # an offer: the tensors came in the message
        return (region.request_envelope(envelope.header) if message.in_region else envelope), region, ""

    def region(self, message: pb.SameHostRegion) -> SameHostRegion:
        """The region ``message`` names, mapped on first use.

        Raises:
            SharedRegionError: it cannot be mapped here, or is not as named.
        """
        region = self._regions.get(message.path)
        if region is not None and region.matches(message):
            return region
        region = SameHostRegion.attach(message)
        if len(self._regions) >= self.MAX_REQUESTS:  # a worker makes one per kind of request
            self._regions.clear()
        self._regions[message.path] = region
        return region

    def find(self, header: pb.PushPullHeader) -> CachedRequest | None:
        """The cached request ``header`` matches, or None."""
        cache = self._requests
        count = len(cache)
        for i in range(count):
            index = (self._next + i) % count
            if cache[index].matches(header):
                self._next = (index + 1) % count
                return cache[index]
        return None

    def add(self, cached: CachedRequest) -> None:
        """Keep ``cached`` (dropping any of an older generation)."""
        cache = [p for p in self._requests if p.generation == cached.generation]
        if len(cache) < self.MAX_REQUESTS:
            cache.append(cached)
        self._requests = cache
        self._next = len(cache)  # the next request is of a kind after this one

    def drop(self, cached: CachedRequest) -> None:
        """Forget ``cached`` (its store's variables were made anew)."""
        self._requests = [p for p in self._requests if p is not cached]
        self._next = 0

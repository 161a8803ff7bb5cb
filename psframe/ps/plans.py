"""A stream's PushPull requests, worked out once: the ps task's fast path.

A worker's PushPull stream repeats a few kinds of request, one per message
of its step plan (:mod:`psframe.worker.slicer`): the same gradients, the same
pulls, every step. The first request of a kind is handled the general way,
every name, dtype and shape checked against the store, and leaves a
:class:`RequestPlan` behind: the request's layout, the variables its
gradients update, and the reply's layout with views of the variables it
pulls. A later request that matches a plan skips all of that: its gradients
are read in place, applied, and the reply is written from the views.

A plan holds for one generation of the store's variables
(:attr:`VariableStore.generation`); when the store makes its variables anew
(the chief created them again, a checkpoint was adopted), plans of the
generation before are dropped and made again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psframe.errors import SharedRegionError
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire.layout import Layout
from psframe.wire.shared_region import SharedRegion


@dataclass(eq=False)
class RequestPlan:
    """One kind of asynchronous PushPull request, checked once against a store.

    Attributes:
        caller: who sends it (checked when the plan was made).
        pull: the names it pulls.
        request: where its gradients lie in the request.
        variables: the variables its gradients update, in request order.
        reply: where the pulled variables lie in the reply.
        reply_buffers: views of the pulled variables' bytes.
        generation: the store's generation of variables it was checked against.
    """

    caller: pb.Caller
    pull: list[str]
    request: Layout
    variables: list[torch.Tensor]
    reply: Layout
    reply_buffers: list
    generation: int

    @classmethod
    def make(
        cls,
        header: pb.PushPullHeader,
        variables: Sequence[torch.Tensor],
        pulled: Sequence[torch.Tensor],
        generation: int,
    ) -> RequestPlan:
        """The plan of a request the store just answered: ``variables`` are those its
        gradients updated, ``pulled`` those it read (live, updated in place)."""
        request = Layout(
            pb.PushPullHeader,
            [(meta.name, codec.dtype_from_name(meta.dtype), tuple(meta.shape)) for meta in header.tensors],
        )
        reply = Layout(
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


class StreamPlans:
    """The plans of one PushPull stream, tried from the one after the last used,
    and the shared regions its requests named (:mod:`psframe.wire.shared_region`).

    A stream's requests come in the same order every step, so the next
    request is almost always of the kind after the last one.
    """

    MAX_PLANS = 256  # a step of 1 GiB in 4 MiB messages; beyond, the general path

    def __init__(self) -> None:
        self._plans: list[RequestPlan] = []
        self._next = 0
        self._regions: dict[str, SharedRegion] = {}
        # The number of a push refused for its region, until it comes again: the pushes
        # after it on this stream are refused too, so that a worker's pushes are applied
        # in the order it numbered them (the ledger's rule, psframe.ps.ledger).
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

    def shared(self, envelope: codec.Envelope) -> tuple[codec.Envelope, SharedRegion | None, str]:
        """Where the tensors of a request that names a shared region lie, the region, and why
        the region is refused (empty if it is not).

        Raises:
            SharedRegionError: the tensors are in a region that cannot be used
                (the worker then sends them in the message).
        """
        message = envelope.header.shared
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

    def region(self, message: pb.SharedRegion) -> SharedRegion:
        """The region ``message`` names, mapped on first use.

        Raises:
            SharedRegionError: it cannot be mapped here, or is not as named.
        """
        region = self._regions.get(message.path)
        if region is not None and region.matches(message):
            return region
        region = SharedRegion.attach(message)
        if len(self._regions) >= self.MAX_PLANS:  # a worker makes one per kind of request
            self._regions.clear()
        self._regions[message.path] = region
        return region

    def find(self, header: pb.PushPullHeader) -> RequestPlan | None:
        """The plan ``header`` matches, or None."""
        plans = self._plans
        count = len(plans)
        for i in range(count):
            index = (self._next + i) % count
            if plans[index].matches(header):
                self._next = (index + 1) % count
                return plans[index]
        return None

    def add(self, plan: RequestPlan) -> None:
        """Keep ``plan`` (dropping any of an older generation)."""
        plans = [p for p in self._plans if p.generation == plan.generation]
        if len(plans) < self.MAX_PLANS:
            plans.append(plan)
        self._plans = plans
        self._next = len(plans)  # the next request is of a kind after this one

    def drop(self, plan: RequestPlan) -> None:
        """Forget ``plan`` (its store's variables were made anew)."""
        self._plans = [p for p in self._plans if p is not plan]
        self._next = 0

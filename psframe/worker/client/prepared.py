"""One planned PushPull request as a worker sends it every step: the work done once.

A worker sends each ps task the same planned requests every step; only the
step and the tensors' values change. A :class:`PreparedRequest` keeps the
header, and learns the layouts of the request's gradients and of the reply's
values from the first message of each, so that later ones that fit are
encoded and decoded without per-tensor work (:mod:`psframe.wire.encoding`).

On the ps task's host it also moves the tensors through a shared region
(:mod:`psframe.wire.same_host`): the second request of its kind (both
layouts known) offers one; once the ps task answered in it, the requests
leave their gradients there and carry only the header.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from psframe.errors import WireFormatError
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion

log = logging.getLogger(__name__)


class PreparedRequest:
    """What one planned request sends and gets back every step, worked out on first use.

    Args:
        header: the request's header; only its step and push number change from one message to the next.
        share: offer the ps task a shared region (it and this worker may share a host).
    """

    def __init__(self, header: pb.PushPullHeader, share: bool = False) -> None:
        self.header = header
        self.share = share
        self._request: MessageEncoding | None = None
        self._reply: MessageEncoding | None = None
        self._region: SameHostRegion | None = None
        self._in_region = False  # the ps task answered in the region: requests leave their tensors there

    @property
    def in_region(self) -> bool:
        """Whether requests leave their tensors in the shared region (the ps task answered in it)."""
        return self._in_region

    def encode(self, step: int, grads: Sequence[tuple[str, torch.Tensor]], push_id: int = 0) -> bytes:
        """The request of ``step`` carrying ``grads``, numbered ``push_id`` (0: it pushes nothing)."""
        self.header.step = step
        self.header.push_id = push_id
        if self._request is None:
            self._request = MessageEncoding(pb.PushPullHeader, [(name, g.dtype, tuple(g.shape)) for name, g in grads])
        try:
            buffers = self._request.buffers([g for _, g in grads])
        except WireFormatError:  # gradients of another layout, or not contiguous: general, in the message
            self.share = False
            self.drop_region()
            header = pb.PushPullHeader()
            header.CopyFrom(self.header)
            return codec.encode(header, grads)
        if self._in_region:
            assert self._region is not None  # in a region only while it holds one (drop_region clears both)
            self._region.write_request(self._request, buffers)
            return self._request.encode_header(self.header)
        if self._region is None and self.share and self._reply is not None:
            self._offer_region()  # the second message of its kind: a request sent once never makes one
        return self._request.encode(self.header, buffers)

    def decode(self, data: bytes) -> tuple[pb.PushPullReplyHeader, list[torch.Tensor]]:
        """The reply's header and values (views of the reply, or of the shared region:
        read them before this request is sent again).

        Raises:
            WireFormatError: the reply does not fit its header.
        """
        envelope = codec.parse(data, pb.PushPullReplyHeader)
        header = envelope.header
        if header.in_region:
            if self._region is None:
                raise WireFormatError("a reply in a shared region this request did not offer")
            envelope = self._region.reply_envelope(header)
            if not self._in_region:  # accepted: both sides have it mapped, the file can go
                self._in_region = self.header.same_host.in_region = True
                self._region.unlink()
        elif header.region_refused:
            log.debug("the ps task will not share a region: %s", header.region_refused)
            self.share = False
            self.drop_region()
        if self._reply is not None and self._reply.matches(header):
            tensors = self._reply.tensors(envelope)
        else:
            tensors = codec.tensors_of(envelope)
            if not (header.error_class or header.region_unusable) and self._reply is None:  # a refusal has no tensors
                self._reply = MessageEncoding(
                    pb.PushPullReplyHeader,
                    [(meta.name, t.dtype, tuple(t.shape)) for meta, t in zip(header.tensors, tensors)],
                )
        return header, tensors

    def _offer_region(self) -> None:
        if not self.share or self._request is None or self._reply is None or self.header.wire_dtype:
            return
        try:
            self._region = SameHostRegion.create(self._request, self._reply)
        except OSError as e:
            log.debug("no shared region (%s): tensors travel in messages", e)
            self.share = False
            return
        self.header.same_host.CopyFrom(self._region.message)

    def drop_region(self) -> None:
        """Send the tensors in messages again (the ps task could not use the region, or was
        replaced); the next request offers a new region."""
        if self._region is not None:
            self._region.unlink()
            self._region = None
        self._in_region = False
        self.header.ClearField("same_host")

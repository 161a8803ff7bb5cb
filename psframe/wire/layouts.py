"""Received messages read through layouts learned once: a sender's repeated messages.

A worker sends a ps task the same kinds of request every step, one per
message of its step plan (:mod:`psframe.worker.plan.step_plan`). The
:class:`Layouts` of a stream read the first message of a kind in full
(:func:`~psframe.wire.encoding.tensors_of`: every tensor's metadata checked
against the payload) and keep its :class:`~psframe.wire.encoding.MessageEncoding`;
a later message whose header lists the same tensors at the same places is
read through it, its tensors made as views without a check each. Where a
message's tensors share one dtype, it comes with their :class:`Span`: one
tensor over all of their bytes, so that a sum of whole messages (a
synchronous round's, :mod:`psframe.ps.protocol.round_mean`) takes one
operation per message instead of one per tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from psframe.wire.encoding import Envelope, MessageEncoding, tensors_of


class Span(NamedTuple):
    """A received message's tensors as one stretch of its bytes (:meth:`MessageEncoding.span`)."""

    tensor: torch.Tensor  # 1-D, a view of the message, the padding between its tensors included
    places: tuple[tuple[str, int, tuple[int, ...]], ...]  # each tensor's name, first element and shape in it


class Layouts:
    """The layouts of the messages one sender repeats, tried from the one after the last used.

    Only messages of whole tensors (no tensor of a ``kind`` other than
    ``VALUE``: rows of tables change shape every step) placed as psframe
    places them are learned; any other is read in full every time.
    """

    MAX_LAYOUTS = 256  # a step of 1 GiB in 4 MiB messages; beyond, they are learned afresh

    def __init__(self) -> None:
        self._layouts: list[MessageEncoding] = []
        self._next = 0

    def read(self, envelope: Envelope) -> tuple[list[torch.Tensor], Span | None]:
        """The tensors of ``envelope`` (views of it where aligned), and their span where their
        layout is known and they share one dtype.

        Raises:
            WireFormatError: a tensor's metadata does not fit the payload (a message of a kind
                not seen before: :func:`~psframe.wire.encoding.tensors_of`).
        """
        header = envelope.header
        layouts = self._layouts
        count = len(layouts)
        for i in range(count):
            index = (self._next + i) % count
            layout = layouts[index]
            if layout.payload_length == envelope.payload_length and layout.matches(header):
                self._next = (index + 1) % count
                return layout.tensors(envelope), _span(layout, envelope)
        tensors = tensors_of(envelope)  # checked against the payload before anything is learned of it
        learned = self._learn(envelope, tensors)
        return tensors, (_span(learned, envelope) if learned is not None else None)

    def _learn(self, envelope: Envelope, tensors: list[torch.Tensor]) -> MessageEncoding | None:
        metas = envelope.header.tensors
        if not metas or any(meta.kind for meta in metas):
            return None
        specs = [(meta.name, tensor.dtype, tuple(meta.shape)) for meta, tensor in zip(metas, tensors)]
        layout = MessageEncoding(type(envelope.header), specs)
        if layout.payload_length != envelope.payload_length or not layout.matches(envelope.header):
            return None  # placed otherwise than psframe places tensors: read in full each time
        if len(self._layouts) >= self.MAX_LAYOUTS:
            self._layouts.clear()
        self._layouts.append(layout)
        self._next = len(self._layouts)  # the next message is of a kind after this one
        return layout


def _span(layout: MessageEncoding, envelope: Envelope) -> Span | None:
    span = layout.span(envelope)
    return Span(span, layout.span_places) if span is not None and layout.span_places is not None else None

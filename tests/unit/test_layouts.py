"""Unit tests for psframe.wire.layouts: a sender's repeated messages read through layouts learned once.

Oracle: :func:`psframe.wire.encoding.tensors_of`, the general reader, on the same bytes.
"""

from __future__ import annotations

import pytest
import torch

from psframe.errors import WireFormatError
from psframe.wire import codec, encoding, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.layouts import Layouts


def _message(seed: int, named: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    named = named or {"w": ((5, 3), torch.float32), "b": ((3,), torch.float32), "s": ((), torch.float32)}
    tensors = [(name, torch.randn(shape, generator=generator).to(dtype)) for name, (shape, dtype) in named.items()]
    return codec.encode(pb.PushPullHeader(step=seed, pull=["w"]), tensors)


def _assert_read_as_in_full(tensors: list[torch.Tensor], envelope: encoding.Envelope) -> None:
    expected = encoding.tensors_of(envelope)
    assert len(tensors) == len(expected)
    for got, want in zip(tensors, expected):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr()  # a view of the message, not a copy


def test_a_kind_seen_before_is_read_through_its_layout_with_its_span():
    layouts = Layouts()
    first = encoding.parse(_message(1), pb.PushPullHeader)
    tensors, span = layouts.read(first)
    _assert_read_as_in_full(tensors, first)
    assert span is not None and len(layouts._layouts) == 1
    for seed in (2, 3):  # other values, the same kind: no new layout
        envelope = encoding.parse(_message(seed), pb.PushPullHeader)
        tensors, span = layouts.read(envelope)
        _assert_read_as_in_full(tensors, envelope)
        assert len(layouts._layouts) == 1
        assert span is not None and span.places == layouts._layouts[0].span_places
        assert [name for name, _, _ in span.places] == ["w", "b", "s"]
        for (_, first, shape), tensor in zip(span.places, tensors):
            view = span.tensor[first : first + tensor.numel()].view(shape)
            assert view.data_ptr() == tensor.data_ptr() and torch.equal(view, tensor)


def test_tensors_of_several_dtypes_have_no_span():
    named = {"w": ((4,), torch.float32), "i": ((3,), torch.int64)}
    layouts = Layouts()
    for seed in (1, 2):
        envelope = encoding.parse(_message(seed, named), pb.PushPullHeader)
        tensors, span = layouts.read(envelope)
        _assert_read_as_in_full(tensors, envelope)
        assert span is None
    assert len(layouts._layouts) == 1


def test_messages_of_rows_are_not_learned():
    ids, rows = torch.tensor([1, 4]), torch.ones(2, 3)
    data = codec.encode(pb.PushPullHeader(), [("emb", ids), ("emb", rows)], [row_tensors.ROW_IDS, row_tensors.ROWS])
    layouts = Layouts()
    envelope = encoding.parse(data, pb.PushPullHeader)
    tensors, span = layouts.read(envelope)
    _assert_read_as_in_full(tensors, envelope)
    assert span is None and not layouts._layouts


def test_tensors_placed_otherwise_are_read_in_full_every_time():
    payload = bytes(8) + torch.arange(3, dtype=torch.float32).numpy().tobytes()
    header = pb.PushPullHeader()
    header.tensors.add(name="w", dtype="float32", shape=[3], offset=8, nbytes=12)  # psframe would place it at 0
    # an envelope of that payload, built by hand
    data = encoding.PAYLOAD_TAG + encoding.varint(len(payload)) + payload
    data += encoding.HEADER_TAG + encoding.varint(header.ByteSize()) + header.SerializeToString()
    layouts = Layouts()
    envelope = encoding.parse(data, pb.PushPullHeader)
    (tensor,), span = layouts.read(envelope)
    assert tensor.tolist() == [0.0, 1.0, 2.0]
    assert span is None and not layouts._layouts


def test_a_payload_shorter_than_its_kind_is_refused():
    layouts = Layouts()
    layouts.read(encoding.parse(_message(1), pb.PushPullHeader))
    envelope = encoding.parse(_message(2), pb.PushPullHeader)
    short = envelope._replace(payload_length=envelope.payload_length - 8)
    with pytest.raises(WireFormatError, match="outside the payload"):
        layouts.read(short)


def test_a_misaligned_message_is_copied_and_has_no_span():
    layouts = Layouts()
    layouts.read(encoding.parse(_message(1), pb.PushPullHeader))
    data = _message(2)
    shifted = bytearray(1) + bytearray(data)  # the same message one byte further on
    envelope = encoding.parse(memoryview(shifted)[1:], pb.PushPullHeader)
    tensors, span = layouts.read(envelope)
    assert span is None
    expected = encoding.tensors_of(encoding.parse(data, pb.PushPullHeader))
    assert all(torch.equal(got, want) for got, want in zip(tensors, expected))

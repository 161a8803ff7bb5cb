"""Unit tests for psframe.wire.encoding: messages of a fixed list of tensors, placed once.

Oracles: the message codec.encode makes of the same header and tensors, and
codec.decode of what a layout encodes.
"""

from __future__ import annotations

import pytest
import torch

from psframe.errors import WireFormatError
from psframe.wire import codec, dtypes, encoding
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from tests.unit.test_codec import ALL_DTYPES, _random_tensor

SHAPES = [(3, 5), (), (0, 4), (7,), (1, 1, 9)]


def _named(dtype_names: list[str], seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"t{i}", _random_tensor(dtypes.DTYPES[name], SHAPES[i % len(SHAPES)], seed + i))
        for i, name in enumerate(dtype_names)
    ]


def _layout(header_type, named) -> MessageEncoding:
    return MessageEncoding(header_type, [(name, t.dtype, t.shape) for name, t in named])


@pytest.mark.parametrize(
    "dtype_names", [ALL_DTYPES, ["float32"] * 4, ["int8", "float64", "bfloat16", "bool", "float32"], []]
)
def test_a_layout_encodes_the_message_encode_makes(dtype_names):
    named = _named(dtype_names)
    layout = _layout(pb.PushPullReplyHeader, named)
    buffers = layout.buffers([t for _, t in named])
    expected = codec.encode(pb.PushPullReplyHeader(global_step=41, dropped=True), named)
    data = layout.encode(pb.PushPullReplyHeader(global_step=41, dropped=True), buffers)
    # The same payload, byte for byte; the same header, its fields perhaps in another order.
    payload = encoding.parse(expected, pb.PushPullReplyHeader)
    assert (
        data[: payload.payload_start + payload.payload_length]
        == expected[: payload.payload_start + payload.payload_length]
    )
    assert pb.PushPullResponse.FromString(data) == pb.PushPullResponse.FromString(expected)


@pytest.mark.parametrize("dtype_names", [ALL_DTYPES, ["float32", "bfloat16", "int64"]])
def test_a_layout_reads_the_tensors_of_a_matching_message(dtype_names):
    named = _named(dtype_names, seed=3)
    header = pb.PushPullHeader(step=9, pull=["a"], end_of_step=True)
    data = codec.encode(header, named)
    envelope = encoding.parse(data, pb.PushPullHeader)
    layout = _layout(pb.PushPullHeader, named)
    assert layout.matches(envelope.header)
    tensors = layout.tensors(envelope)
    assert len(tensors) == len(named)
    for (_, sent), got in zip(named, tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(
            got.view(torch.uint8) if got.numel() and got.dim() else got,
            sent.view(torch.uint8) if sent.numel() and sent.dim() else sent,
        )
    # Views of the received bytes, not copies (for the tensors with bytes).
    for got in tensors:
        if got.numel():
            base = encoding.tensors_of(envelope)  # the general reader's views, same addresses
            assert any(got.data_ptr() == b.data_ptr() for b in base)


def test_buffers_follow_tensors_updated_in_place():
    named = [("w", torch.zeros(4, 3)), ("b", torch.zeros(3))]
    layout = _layout(pb.PushPullReplyHeader, named)
    buffers = layout.buffers([t for _, t in named])
    with torch.no_grad():
        named[0][1].add_(2.5)
        named[1][1].fill_(-1.0)
    _, tensors = codec.decode(layout.encode(pb.PushPullReplyHeader(), buffers), pb.PushPullReplyHeader)
    assert torch.equal(tensors[0], torch.full((4, 3), 2.5))
    assert torch.equal(tensors[1], torch.full((3,), -1.0))


@pytest.mark.parametrize("change", ["name", "shape", "dtype", "order", "fewer", "offset"])
def test_a_message_of_other_tensors_does_not_match(change):
    named = [("w", torch.ones(4, 3)), ("b", torch.ones(3))]
    layout = _layout(pb.PushPullHeader, named)
    other = {
        "name": [("v", torch.ones(4, 3)), ("b", torch.ones(3))],
        "shape": [("w", torch.ones(3, 4)), ("b", torch.ones(3))],
        "dtype": [("w", torch.ones(4, 3, dtype=torch.float64)), ("b", torch.ones(3))],
        "order": [("b", torch.ones(3)), ("w", torch.ones(4, 3))],
        "fewer": [("w", torch.ones(4, 3))],
    }.get(change)
    if change == "offset":  # same tensors, placed by another encoder
        header = pb.PushPullHeader()
        header.tensors.add(name="w", dtype="float32", shape=[4, 3], offset=16, nbytes=48)
        header.tensors.add(name="b", dtype="float32", shape=[3], offset=64, nbytes=12)
    else:
        header = encoding.parse(codec.encode(pb.PushPullHeader(), other), pb.PushPullHeader).header
    assert not layout.matches(header)


def test_a_payload_shorter_than_its_layout_is_refused():
    named = [("w", torch.ones(8))]
    layout = _layout(pb.PushPullHeader, named)
    data = codec.encode(pb.PushPullHeader(), named)
    envelope = encoding.parse(data, pb.PushPullHeader)
    short = envelope._replace(payload_length=envelope.payload_length - 4)
    with pytest.raises(WireFormatError, match="payload of"):
        layout.tensors(short)


def test_a_misaligned_buffer_is_copied_not_viewed():
    named = [("w", torch.arange(6, dtype=torch.float64))]
    data = codec.encode(pb.PushPullHeader(), named)
    layout = _layout(pb.PushPullHeader, named)
    shifted = bytearray(1) + bytearray(data)  # the same message one byte further on
    envelope = encoding.parse(memoryview(shifted)[1:], pb.PushPullHeader)
    (tensor,) = layout.tensors(envelope)
    assert torch.equal(tensor, named[0][1])
    assert tensor.data_ptr() % 8 == 0


@pytest.mark.parametrize("bad", ["dtype", "shape", "count", "noncontiguous"])
def test_buffers_refuse_tensors_that_do_not_fit(bad):
    layout = MessageEncoding(pb.PushPullReplyHeader, [("w", torch.float32, (4, 3))])
    tensor = {
        "dtype": [torch.zeros(4, 3, dtype=torch.float64)],
        "shape": [torch.zeros(3, 4)],
        "count": [torch.zeros(4, 3), torch.zeros(1)],
        "noncontiguous": [torch.zeros(3, 4).t()],
    }[bad]
    with pytest.raises(WireFormatError):
        layout.buffers(tensor)


def test_encode_refuses_a_header_that_lists_tensors():
    layout = MessageEncoding(pb.PushPullReplyHeader, [("w", torch.float32, (2,))])
    header = pb.PushPullReplyHeader()
    header.tensors.add(name="x", dtype="float32", shape=[2], offset=0, nbytes=8)
    with pytest.raises(ValueError, match="lists tensors"):
        layout.encode(header, layout.buffers([torch.zeros(2)]))

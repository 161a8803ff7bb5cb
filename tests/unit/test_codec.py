"""Unit tests for psframe.wire.codec: tensors <-> envelope bytes, and optimizer specs <-> OptimizerDef.

Oracles: bitwise equality with the tensors sent, the generated protobuf classes
as an independent parser, and addresses inside the received bytes object.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from psframe import optim
from psframe.errors import OptimizerConfigError, PsframeError, WireFormatError
from psframe.wire import codec, dtypes, encoding, messages
from psframe.wire import psframe_pb2 as pb

ALL_DTYPES = sorted(dtypes.DTYPES)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random-ish bits of every byte position, valid for the dtype (no NaN patterns needed)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        real = torch.randn(shape, generator=g, dtype=torch.float64) * 37.5
        if dtype.is_complex:
            imag = torch.randn(shape, generator=g, dtype=torch.float64) * 11.25
            return torch.complex(real, imag).to(dtype)
        return real.to(dtype)
    # Integers: random bytes reinterpreted, so every bit of every element varies.
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    """The tensor's elements as little-endian bytes, in C order."""
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _address(data: bytes) -> int:
    return torch.frombuffer(data, dtype=torch.uint8).data_ptr()


def _roundtrip(tensors, header=None, header_type=pb.PushPullHeader):
    header = header if header is not None else header_type()
    data = codec.encode(header, tensors)
    assert isinstance(data, bytes)
    return data, *codec.decode(data, header_type)


# ---------------------------------------------------------------------------- dtypes


def test_dtypes_cover_the_fixed_size_torch_types():
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex128",
        "complex64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    ):
        assert dtypes.DTYPES[name] is getattr(torch, name)
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            assert dtypes.DTYPES[name] is getattr(torch, name)
    for name, dtype in dtypes.DTYPES.items():
        assert dtypes.dtype_name(dtype) == name
        assert dtypes.dtype_from_name(name) is dtype


def test_dtype_name_errors():
    with pytest.raises(WireFormatError, match="qint8"):
        dtypes.dtype_name(torch.qint8)
    with pytest.raises(WireFormatError, match="'float128'"):
        dtypes.dtype_from_name("float128")
    with pytest.raises(WireFormatError, match="'torch.float32'"):
        dtypes.dtype_from_name("torch.float32")


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_roundtrip_every_dtype_bitwise(name):
    dtype = dtypes.DTYPES[name]
    t = _random_tensor(dtype, (5, 7), seed=len(name))
    if t.numel() > 1 and t.element_size() > 1:
        assert len(set(_bits(t))) > 8  # really random-ish bytes, not zeros
    _data, header, (out,) = _roundtrip([("v/" + name, t)])
    assert out.dtype == dtype
    assert out.shape == (5, 7)
    assert _same(out, t)
    (meta,) = header.tensors
    assert (meta.name, meta.dtype, list(meta.shape), meta.nbytes) == ("v/" + name, name, [5, 7], 35 * t.element_size())


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_roundtrip_0d_tensor(name):
    dtype = dtypes.DTYPES[name]
    t = _random_tensor(dtype, (1,), seed=3).reshape(())
    _, header, (out,) = _roundtrip([("scalar", t)])
    assert out.shape == ()
    assert list(header.tensors[0].shape) == []
    assert header.tensors[0].nbytes == t.element_size()
    assert _same(out, t)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "complex128", "bool", "uint8"])
def test_roundtrip_empty_tensor(name):
    dtype = dtypes.DTYPES[name]
    empty = torch.empty((0, 3), dtype=dtype)
    after = _random_tensor(dtype, (4,), seed=9)
    _, header, (out, out_after) = _roundtrip([("empty", empty), ("after", after)])
    assert out.shape == (0, 3) and out.dtype == dtype
    assert header.tensors[0].nbytes == 0
    assert _same(out_after, after)


@pytest.mark.parametrize("name", ["float64", "float16", "bfloat16", "complex64", "int32", "bool"])
def test_roundtrip_non_contiguous(name):
    base = _random_tensor(dtypes.DTYPES[name], (4, 6), seed=5)
    transposed = base.t()
    strided = base[:, ::2]
    assert not transposed.is_contiguous() and not strided.is_contiguous()
    _, _header, (a, b) = _roundtrip([("t", transposed), ("s", strided)])
    assert a.shape == (6, 4) and b.shape == (4, 3)
    assert a.is_contiguous() and b.is_contiguous()
    assert _same(a, transposed.contiguous())
    assert _same(b, strided.contiguous())
    # Element by element, not just the same bytes in some order.
    assert _same(a[1], base[:, 1])
    assert _same(b[:, 1], base[:, 2])


def test_many_tensors_of_mixed_dtypes_and_sizes():
    rng = random.Random(1)
    tensors = []
    for i in range(120):
        name = ALL_DTYPES[i % len(ALL_DTYPES)]
        shape = tuple(rng.randrange(0, 5) for _ in range(rng.randrange(0, 4)))
        tensors.append((f"layer{i}.weight", _random_tensor(dtypes.DTYPES[name], shape, seed=i)))
    _data, header, outs = _roundtrip(tensors, pb.PushPullHeader(pull=["x"], end_of_step=True))
    assert [m.name for m in header.tensors] == [n for n, _ in tensors]
    assert len(outs) == len(tensors)
    for (name, t), out in zip(tensors, outs):
        assert _same(out, t), name
    assert list(header.pull) == ["x"] and header.end_of_step


def test_encode_replaces_stale_tensor_metadata_in_header():
    header = pb.PushPullHeader(tensors=[pb.TensorMeta(name="stale", dtype="float32", shape=[1], nbytes=4)])
    t = torch.arange(3, dtype=torch.int16)
    _, out_header, (out,) = _roundtrip([("fresh", t)], header)
    assert [m.name for m in out_header.tensors] == ["fresh"]
    assert _same(out, t)


# ------------------------------------------------------------- the bytes are protobuf


def test_encoded_bytes_parse_with_generated_class():
    caller = pb.Caller(job_name="worker", task_index=3, cluster_fingerprint="0123456789abcdef")
    header = pb.PushPullHeader(caller=caller, step=41, pull=["w", "b"], end_of_step=True)
    tensors = [
        ("w", _random_tensor(torch.float32, (3, 5), seed=1)),
        ("b", _random_tensor(torch.int8, (3,), seed=2)),  # 3 bytes: the next one needs padding
        ("c", _random_tensor(torch.float64, (2, 2), seed=3)),
        ("e", torch.empty((0,), dtype=torch.bfloat16)),
        ("z", _random_tensor(torch.complex128, (1,), seed=4).reshape(())),
    ]
    data = codec.encode(header, tensors)
    message = pb.PushPullRequest.FromString(data)
    parsed = message.header
    assert parsed.caller == caller
    assert (parsed.step, list(parsed.pull), parsed.end_of_step) == (41, ["w", "b"], True)
    assert [m.name for m in parsed.tensors] == ["w", "b", "c", "e", "z"]
    assert [m.dtype for m in parsed.tensors] == ["float32", "int8", "float64", "bfloat16", "complex128"]
    assert [list(m.shape) for m in parsed.tensors] == [[3, 5], [3], [2, 2], [0], []]
    payload = message.payload
    for meta, (_, t) in zip(parsed.tensors, tensors):
        assert meta.nbytes == t.numel() * t.element_size()
        assert payload[meta.offset : meta.offset + meta.nbytes] == _bits(t), meta.name
    # Every tensor starts on an 8-byte boundary of the message (payload starts at
    # its tag + length prefix; the message starts at 0).
    payload_start = data.index(payload)
    for meta in parsed.tensors:
        assert (payload_start + meta.offset) % encoding.ALIGNMENT == 0, meta.name


@pytest.mark.parametrize(
    "header_type, envelope",
    [
        (pb.InitHeader, pb.InitRequest),
        (pb.InitReplyHeader, pb.InitResponse),
        (pb.PushPullReplyHeader, pb.PushPullResponse),
    ],
)
def test_other_envelopes_parse(header_type, envelope):
    t = _random_tensor(torch.float16, (2, 3), seed=7)
    data = codec.encode(header_type(), [("v", t)])
    message = envelope.FromString(data)
    (meta,) = message.header.tensors
    assert message.payload[meta.offset : meta.offset + meta.nbytes] == _bits(t)
    _, (out,) = codec.decode(data, header_type)
    assert _same(out, t)


def test_envelope_without_tensors():
    data = codec.encode(pb.InitReplyHeader(created=True, global_step=7), ())
    assert pb.InitResponse.FromString(data).header == pb.InitReplyHeader(created=True, global_step=7)
    header, tensors = codec.decode(data, pb.InitReplyHeader)
    assert tensors == []
    assert header.created and header.global_step == 7
    header, tensors = codec.decode(b"", pb.PushPullReplyHeader)
    assert tensors == [] and header == pb.PushPullReplyHeader()


# ------------------------------------------------------------------------ zero copy


def test_decoded_tensors_are_aligned_views_into_the_message():
    tensors = [
        ("a", _random_tensor(torch.int8, (5,), seed=1)),
        ("b", _random_tensor(torch.float64, (3, 3), seed=2)),
        ("c", _random_tensor(torch.bfloat16, (7,), seed=3)),
        ("d", _random_tensor(torch.complex128, (2,), seed=4)),
        ("e", _random_tensor(torch.bool, (3,), seed=5)),
        ("f", _random_tensor(torch.int64, (), seed=6)),
    ]
    data = codec.encode(pb.PushPullHeader(), tensors)
    base = _address(data)
    # The address oracle itself: the bytes object's buffer (ctypes agrees).
    assert base == ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    _, outs = codec.decode(data, pb.PushPullHeader)
    for (name, t), out in zip(tensors, outs):
        nbytes = t.numel() * t.element_size()
        ptr = out.data_ptr()
        assert base <= ptr and ptr + nbytes <= base + len(data), name
        assert data[ptr - base : ptr - base + nbytes] == _bits(t), name
        assert ptr % encoding.ALIGNMENT == 0, name
        assert _same(out, t)


def test_header_first_serialization_decodes():
    """A message made the ordinary protobuf way (header first) decodes too, aligned or not."""
    for pad in range(0, 9):  # header sizes vary, so the payload lands on every alignment
        tensors = [
            ("x" * (pad + 1), _random_tensor(torch.float64, (4,), seed=pad)),
            ("y", _random_tensor(torch.complex128, (2, 2), seed=pad + 10)),
            ("z", _random_tensor(torch.bfloat16, (3,), seed=pad + 20)),
            ("s", _random_tensor(torch.int32, (), seed=pad + 30)),
        ]
        ours = pb.PushPullRequest.FromString(codec.encode(pb.PushPullHeader(step=pad), tensors))
        data = pb.PushPullRequest(header=ours.header, payload=ours.payload).SerializeToString()
        assert data[:1] == b"\x0a"  # header first: not the layout encode() writes
        header, outs = codec.decode(data, pb.PushPullHeader)
        assert header.step == pad
        for (name, t), out in zip(tensors, outs):
            assert _same(out, t), (pad, name)
            # In place or copied, never a misaligned view.
            assert out.data_ptr() % min(out.element_size(), encoding.ALIGNMENT) == 0, (pad, name)


def test_hand_made_message_with_unpadded_offsets():
    """Offsets need not be aligned: tensors packed back to back still decode exactly."""
    a = _random_tensor(torch.int8, (3,), seed=1)
    b = _random_tensor(torch.float64, (2,), seed=2)
    c = _random_tensor(torch.float32, (2,), seed=3)
    payload = _bits(a) + _bits(b) + _bits(c)
    header = pb.PushPullHeader(
        tensors=[
            pb.TensorMeta(name="a", dtype="int8", shape=[3], offset=0, nbytes=3),
            pb.TensorMeta(name="b", dtype="float64", shape=[2], offset=3, nbytes=16),
            pb.TensorMeta(name="c", dtype="float32", shape=[2], offset=19, nbytes=8),
        ]
    )
    for data in (
        pb.PushPullRequest(header=header, payload=payload).SerializeToString(),
        b"\x12" + bytes([len(payload)]) + payload + b"\x0a" + bytes([header.ByteSize()]) + header.SerializeToString(),
    ):
        _, outs = codec.decode(data, pb.PushPullHeader)
        assert [_same(o, t) for o, t in zip(outs, (a, b, c))] == [True, True, True]


# ------------------------------------------------------------------ malformed input


def _sample_message() -> bytes:
    return codec.encode(
        pb.PushPullHeader(pull=["w"], step=3),
        [("w", _random_tensor(torch.float32, (3, 2), seed=1)), ("b", _random_tensor(torch.int64, (2,), seed=2))],
    )


def _field_boundaries(data: bytes) -> set[int]:
    """Offsets at which a top-level protobuf field ends (cuts there are a valid, shorter message)."""
    ends, pos = {0}, 0
    while pos < len(data):
        pos += 1
        length = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        pos += length
        ends.add(pos)
    return ends


def test_truncated_message_raises():
    data = _sample_message()
    boundaries = _field_boundaries(data)
    assert len(data) in boundaries and len(boundaries) == 3
    cuts = [k for k in range(len(data)) if k not in boundaries]
    assert cuts
    for k in cuts:
        with pytest.raises(WireFormatError):
            codec.decode(data[:k], pb.PushPullHeader)
    with pytest.raises(WireFormatError, match="truncated"):
        codec.decode(data[:-1], pb.PushPullHeader)


def _tamper(mutate) -> bytes:
    message = pb.PushPullRequest.FromString(_sample_message())
    mutate(message.header.tensors[1])
    return message.SerializeToString()


def test_tensor_overrunning_payload_raises():
    def overrun(meta):
        meta.offset += 8  # nbytes still fits the shape, but the bytes lie past the payload's end

    with pytest.raises(WireFormatError, match="'b'.*outside the payload"):
        codec.decode(_tamper(overrun), pb.PushPullHeader)

    def far(meta):
        meta.offset = 2**40

    with pytest.raises(WireFormatError, match="'b'"):
        codec.decode(_tamper(far), pb.PushPullHeader)


def test_nbytes_not_matching_shape_raises():
    def fewer(meta):
        meta.nbytes -= 8

    with pytest.raises(WireFormatError, match=r"'b'.*needs 16 bytes.*says 8"):
        codec.decode(_tamper(fewer), pb.PushPullHeader)

    def shape(meta):
        meta.shape[:] = [3]

    with pytest.raises(WireFormatError, match=r"'b'.*needs 24 bytes"):
        codec.decode(_tamper(shape), pb.PushPullHeader)

    def negative(meta):
        meta.shape[:] = [-2]

    with pytest.raises(WireFormatError, match="negative"):
        codec.decode(_tamper(negative), pb.PushPullHeader)


def test_unknown_dtype_name_raises():
    def unknown(meta):
        meta.dtype = "float128"

    with pytest.raises(WireFormatError, match="'float128'"):
        codec.decode(_tamper(unknown), pb.PushPullHeader)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xfe\xfd\xfc",
        b"hello, psframe",
        b"\x12",  # a payload tag with no length
        b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a varint longer than 64 bits
        b"\x12\x05ab",  # a payload shorter than its length
        b"\x0a\x03\xff\xff\xff",  # a header that is not a PushPullHeader
        b"\x1a\x00",  # field 3 is not part of an envelope
        b"\x08\x01",  # a varint field 1 (wrong wire type for the header)
    ],
)
def test_garbage_raises(garbage):
    with pytest.raises(WireFormatError):
        codec.decode(garbage, pb.PushPullHeader)


def test_random_corruption_never_escapes_as_another_error():
    """Flipping any bit gives either a WireFormatError or a message that decodes consistently."""
    data = _sample_message()
    rng = random.Random(7)
    outcomes = {"error": 0, "decoded": 0}
    for _ in range(600):
        corrupt = bytearray(data)
        corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        try:
            header, tensors = codec.decode(bytes(corrupt), pb.PushPullHeader)
        except WireFormatError:
            outcomes["error"] += 1
            continue
        outcomes["decoded"] += 1
        assert len(tensors) == len(header.tensors)
        for meta, t in zip(header.tensors, tensors):
            assert t.numel() * t.element_size() == meta.nbytes
            assert tuple(t.shape) == tuple(meta.shape)
    assert outcomes["error"] > 0 and outcomes["decoded"] > 0


def test_errors_are_psframe_value_errors():
    with pytest.raises(PsframeError):
        codec.decode(b"\xff", pb.PushPullHeader)
    with pytest.raises(ValueError):
        codec.decode(b"\xff", pb.PushPullHeader)


# ------------------------------------------------------------------------- encoding


@pytest.mark.filterwarnings("ignore:.*quantize.*deprecated")
def test_unsendable_dtype_is_refused():
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(WireFormatError, match="qint8"):
        codec.encode(pb.PushPullHeader(), [("q", q)])


@pytest.mark.filterwarnings("ignore:.*quantize.*deprecated")
def test_refused_tensor_leaves_no_metadata_in_the_header():
    header = pb.PushPullHeader(step=4)
    q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(WireFormatError, match="qint8"):
        codec.encode(header, [("a", torch.ones(3)), ("b", torch.ones(2, 2)), ("q", q)])
    assert len(header.tensors) == 0 and header.step == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_is_refused():
    with pytest.raises(WireFormatError, match="'g'.*cuda"):
        codec.encode(pb.PushPullHeader(), [("g", torch.ones(2, device="cuda"))])


def test_tensor_that_requires_grad_is_sent_as_its_values():
    p = torch.nn.Parameter(_random_tensor(torch.float32, (2, 3), seed=1))
    _, _, (out,) = _roundtrip([("p", p)])
    assert not out.requires_grad
    assert _same(out, p.detach())


def test_conjugate_view_is_sent_as_its_values():
    z = _random_tensor(torch.complex64, (4,), seed=2)
    conj = z.conj()
    assert conj.is_conj() and conj.is_contiguous()
    _, _, (out,) = _roundtrip([("z", conj)])
    assert _same(out, conj.resolve_conj())


def test_negative_view_is_sent_as_its_values():
    imag = _random_tensor(torch.complex64, (4,), seed=3).conj().imag
    assert imag.is_neg()
    _, _, (out,) = _roundtrip([("i", imag)])
    assert _same(out, imag.resolve_neg())


# ------------------------------------------------------------------------ optimizers


@pytest.mark.parametrize(
    "spec, kinds",
    [
        (
            optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, dampening=0),
            {
                "lr": "number",
                "momentum": "number",
                "nesterov": "flag",
                "weight_decay": "number",
                "dampening": "integer",
            },
        ),
        (
            optim.Adam(lr=1, betas=(0.8, 0.99), amsgrad=True, eps=1e-7),
            {"lr": "integer", "betas": "numbers", "amsgrad": "flag", "eps": "number"},
        ),
        (
            optim.RMSprop(alpha=0.9, centered=True, momentum=0, lr=0.01),
            {"alpha": "number", "centered": "flag", "momentum": "integer", "lr": "number"},
        ),
        (optim.Adagrad(), {}),
    ],
)
def test_optimizer_proto_roundtrip(spec, kinds):
    message = messages.optimizer_to_proto(spec)
    assert message.name == spec.name
    assert {k: v.WhichOneof("kind") for k, v in message.kwargs.items()} == kinds
    # Through bytes, as it travels.
    back = messages.optimizer_from_proto(pb.OptimizerDef.FromString(message.SerializeToString()))
    assert back == spec
    assert back.name == spec.name
    assert set(back.kwargs) == set(spec.kwargs)
    for key, value in spec.kwargs.items():
        assert type(back.kwargs[key]) is type(value), key
        assert back.kwargs[key] == value, key
    assert isinstance(back.build([torch.zeros(1, requires_grad=True)]), getattr(torch.optim, spec.name))


def test_optimizer_proto_values():
    message = messages.optimizer_to_proto(optim.Adam(betas=(0.8, 0.99), amsgrad=True, lr=2))
    assert list(message.kwargs["betas"].numbers.values) == [0.8, 0.99]
    assert message.kwargs["amsgrad"].flag is True
    assert message.kwargs["lr"].integer == 2


def test_optimizer_from_proto_validates_again():
    with pytest.raises(OptimizerConfigError, match="'Nope'"):
        messages.optimizer_from_proto(pb.OptimizerDef(name="Nope"))
    bad = pb.OptimizerDef(name="SGD")
    bad.kwargs["lr"].number = -1.0
    with pytest.raises(OptimizerConfigError, match="lr"):
        messages.optimizer_from_proto(bad)
    typo = pb.OptimizerDef(name="SGD")
    typo.kwargs["momentun"].number = 0.9
    with pytest.raises(OptimizerConfigError, match="momentun"):
        messages.optimizer_from_proto(typo)

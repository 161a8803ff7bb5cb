"""The one bridge between torch tensors and bytes on the wire.

Every tensor-carrying message of ``psframe.proto`` is an envelope of two
fields: ``header`` (field 1, a message with a ``tensors`` list of
:class:`TensorMeta`) and ``payload`` (field 2, the raw tensor bytes).
:func:`encode` writes the payload first, padded so that every tensor starts on
an 8-byte boundary of the message, then the header; the result is an ordinary
protobuf message that any parser reads. :func:`decode` finds the two fields by
hand and returns tensors that are views of the received buffer, so the bytes
are copied once on the way out (into the message) and not at all on the way
in. Nothing is pickled.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

import numpy
import torch
from google.protobuf.message import DecodeError, Message

from psframe.errors import WireFormatError
from psframe.wire import psframe_pb2 as pb

ALIGNMENT = 8
HEADER_TAG = b"\x0a"  # field 1, length-delimited
PAYLOAD_TAG = b"\x12"  # field 2, length-delimited

# Every torch dtype with a fixed element size that can cross the wire.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
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
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# Dtypes numpy has too: their tensors' bytes are read through ``Tensor.numpy()``.
NUMPY_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "complex128",
        "complex64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
)
PADS = [bytes(n) for n in range(ALIGNMENT)]  # the zero bytes before an aligned tensor

# What a received shape may declare, checked before anything is allocated for
# it. No model's variable has more dimensions. A tensor's bytes must lie in its
# message, which gRPC caps below 2 GiB, so no tensor on the wire holds more
# elements; the cap is on the product of the non-zero dimensions, so that an
# empty tensor cannot declare an absurd size either ((0, 2**62) is refused).
MAX_DIMS = 64
MAX_ELEMENTS = 2**31

H = TypeVar("H", bound=Message)

# torch.frombuffer and torch.from_numpy warn (once per process each) that a
# bytes object is not writable. Received buffers are only ever read, so say
# it once here, quietly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0" * 8, dtype=torch.uint8)
    torch.from_numpy(numpy.frombuffer(b"\0" * 8, dtype=numpy.uint8))


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype ("float32", "bfloat16", ...).

    Raises:
        WireFormatError: the dtype cannot travel (e.g. a quantized type).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise WireFormatError(f"dtype {dtype} cannot be sent; expected one of {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a wire name.

    Raises:
        WireFormatError: the name is not one of :data:`DTYPES`.
    """
    try:
        return DTYPES[name]
    except KeyError:
        raise WireFormatError(f"unknown dtype {name!r} on the wire; expected one of {sorted(DTYPES)}") from None


def varint(value: int) -> bytes:
    """The protobuf varint encoding of a non-negative integer."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while pos < len(view):
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise WireFormatError("truncated or malformed length prefix in a psframe message")


def raw_bytes(tensor: torch.Tensor):
    """The little-endian bytes of a contiguous CPU tensor, without a copy
    (an object with the buffer protocol: numpy's view of the tensor)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.element_size() > 1 and sys.byteorder != "little":
        # Big-endian host: reverse each element's bytes (a copy, rare).
        size = tensor.element_size()
        return tensor.reshape(-1).view(torch.uint8).view(-1, size).flip(-1).contiguous().numpy()
    if tensor.dtype in NUMPY_DTYPES:
        return tensor.numpy()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)  # a dtype view needs a dimension to stretch
    return tensor.view(torch.uint8).numpy()  # bfloat16, float8...: numpy has no such dtype


def place(sizes: Sequence[int]) -> tuple[list[int], list[int], int, int]:
    """Where tensors of ``sizes`` bytes lie in an envelope's payload.

    Every tensor starts on an :data:`ALIGNMENT`-byte boundary of the
    message: it is padded after the one before it, and the payload's front
    is padded (the *lead*) so that it starts on an aligned offset of the
    message, right after its tag and length.

    Returns:
        ``(pads, offsets, payload_length, lead)``: the zero bytes before each
        tensor, each tensor's offset in the payload (lead included), the
        payload's length (lead included) and the lead.
    """
    pads, offsets = [], []
    end = 0
    for nbytes in sizes:
        pad = -end % ALIGNMENT
        pads.append(pad)
        offsets.append(end + pad)
        end += pad + nbytes
    # The payload's tag and length come first: its lead pad depends on the
    # length prefix, which depends on the lead pad.
    prefix = len(varint(end))
    while True:
        lead = -(1 + prefix) % ALIGNMENT
        if len(varint(end + lead)) == prefix:
            break
        prefix = len(varint(end + lead))
    return pads, [offset + lead for offset in offsets], end + lead, lead


def encode(header: H, tensors: Sequence[tuple[str, torch.Tensor]], kinds: Sequence[int] = ()) -> bytes:
    """Serialize an envelope message: ``header`` plus the named tensors (:func:`encode_chunks`, joined).

    Returns:
        The bytes of the envelope, a valid protobuf message of the envelope type.
    """
    return b"".join(encode_chunks(header, tensors, kinds))


def encode_chunks(header: H, tensors: Sequence[tuple[str, torch.Tensor]], kinds: Sequence[int] = ()) -> list[Any]:
    """Serialize an envelope message: ``header`` plus the named tensors.

    ``header.tensors`` is replaced by the metadata of ``tensors``. Tensors
    must be on the CPU; non-contiguous ones are made contiguous (a copy).
    Messages that carry the same tensors again and again are encoded with
    less work per message by a :class:`psframe.wire.encoding.MessageEncoding`.

    Args:
        header: the envelope's header message (e.g. ``PushPullHeader``).
        tensors: ``(name, tensor)`` pairs, in the order to send them.
        kinds: each tensor's ``TensorMeta.Kind`` (rows of an embedding
            table); empty: every tensor is a ``VALUE``.

    Returns:
        The envelope's bytes in order, as chunks (each an object with the buffer protocol;
        a tensor's chunk is a view of it, not a copy): written one after the other (a file,
        :class:`psframe.wire.same_host.HeldMessage`), they make the message without the
        copy a join into one ``bytes`` makes.
    """
    del header.tensors[:]
    tensors = [(name, sendable(name, tensor)) for name, tensor in tensors]
    pads, offsets, length, lead = place([tensor.nbytes for _, tensor in tensors])
    chunks: list = [PAYLOAD_TAG, varint(length), PADS[lead]]
    metas = header.tensors
    try:
        for (name, tensor), pad, offset, kind in zip(tensors, pads, offsets, kinds or [0] * len(tensors)):
            metas.add(
                name=name,
                dtype=dtype_name(tensor.dtype),
                shape=tensor.shape,
                offset=offset,
                nbytes=tensor.nbytes,
                kind=kind,
            )
            if pad:
                chunks.append(PADS[pad])
            if tensor.nbytes:
                chunks.append(raw_bytes(tensor))
        header_bytes = header.SerializeToString()
    except BaseException:
        del header.tensors[:]  # leave no half-made header behind
        raise
    chunks += (HEADER_TAG, varint(len(header_bytes)), header_bytes)
    return chunks


def sendable(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as :func:`encode` sends it: dense, contiguous, conjugation and negation resolved.

    Raises:
        WireFormatError: it is not on the CPU, or not a dense tensor.
    """
    if not tensor.is_cpu:
        raise WireFormatError(f"tensor {name!r} is on {tensor.device}; encode() needs CPU tensors")
    if tensor.layout != torch.strided:
        raise WireFormatError(f"tensor {name!r} is {tensor.layout}; encode() sends dense tensors")
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


class Envelope(NamedTuple):
    """A received envelope, its header parsed: where its payload lies in ``data``."""

    header: Message
    data: memoryview
    payload_start: int
    payload_length: int


def parse(data: bytes | memoryview, header_type: type[H]) -> Envelope:
    """Find an envelope's two fields and parse its header; the tensors are left in place.

    Raises:
        WireFormatError: the bytes are not a well-formed envelope.
    """
    view = memoryview(data)
    header = None
    payload_start, payload_length = 0, 0
    pos = 0
    while pos < len(view):
        tag = view[pos]
        pos += 1
        if tag not in (HEADER_TAG[0], PAYLOAD_TAG[0]):
            raise WireFormatError(f"unexpected protobuf tag {tag:#x} in a psframe envelope")
        length, pos = _read_varint(view, pos)
        if pos + length > len(view):
            raise WireFormatError(
                f"psframe message truncated: a field of {length} bytes at offset {pos} "
                f"overruns the {len(view)}-byte message"
            )
        if tag == HEADER_TAG[0]:
            try:
                header = header_type.FromString(view[pos : pos + length])
            except DecodeError as e:
                raise WireFormatError(f"malformed {header_type.__name__}: {e}") from e
        else:
            payload_start, payload_length = pos, length
        pos += length
    return Envelope(header if header is not None else header_type(), view, payload_start, payload_length)


def tensors_of(envelope: Envelope) -> list[torch.Tensor]:
    """The tensors an envelope's header lists, each checked against the payload.

    They share memory with the received bytes (read-only views) when these
    are suitably aligned, which is the case for messages made by
    :func:`encode`; otherwise they are copied.

    Raises:
        WireFormatError: a tensor's metadata does not fit the payload.
    """
    header, view, start, length = envelope
    if not header.tensors:
        return []
    # Where the payload lies in memory, to tell an aligned tensor from one that is not.
    address = torch.frombuffer(view, dtype=torch.uint8, count=1, offset=start).data_ptr() if length else 0
    return [_tensor_at(view, start, length, address, meta) for meta in header.tensors]


def decode(data: bytes | memoryview, header_type: type[H]) -> tuple[H, list[torch.Tensor]]:
    """Parse an envelope message into its header and its tensors.

    The tensors share memory with ``data`` (they are read-only views) when
    it is suitably aligned, which is the case for messages made by
    :func:`encode`; otherwise they are copied.

    Args:
        data: bytes of an envelope message (from :func:`encode` or any protobuf
            serializer).
        header_type: the header message class, e.g. ``pb.PushPullHeader``.

    Returns:
        ``(header, tensors)`` with tensors in ``header.tensors`` order.

    Raises:
        WireFormatError: the bytes are not a well-formed envelope.
    """
    envelope = parse(data, header_type)
    return envelope.header, tensors_of(envelope)


def check_shape(what: str, shape: Sequence[int], max_elements: int = MAX_ELEMENTS) -> int:
    """Check a shape received from another process, before anything is allocated for it.

    Args:
        what: what has the shape, for the error (e.g. ``"tensor 'fc.weight'"``).
        shape: the declared dimensions.
        max_elements: the most elements the product of its non-zero dimensions may reach.

    Returns:
        The number of elements of the shape.

    Raises:
        WireFormatError: more than :data:`MAX_DIMS` dimensions, a negative
            one, or non-zero dimensions whose product exceeds ``max_elements``.
    """
    if len(shape) > MAX_DIMS:
        raise WireFormatError(f"{what} has {len(shape)} dimensions; at most {MAX_DIMS} are expected")
    numel = spread = 1
    for dim in shape:
        if dim < 0:
            raise WireFormatError(f"{what} has a negative dimension in shape {tuple(shape)}; expected dimensions >= 0")
        numel *= dim
        spread *= dim or 1
        if spread > max_elements:
            raise WireFormatError(
                f"{what} declares shape {_short(shape)}: its non-zero dimensions multiply "
                f"to more than {max_elements} elements, the most expected"
            )
    return numel


def _short(shape: Sequence[int]) -> str:
    shape = tuple(shape)
    return str(shape) if len(shape) <= 8 else f"({', '.join(map(str, shape[:8]))}, ...) [{len(shape)} dims]"


def _tensor_at(view: memoryview, start: int, length: int, address: int, meta: pb.TensorMeta) -> torch.Tensor:
    dtype = dtype_from_name(meta.dtype)
    shape = tuple(meta.shape)
    numel = check_shape(f"tensor {meta.name!r}", shape)
    itemsize = dtype.itemsize
    if numel * itemsize != meta.nbytes:
        raise WireFormatError(
            f"tensor {meta.name!r}: shape {shape} of {meta.dtype} needs {numel * itemsize} bytes, "
            f"header says {meta.nbytes}"
        )
    if meta.offset + meta.nbytes > length:
        raise WireFormatError(
            f"tensor {meta.name!r} lies outside the payload "
            f"(bytes {meta.offset}..{meta.offset + meta.nbytes} of {length})"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    offset = start + meta.offset
    if (address + meta.offset) % min(itemsize, ALIGNMENT) == 0 and (itemsize == 1 or sys.byteorder == "little"):
        tensor = torch.frombuffer(view, dtype=dtype, count=numel, offset=offset)  # a view: no copy
        return tensor if len(shape) == 1 else tensor.view(shape)
    flat = torch.frombuffer(view, dtype=torch.uint8, count=meta.nbytes, offset=offset)
    flat = flat.clone()  # misaligned buffer (not one of ours), or big-endian: copy rather than fault
    if itemsize > 1 and sys.byteorder != "little":
        flat = flat.view(-1, itemsize).flip(-1).contiguous().view(-1)
    return flat.view(dtype).view(shape)


# Dtypes a worker may ask tensors to travel in (PushPullHeader.wire_dtype):
# half the bytes of float32, at the cost of precision.
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def wire_dtype_from_name(name: str) -> torch.dtype | None:
    """The compression dtype a header names; None for "" (no compression).

    Raises:
        WireFormatError: ``name`` is not one of :data:`WIRE_DTYPES`.
    """
    if not name:
        return None
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise WireFormatError(
            f"wire_dtype {name!r} is not supported; expected one of {sorted(WIRE_DTYPES)} or none"
        ) from None


def to_wire(tensor: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as it travels with ``wire_dtype``: floating-point tensors
    wider than it are converted (rounded to nearest), anything else as is."""
    if wire_dtype is None or not tensor.is_floating_point() or tensor.element_size() <= wire_dtype.itemsize:
        return tensor
    return tensor.to(wire_dtype)

"""A psframe message's bytes: the envelope, and messages laid out once.

Every tensor-carrying message of ``psframe.proto`` is an envelope of two
fields: ``header`` (field 1, a message with a ``tensors`` list of
:class:`TensorMeta`) and ``payload`` (field 2, the raw tensor bytes). The
payload comes first, padded so that every tensor starts on an 8-byte boundary
of the message (:func:`place`), then the header; the result is an ordinary
protobuf message that any parser reads. :func:`parse` finds the two fields by
hand and :func:`tensors_of` gives tensors that are views of the received
buffer, so the bytes are copied once on the way out (into the message) and
not at all on the way in. Nothing is pickled. :func:`psframe.wire.codec.encode`
makes an envelope of any tensors.

A worker sends each ps task the same planned requests every step, and the ps
task answers each with the same variables: only the tensors' values and a
few header fields change from step to step. A :class:`MessageEncoding` holds what
encoding and decoding would otherwise work out for every message: each
tensor's dtype, shape, offset and padding, and the serialized tensor
metadata. A message made with an encoding is the message
:func:`~psframe.wire.codec.encode` makes (the same payload bytes; the
header's fields perhaps in another order), so either side may use one or not::

    encoding = MessageEncoding(pb.PushPullReplyHeader, [(name, tensor.dtype, tensor.shape), ...])
    buffers = encoding.buffers(tensors)          # once, for tensors updated in place
    data = encoding.encode(pb.PushPullReplyHeader(global_step=7), buffers)

    envelope = parse(data, pb.PushPullReplyHeader)
    if encoding.matches(envelope.header):
        tensors = encoding.tensors(envelope)     # views of ``data``
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
from psframe.wire.dtypes import NUMPY_DTYPES, check_shape, dtype_from_name, dtype_name

ALIGNMENT = 8
HEADER_TAG = b"\x0a"  # field 1, length-delimited
PAYLOAD_TAG = b"\x12"  # field 2, length-delimited
PADS = [bytes(n) for n in range(ALIGNMENT)]  # the zero bytes before an aligned tensor

H = TypeVar("H", bound=Message)

# torch.frombuffer and torch.from_numpy warn (once per process each) that a
# bytes object is not writable. Received buffers are only ever read, so say
# it once here, quietly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0" * 8, dtype=torch.uint8)
    torch.from_numpy(numpy.frombuffer(b"\0" * 8, dtype=numpy.uint8))


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


TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


class MessageEncoding:
    """The tensors of one kind of message, placed once.

    Args:
        header_type: the envelope's header message class.
        specs: each tensor's name, dtype and shape, in message order.

    Raises:
        WireFormatError: a dtype that cannot travel.
    """

    def __init__(self, header_type: type[Message], specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        self.specs: tuple[TensorSpec, ...] = tuple((name, dtype, tuple(shape)) for name, dtype, shape in specs)
        numels = [_numel(shape) for _, _, shape in self.specs]
        sizes = [numel * dtype.itemsize for numel, (_, dtype, _) in zip(numels, self.specs)]
        pads, offsets, self.payload_length, self.lead = place(sizes)
        metas = header_type()
        for (name, dtype, shape), offset, nbytes in zip(self.specs, offsets, sizes):
            metas.tensors.add(name=name, dtype=dtype_name(dtype), shape=shape, offset=offset, nbytes=nbytes)
        self._metas = metas.tensors
        # The tensor list, serialized on its own: a header serialized without
        # tensors followed by these bytes parses as the header with them.
        self._metas_bytes = metas.SerializeToString()
        self._prefix = PAYLOAD_TAG + varint(self.payload_length) + PADS[self.lead]
        # Before each tensor's bytes, its padding (as codec.encode pads, empty tensors too).
        self._pads = [PADS[pad] for pad in pads]
        self._readers = [
            (_numpy_dtype(dtype), dtype, numel, offset, shape)
            for (_, dtype, shape), numel, offset in zip(self.specs, numels, offsets)
        ]
        # Where the tensors share one dtype: the stretch of the payload from the first one's
        # start to the last one's end, in elements of it (:meth:`span`); None otherwise.
        self._span = _span_of(self.specs, offsets, sizes)
        # Where each tensor lies in a span: its name, first element and shape (None without spans).
        self.span_places: tuple[tuple[str, int, tuple[int, ...]], ...] | None = None
        if self._span is not None:
            dtype, start, _ = self._span
            self.span_places = tuple(
                (name, (offset - start) // dtype.itemsize, shape)
                for (name, _, shape), offset in zip(self.specs, offsets)
            )

    def matches(self, header: Message) -> bool:
        """Whether ``header`` lists exactly this layout's tensors, at its offsets."""
        return header.tensors == self._metas

    # ---- encoding

    def buffers(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The bytes of ``tensors`` as :meth:`encode` takes them: views, no copy.

        The views follow the tensors' values, so tensors updated in place
        (a ps task's variables) need their buffers made only once.

        Raises:
            WireFormatError: a tensor that does not fit its place in the layout,
                or is not a contiguous CPU tensor.
        """
        if len(tensors) != len(self.specs):
            raise WireFormatError(f"a layout of {len(self.specs)} tensors was given {len(tensors)}")
        buffers = []
        for (name, dtype, shape), tensor in zip(self.specs, tensors):
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise WireFormatError(
                    f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}; its layout says {dtype} {shape}"
                )
            if (
                not tensor.is_cpu
                or tensor.layout != torch.strided
                or not tensor.is_contiguous()
                or tensor.is_conj()
                or tensor.is_neg()
            ):
                raise WireFormatError(f"tensor {name!r} must be a contiguous, dense CPU tensor to be laid out")
            buffers.append(raw_bytes(tensor) if tensor.numel() else None)
        return buffers

    def encode(self, header: Message, buffers: Sequence[Any]) -> bytes:
        """An envelope of ``header`` (whose ``tensors`` must be empty) and the laid-out tensors.

        Args:
            header: the header, without tensors: the layout adds them.
            buffers: from :meth:`buffers`.

        Returns:
            The message :func:`psframe.wire.codec.encode` makes of them: the
            same payload; the header's tensor list serialized after its other fields.
        """
        if header.tensors:
            raise ValueError("the header given to MessageEncoding.encode lists tensors already; the encoding adds them")
        if len(buffers) != len(self._pads):
            raise ValueError(f"a layout of {len(self._pads)} tensors was given {len(buffers)} buffers")
        chunks = [self._prefix]
        for pad, buffer in zip(self._pads, buffers):
            if pad:
                chunks.append(pad)
            if buffer is not None:  # None: an empty tensor
                chunks.append(buffer)
        header_bytes = header.SerializeToString() + self._metas_bytes
        chunks += (HEADER_TAG, varint(len(header_bytes)), header_bytes)
        return b"".join(chunks)

    def encode_header(self, header: Message) -> bytes:
        """An envelope of ``header`` listing the laid-out tensors, without a payload:
        the tensors travel elsewhere (a shared region, :mod:`psframe.wire.same_host`)."""
        if header.tensors:
            raise ValueError(
                "the header given to MessageEncoding.encode_header lists tensors already; the encoding adds them"
            )
        header_bytes = header.SerializeToString() + self._metas_bytes
        return HEADER_TAG + varint(len(header_bytes)) + header_bytes

    def targets(self, buffer: Any, start: int) -> list[numpy.ndarray]:
        """Writable views of where each tensor lies in ``buffer`` when its payload starts at ``start``
        (for :meth:`write`): numpy arrays shaped as :meth:`buffers` gives them, flattened."""
        targets = []
        for numpy_dtype, dtype, numel, offset, _ in self._readers:
            if numpy_dtype is None:  # bfloat16, float8...: their bytes
                numpy_dtype, numel = numpy.dtype(numpy.uint8), numel * dtype.itemsize
            targets.append(numpy.frombuffer(buffer, numpy_dtype, numel, start + offset))
        return targets

    def write(self, targets: Sequence[numpy.ndarray], buffers: Sequence[Any]) -> None:
        """Copy the tensors' bytes (``buffers``, from :meth:`buffers`) to ``targets`` (from :meth:`targets`)."""
        if len(buffers) != len(targets):
            raise ValueError(f"a layout of {len(targets)} tensors was given {len(buffers)} buffers")
        for target, buffer in zip(targets, buffers):
            if buffer is not None:
                numpy.copyto(target, buffer.reshape(-1), casting="no")

    # ---- decoding

    def tensors(self, envelope: Envelope) -> list[torch.Tensor]:
        """The tensors of a received envelope whose header :meth:`matches` this layout.

        Views of the received bytes where they are aligned (always, for
        messages psframe made), copies otherwise.

        Raises:
            WireFormatError: the payload is not as long as the layout says.
        """
        if envelope.payload_length != self.payload_length:
            raise WireFormatError(
                f"a payload of {envelope.payload_length} bytes where its header places {self.payload_length}"
            )
        if sys.byteorder != "little":
            return tensors_of(envelope)
        data, start = envelope.data, envelope.payload_start
        tensors = []
        for numpy_dtype, dtype, numel, offset, shape in self._readers:
            if not numel:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            if numpy_dtype is not None:  # numpy's views are the cheapest to make
                tensor = torch.from_numpy(numpy.frombuffer(data, numpy_dtype, numel, start + offset).reshape(shape))
            else:
                tensor = torch.frombuffer(data, dtype=dtype, count=numel, offset=start + offset).view(shape)
            if tensor.data_ptr() % min(dtype.itemsize, ALIGNMENT):
                tensor = tensor.clone()  # a buffer psframe did not make: copy rather than fault
            tensors.append(tensor)
        return tensors

    def span(self, envelope: Envelope) -> torch.Tensor | None:
        """The tensors of a received envelope whose header :meth:`matches` this layout as one
        1-D tensor of their one dtype: a view of its bytes from the first tensor's start to the
        last one's end, the padding between them included (:attr:`span_places` says where each lies).

        None where they have no one dtype, or do not lie aligned for it (or the host is big-endian).
        """
        if self._span is None or envelope.payload_length != self.payload_length or sys.byteorder != "little":
            return None
        dtype, offset, numel = self._span
        span = torch.frombuffer(envelope.data, dtype=dtype, count=numel, offset=envelope.payload_start + offset)
        return None if span.data_ptr() % dtype.itemsize else span


def _span_of(
    specs: Sequence[TensorSpec], offsets: Sequence[int], sizes: Sequence[int]
) -> tuple[torch.dtype, int, int] | None:
    """``(dtype, offset, elements)`` of the stretch of a payload its tensors lie in, where they
    share one dtype whose size divides the alignment (so that the padding between them is whole
    elements too); None otherwise."""
    kinds = {dtype for _, dtype, _ in specs}
    if len(kinds) != 1:
        return None
    (dtype,) = kinds
    if ALIGNMENT % dtype.itemsize or sum(sizes) == 0:
        return None
    return dtype, offsets[0], (offsets[-1] + sizes[-1] - offsets[0]) // dtype.itemsize


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _numpy_dtype(dtype: torch.dtype) -> numpy.dtype | None:
    """numpy's dtype of the same bytes, or None where numpy has none (bfloat16, float8...)."""
    if dtype not in NUMPY_DTYPES:
        return None
    return torch.empty(0, dtype=dtype).numpy().dtype

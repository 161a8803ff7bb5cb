"""Messages that carry the same tensors again and again, with the per-tensor work done once.

A worker sends each ps task the same planned requests every step, and the ps
task answers each with the same variables: only the tensors' values and a
few header fields change from step to step. A :class:`MessageEncoding` holds what
:func:`~psframe.wire.codec.encode` and :func:`~psframe.wire.codec.decode`
would otherwise work out for every message: each tensor's dtype, shape,
offset and padding, and the serialized tensor metadata. A message made with
an encoding is the message :func:`~psframe.wire.codec.encode` makes (the same
payload bytes; the header's fields perhaps in another order), so either side
may use one or not::

    encoding = MessageEncoding(pb.PushPullReplyHeader, [(name, tensor.dtype, tensor.shape), ...])
    buffers = encoding.buffers(tensors)          # once, for tensors updated in place
    data = encoding.encode(pb.PushPullReplyHeader(global_step=7), buffers)

    envelope = codec.parse(data, pb.PushPullReplyHeader)
    if encoding.matches(envelope.header):
        tensors = encoding.tensors(envelope)     # views of ``data``
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy
import torch
from google.protobuf.message import Message

from psframe.errors import WireFormatError
from psframe.wire import codec

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
        pads, offsets, self.payload_length, self.lead = codec.place(sizes)
        metas = header_type()
        for (name, dtype, shape), offset, nbytes in zip(self.specs, offsets, sizes):
            metas.tensors.add(name=name, dtype=codec.dtype_name(dtype), shape=shape, offset=offset, nbytes=nbytes)
        self._metas = metas.tensors
        # The tensor list, serialized on its own: a header serialized without
        # tensors followed by these bytes parses as the header with them.
        self._metas_bytes = metas.SerializeToString()
        self._prefix = codec.PAYLOAD_TAG + codec.varint(self.payload_length) + codec.PADS[self.lead]
        # Before each tensor's bytes, its padding (as codec.encode pads, empty tensors too).
        self._pads = [codec.PADS[pad] for pad in pads]
        self._readers = [
            (_numpy_dtype(dtype), dtype, numel, offset, shape)
            for (_, dtype, shape), numel, offset in zip(self.specs, numels, offsets)
        ]

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
            buffers.append(codec.raw_bytes(tensor) if tensor.numel() else None)
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
        chunks += (codec.HEADER_TAG, codec.varint(len(header_bytes)), header_bytes)
        return b"".join(chunks)

    def encode_header(self, header: Message) -> bytes:
        """An envelope of ``header`` listing the laid-out tensors, without a payload:
        the tensors travel elsewhere (a shared region, :mod:`psframe.wire.same_host`)."""
        if header.tensors:
            raise ValueError(
                "the header given to MessageEncoding.encode_header lists tensors already; the encoding adds them"
            )
        header_bytes = header.SerializeToString() + self._metas_bytes
        return codec.HEADER_TAG + codec.varint(len(header_bytes)) + header_bytes

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

    def tensors(self, envelope: codec.Envelope) -> list[torch.Tensor]:
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
            return codec.tensors_of(envelope)
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
            if tensor.data_ptr() % min(dtype.itemsize, codec.ALIGNMENT):
                tensor = tensor.clone()  # a buffer psframe did not make: copy rather than fault
            tensors.append(tensor)
        return tensors


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel


def _numpy_dtype(dtype: torch.dtype) -> numpy.dtype | None:
    """numpy's dtype of the same bytes, or None where numpy has none (bfloat16, float8...)."""
    if dtype not in codec.NUMPY_DTYPES:
        return None
    return torch.empty(0, dtype=dtype).numpy().dtype

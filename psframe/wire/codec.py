"""Any tensors to a psframe message's bytes and back: :func:`encode` and :func:`decode`.

An envelope (:mod:`psframe.wire.encoding`) of a header and named tensors:
:func:`encode` writes the tensors' bytes once, into the message;
:func:`decode` gives tensors that are views of the received bytes. Messages
that carry the same tensors again and again (a step's requests and their
replies) are laid out once by a :class:`~psframe.wire.encoding.MessageEncoding`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from psframe.errors import WireFormatError
from psframe.wire.dtypes import dtype_name
from psframe.wire.encoding import HEADER_TAG, PADS, PAYLOAD_TAG, H, parse, place, raw_bytes, tensors_of, varint


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

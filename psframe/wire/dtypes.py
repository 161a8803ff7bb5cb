"""What crosses the wire: the dtypes a tensor may travel in, by name, and the shapes a
received tensor may declare, checked before anything is allocated for it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.errors import WireFormatError

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

# What a received shape may declare, checked before anything is allocated for
# it. No model's variable has more dimensions. A tensor's bytes must lie in its
# message, which gRPC caps below 2 GiB, so no tensor on the wire holds more
# elements; the cap is on the product of the non-zero dimensions, so that an
# empty tensor cannot declare an absurd size either ((0, 2**62) is refused).
MAX_DIMS = 64
MAX_ELEMENTS = 2**31


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

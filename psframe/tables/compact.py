"""Compact rows: a table's rows stored in fewer bytes than float32, and int8 rows for serving.

A dynamic table may keep its rows on the ps tasks in ``bfloat16`` or
``float16`` (:class:`psframe.DynamicEmbedding`'s ``row_storage``): half the
bytes of a float32 row. The table optimizer still works in float32 and keeps
its state in float32 (Adagrad's sums, FTRL's accumulators: no 16-bit form of
them is exact): each step widens the rows it touches, updates them, and
stores them back rounded *stochastically* (:func:`stochastic_round`). Rounding
to nearest would drop every update smaller than half a unit in the last place
of the row, and late in training most are; rounding up with the probability of
the distance to the value below keeps every update's expectation.

The rounding draws its chances from a hash of the table's seed, the id, the
row's count of updates and the element, never from a generator's sequence:
two runs that apply the same updates to a row store the same bits, whatever
other ids share a batch, how the table is cut into parts, or which process
applies them.

For serving, :func:`quantize_int8` gives rows in int8 with one float32 scale
per row (symmetric: ``row ≈ int8_row * scale``), a quarter of float32's bytes
plus four per row; :func:`dequantize_int8` widens them back.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy
import torch

from psframe.optim.gathered_step import FullState, step_gathered

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtypes a dynamic table's rows may be stored in on its ps tasks, by name."""

# splitmix64's constants: a bijective mix of 64 bits, each output bit depending on every input bit.
_GOLDEN = numpy.uint64(0x9E3779B97F4A7C15)
_MIX1 = numpy.uint64(0xBF58476D1CE4E5B9)
_MIX2 = numpy.uint64(0x94D049BB133111EB)
_STEP_MIX = numpy.uint64(0xD6E8FEB86659FD93)
_SEED_MIX = numpy.uint64(0xCA5A826395121157)


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of storage ``name`` (a key of :data:`STORAGE_DTYPES`).

    Raises:
        ValueError: a name not there.
    """
    try:
        return STORAGE_DTYPES[name]
    except KeyError:
        raise ValueError(f"row storage must be one of {sorted(STORAGE_DTYPES)}, got {name!r}") from None


def rounding_chances(ids: torch.Tensor, steps: torch.Tensor, seed: int, per_row: int) -> torch.Tensor:
    """A float32 in [0, 1) for each element of the rows of ``ids`` (shape ``(len(ids), per_row)``),
    a hash of (``seed``, id, the id's step in ``steps`` (int64, one per id), element): the same
    arguments always give the same chances."""
    with numpy.errstate(over="ignore"):  # uint64 arithmetic wraps, as the hash means it to
        key = ids.numpy().astype(numpy.uint64) * _GOLDEN
        key ^= steps.numpy().astype(numpy.uint64) * _STEP_MIX + numpy.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _SEED_MIX
        z = key[:, None] + numpy.arange(1, per_row + 1, dtype=numpy.uint64)[None, :] * _GOLDEN
        z = (z ^ (z >> numpy.uint64(30))) * _MIX1
        z = (z ^ (z >> numpy.uint64(27))) * _MIX2
        z ^= z >> numpy.uint64(31)
    # The top 24 bits: exact in float32, so the chance is a multiple of 2^-24 below 1.
    return torch.from_numpy((z >> numpy.uint64(40)).astype(numpy.float32) * numpy.float32(2.0**-24))


def stochastic_round(
    values: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, steps: torch.Tensor, seed: int
) -> torch.Tensor:
    """``values`` (float32, one row per id of ``ids``) in ``dtype``, each element rounded to one of
    its two neighbours in ``dtype`` with the chance of its distance to the other: unbiased.

    The chances are :func:`rounding_chances` of ``ids``, ``steps`` and ``seed``. An element that
    ``dtype`` holds exactly, or that is not finite, or beyond ``dtype``'s range, is rounded to nearest.
    """
    if dtype == torch.float32:
        return values.clone()
    values = values.float()
    flat = values.reshape(values.shape[0], -1)
    near = flat.to(dtype)
    near_wide = near.float()
    toward = torch.where(near_wide < flat, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)
    gap = (other.float() - near_wide).abs()
    chance_other = (flat - near_wide).abs() / gap  # in [0, 0.5]: near is the nearer neighbour
    chances = rounding_chances(ids, steps, seed, flat.shape[1])
    take_other = (chances < chance_other) & torch.isfinite(gap) & (gap > 0)
    return torch.where(take_other, other, near).reshape(values.shape)


def compact_step(
    optimizer: torch.optim.Optimizer,
    table: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    ids: torch.Tensor,
    steps: torch.Tensor,
    *,
    fresh: Mapping[str, float],
    full: FullState,
    seed: int,
) -> None:
    """The table optimizer's step on the compact rows ``slots`` of ``table`` (distinct), with their
    gradients ``grads``: in float32 on copies of them (:func:`psframe.optim.gathered_step.step_gathered`),
    stored back rounded stochastically with the chances of ``ids``, ``steps`` (each row's updates
    so far) and ``seed``."""
    updated = step_gathered(optimizer, table, slots, grads, fresh, full)
    rounded = stochastic_round(updated, table.dtype, ids, steps, seed)
    with torch.no_grad():
        table.index_copy_(0, slots, rounded)


def quantize_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (2-d or more, any float dtype) as int8 rows and one float32 scale per row, with
    ``row ≈ int8_row * scale`` (symmetric: the largest magnitude maps to 127; a zero row's scale is 0)."""
    wide = rows.float().reshape(rows.shape[0], -1)
    scales = wide.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(wide / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return quantized.reshape(rows.shape), scales


def dequantize_int8(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 rows of int8 ``rows`` and their per-row ``scales`` (:func:`quantize_int8`'s)."""
    shape = [rows.shape[0]] + [1] * (rows.dim() - 1)
    return rows.float() * scales.reshape(shape)


def bytes_per_row(row_shape: tuple[int, ...], dtype: torch.dtype, state_floats: int = 0) -> int:
    """Bytes one row of ``row_shape`` takes in ``dtype``, plus ``state_floats`` float32 of optimizer state."""
    elements = int(numpy.prod(row_shape)) if row_shape else 1
    return elements * dtype.itemsize + 4 * state_floats


__all__ = [
    "STORAGE_DTYPES",
    "bytes_per_row",
    "compact_step",
    "dequantize_int8",
    "quantize_int8",
    "rounding_chances",
    "stochastic_round",
    "storage_dtype",
]

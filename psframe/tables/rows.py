"""Rows of embedding tables as they move between a worker and a ps task: what is pushed and pulled.

The worker side, the wire and the ps side all speak these; they are plain
tuples, so each side builds and reads them without importing the others.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

RowPush = tuple[str, torch.Tensor, torch.Tensor]
"""A table part's name, the ids of rows within it, and those rows (values, or their gradients)."""

RowPull = tuple[str, torch.Tensor]
"""A table part's name, and the ids of the rows wanted from it."""

NOT_CACHED = -1
"""The cached version of an id whose row a worker does not hold."""

UNKNOWN_VERSION = -2
"""A row's version in an answer that cannot say it (a re-layout's new parts count versions anew):
below any a cache holds, so :func:`to_refresh` takes every row sent."""


class CachedPull(NamedTuple):
    """Rows wanted from a table part by a worker with a row cache: the ids, and the version
    of each id's row it holds (:data:`NOT_CACHED` where none)."""

    name: str
    ids: torch.Tensor
    versions: torch.Tensor


class FreshRows(NamedTuple):
    """The answer to a :class:`CachedPull`: each id's version on the ps task, and the rows of
    the ids :func:`to_refresh` picks, in the ids' order."""

    versions: torch.Tensor
    rows: torch.Tensor


def to_refresh(cached: torch.Tensor, current: torch.Tensor, max_lag: int) -> torch.Tensor:
    """Which cached rows must be sent again: none cached, or the row moved more than
    ``max_lag`` versions past the one cached (or was made anew, at a version below it)."""
    return (cached < 0) | (current < cached) | (current - cached > max_lag)


__all__ = ["NOT_CACHED", "CachedPull", "FreshRows", "RowPull", "RowPush", "to_refresh"]

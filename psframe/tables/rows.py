"""Rows of embedding tables as they move between a worker and a ps task: what is pushed and pulled.

The worker side, the wire and the ps side all speak these; they are plain
tuples, so each side builds and reads them without importing the others.
"""

from __future__ import annotations

import torch

RowPush = tuple[str, torch.Tensor, torch.Tensor]
"""A table part's name, the ids of rows within it, and those rows (values, or their gradients)."""

RowPull = tuple[str, torch.Tensor]
"""A table part's name, and the ids of the rows wanted from it."""


__all__ = ["RowPull", "RowPush"]

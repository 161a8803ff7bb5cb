"""Rows of embedding tables in a message's tensor list.

A PushPull (or Init) message lists its tensors in ``header.tensors``; each
has a :class:`TensorMeta.Kind`:

- ``VALUE``: a whole variable, or its gradient (every tensor before tables);
- ``ROW_IDS`` then ``ROWS`` of the same name: the int64 ids of some rows of
  a table part and, one per id, their gradients (a push) or values (Init);
- ``PULL_ROW_IDS``: ids of rows whose values the reply should carry; the
  reply lists them, in order, as ``ROWS``. A dynamic table makes the rows
  of ids it does not hold; ``PEEK_ROW_IDS`` asks without making any.

Every function here is plain bookkeeping over names and tensors; the
codec moves the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.errors import WireFormatError
from psframe.tables.rows import RowPull, RowPush
from psframe.wire import psframe_pb2 as pb

VALUE = pb.TensorMeta.VALUE
ROW_IDS = pb.TensorMeta.ROW_IDS
ROWS = pb.TensorMeta.ROWS
PULL_ROW_IDS = pb.TensorMeta.PULL_ROW_IDS
PEEK_ROW_IDS = pb.TensorMeta.PEEK_ROW_IDS

# Table part, ids, and whether a dynamic table makes the rows it lacks.
RowRead = tuple[str, torch.Tensor, bool]


def split(
    metas: Sequence[pb.TensorMeta], tensors: Sequence[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[RowPush], list[RowRead]]:
    """A request's tensors by kind: whole gradients by name, pushed rows, rows asked for.

    Raises:
        WireFormatError: a variable named twice, ids without their rows (or
            rows without their ids), or an unknown kind.
    """
    grads: dict[str, torch.Tensor] = {}
    pushes: list[RowPush] = []
    pulls: list[RowRead] = []
    i, count = 0, len(tensors)
    while i < count:
        meta, tensor = metas[i], tensors[i]
        kind = meta.kind
        if kind == VALUE:
            if meta.name in grads:
                raise WireFormatError(f"a push names variable {meta.name!r} twice")
            grads[meta.name] = tensor
        elif kind == ROW_IDS:
            if i + 1 >= count or metas[i + 1].kind != ROWS or metas[i + 1].name != meta.name:
                raise WireFormatError(f"row ids of table {meta.name!r} are not followed by its rows")
            pushes.append((meta.name, tensor, tensors[i + 1]))
            i += 1
        elif kind in (PULL_ROW_IDS, PEEK_ROW_IDS):
            pulls.append((meta.name, tensor, kind == PULL_ROW_IDS))
        elif kind == ROWS:
            raise WireFormatError(f"rows of table {meta.name!r} come without their ids")
        else:
            raise WireFormatError(f"tensor {meta.name!r} is of unknown kind {kind}")
        i += 1
    return grads, pushes, pulls


def reply_kinds(values: int, rows: int) -> list[int]:
    """The kinds of a reply's tensors: ``values`` whole variables, then ``rows`` pulled rows."""
    return [int(VALUE)] * values + [int(ROWS)] * rows


def push_tensors(pushes: Sequence[RowPush]) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """The tensors and kinds that carry ``(table part, ids, rows)`` pushes."""
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, ids, rows in pushes:
        tensors += [(name, ids), (name, rows)]
    return tensors, [ROW_IDS, ROWS] * len(pushes)


def pull_tensors(pulls: Sequence[RowPull], create: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """The tensors and kinds that ask for ``(table part, ids)`` rows (``create``:
    a dynamic table makes those it lacks)."""
    ask = PULL_ROW_IDS if create else PEEK_ROW_IDS
    return [(name, ids) for name, ids in pulls], [ask] * len(pulls)


def pulled_rows(metas: Sequence[pb.TensorMeta], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows a reply carries, in the order they were asked for."""
    return [tensor for meta, tensor in zip(metas, tensors) if meta.kind == ROWS]

"""The model a chief is sending a ps task, until every initial value has arrived.

A large model takes several Init requests, each repeating every variable's
definition and carrying some initial values: whole variables, or (for an
embedding table's part, which may be far larger than a message) runs of
rows as ids plus rows (:mod:`psframe.wire.row_tensors`). The values are
copied into the store's memory as they come, so a request's buffer can go.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.errors import RowIdError, WireFormatError
from psframe.ps.store import VariableStore
from psframe.wire import dtypes, messages, row_tensors
from psframe.wire import psframe_pb2 as pb


class PendingModel:
    """Initial values received so far for the variables ``defs``, in ``store``'s memory."""

    def __init__(self, owner: str, defs: Sequence[pb.VariableDef], store: VariableStore) -> None:
        self.owner = owner
        self.defs = list(defs)
        self._by_name = {d.name: d for d in self.defs}
        self._store = store
        self._values: dict[str, torch.Tensor] = {}
        self._rows_seen: dict[str, torch.Tensor] = {}  # a table part's rows received so far (a mask)
        self._rows_missing: dict[str, int] = {}

    def add(self, metas: Sequence[pb.TensorMeta], tensors: Sequence[torch.Tensor]) -> None:
        """Take the initial values of one request.

        Raises:
            WireFormatError: a value for no variable defined, or of another dtype or shape.
            RowIdError: rows of a table part outside it.
        """
        values, rows, pulls = row_tensors.split(metas, tensors)
        if pulls:
            raise WireFormatError(f"an Init request to {self.owner} asks for rows; it only gives values")
        for name, value in values.items():
            messages.check_initial_value(self.owner, self._by_name.get(name), name, value)
            self._values[name] = self._store.copy_in(value)
        for name, ids, value in rows:
            self._add_rows(name, ids, value)

    def _add_rows(self, name: str, ids: torch.Tensor, value: torch.Tensor) -> None:
        definition = self._by_name.get(name)
        if definition is None or not definition.table:
            raise WireFormatError(
                f"initial rows for {name!r} sent to {self.owner}, which was not told of such an embedding table"
            )
        shape = tuple(definition.shape)
        if (
            ids.dtype != torch.int64
            or ids.dim() != 1
            or (ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < shape[0])
        ):
            raise RowIdError(f"initial rows of table {name!r} on {self.owner} must have int64 ids in 0..{shape[0] - 1}")
        if dtypes.dtype_name(value.dtype) != definition.dtype or tuple(value.shape) != (ids.shape[0], *shape[1:]):
            raise WireFormatError(
                f"initial rows of table {name!r} are {dtypes.dtype_name(value.dtype)}"
                f"{tuple(value.shape)}, expected {definition.dtype}{(ids.shape[0], *shape[1:])}"
            )
        part = self._values.get(name)
        if part is None:
            part = self._values[name] = self._store.empty(value.dtype, shape)
            self._rows_seen[name] = torch.zeros(shape[0], dtype=torch.bool)
            self._rows_missing[name] = shape[0]
        seen = self._rows_seen[name]
        self._rows_missing[name] -= int(torch.unique(ids[~seen[ids]]).numel())
        seen[ids] = True
        part.index_copy_(0, ids, value)

    @property
    def complete(self) -> bool:
        """Whether every variable (every row of every table) has its initial value."""
        return len(self._values) == len(self.defs) and not any(self._rows_missing.values())

    def values(self) -> dict[str, torch.Tensor]:
        """The initial values by name, in the order of the definitions (once :attr:`complete`)."""
        return {d.name: self._values[d.name] for d in self.defs}

"""Rows pulled ahead: the next batch's rows travel behind this step's messages.

A step of a model with embedding tables makes two round trips to a ps task:
its lookups pull rows before the forward pass, and its push sends their
gradients after backward. When the worker knows the next batch's ids before
it pushes, ``Trainer.prefetch(table, ids)`` names them, and the step that
follows sends the pull of their rows right behind its own messages, on the
same streams. A ps task answers a stream's messages in order, so the rows
are read once the step's gradients are applied (in synchronous training,
once its round is): the values a pull at the next lookup would get from a
ps task no other worker updates in between; the pull only no longer waits
for a round trip of its own.

The next lookup of exactly those ids in that table takes the prefetched
rows, and the ids' numbering worked out when they were named, without
asking the ps tasks; any other lookup pulls as before, and prefetched rows
no lookup took are dropped at the next step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe.worker.tables import EmbeddingTables, Placed, Prefetched, RowPull, Table, assemble_parts, plan_parts


@dataclass
class Prefetch:
    """One coming lookup: its table and ids (numbered as the lookup numbers them), what to
    ask each ps task, and where their rows go."""

    table: Table
    ids: torch.Tensor
    distinct: torch.Tensor
    position: torch.Tensor
    host_ids: torch.Tensor
    wanted: dict[int, list[RowPull]]
    placed: Placed


class Prefetcher:
    """The prefetches named since the last step."""

    def __init__(self) -> None:
        self._pending: list[Prefetch] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, tables: EmbeddingTables, module: torch.nn.Module, ids: torch.Tensor) -> None:
        """Have the next step pull the rows ``module`` (a fixed table) will look up for ``ids``.

        Raises:
            TypeError: ``module`` is not a fixed table of the model, or ``ids`` not a tensor.
            RowIdError: an id is not a row of the table (nothing is sent).
        """
        table = tables.table_of(module)
        if not isinstance(ids, torch.Tensor):
            raise TypeError(
                f"prefetch of embedding table {table.name!r} takes a tensor of ids, not {type(ids).__name__}"
            )
        ids = ids.detach()
        distinct, position = torch.unique(ids, return_inverse=True)  # numbered as Table.lookup numbers them
        host_ids = distinct.to("cpu", torch.int64)
        table.check_ids(host_ids)
        wanted, placed = plan_parts(table.split(host_ids))
        # A copy of the ids: the caller may reuse its tensor before the lookup.
        self._pending.append(Prefetch(table, ids.clone(), distinct, position, host_ids, wanted, placed))

    def requests(self) -> dict[int, list[RowPull]]:
        """Per ps task, the ``(table part, ids)`` pairs of every pending prefetch, in order."""
        merged: dict[int, list[RowPull]] = {}
        for prefetch in self._pending:
            for ps_task, pulls in prefetch.wanted.items():
                merged.setdefault(ps_task, []).extend(pulls)
        return merged

    def deliver(self, pulled: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Hand each table the rows its prefetches got (the answer to :meth:`requests`);
        a prefetch a ps task did not answer is dropped, its lookup then pulls."""
        offset = dict.fromkeys(pulled, 0)
        for prefetch in self._pending:
            rows: dict[int, Sequence[torch.Tensor]] = {}
            for ps_task, pulls in prefetch.wanted.items():
                if ps_task in pulled:
                    rows[ps_task] = pulled[ps_task][offset[ps_task] : offset[ps_task] + len(pulls)]
                    offset[ps_task] += len(pulls)
            if len(rows) == len(prefetch.wanted):
                count = prefetch.host_ids.numel()
                prefetch.table.prefetched.append(
                    Prefetched(
                        prefetch.ids,
                        prefetch.distinct,
                        prefetch.position,
                        prefetch.host_ids,
                        assemble_parts(rows, prefetch.placed, count, prefetch.table.param),
                    )
                )
        self._pending = []

    def drop(self) -> None:
        """Forget the pending prefetches (a step that failed, a closed trainer)."""
        self._pending = []

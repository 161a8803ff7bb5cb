"""Rows pulled ahead: the next batch's rows travel behind this step's messages.

A step of a model with embedding tables makes two round trips to a ps task:
its lookups pull rows before the forward pass, and its push sends their
gradients after backward. When the worker knows the next batch's ids before
it pushes, ``Trainer.prefetch(table, ids)`` names them, and the step that
follows asks for their rows with its own messages: in asynchronous training
in the message that ends the step on each ps task (applied, then read, then
answered once: :mod:`psframe.worker.client.operations`), in synchronous training in
one more message right behind them on the same stream, which a ps task
answers in order, once its round is applied. Either way the rows are the
values a pull at the next lookup would get from a ps task no other worker
updates in between; the pull only no longer waits for a round trip (nor,
asynchronously, takes messages) of its own.

The next lookup of exactly those ids in that table takes the prefetched
rows, and the ids' numbering worked out when they were named, without
asking the ps tasks; any other lookup pulls as before, and prefetched rows
no lookup took are dropped at the next step. A dynamic table
(:class:`~psframe.worker.model.dynamic.DynamicEmbedding`) is prefetched the same
way: its next training lookup of the same distinct ids takes the rows, and
the ps tasks make the rows of new ids (and count them for admission) when
the prefetch reaches them, not at the lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe.tables.rows import RowPull
from psframe.worker.model.row_pulls import Placed, assemble_parts, plan_parts
from psframe.worker.model.table_views import DynamicTable, Prefetched, Table
from psframe.worker.model.tables import EmbeddingTables


@dataclass
class Prefetch:
    """One coming lookup: what to ask each ps task, where their rows go among the lookup's
    distinct ids, and who takes the rows (the table, for its lookup)."""

    wanted: dict[int, list[RowPull]]
    placed: Placed
    count: int  # the lookup's distinct ids
    like: torch.Tensor  # a tensor of the table's row shape and dtype
    keep: Callable[[torch.Tensor], None]


class Prefetcher:
    """The prefetches named since the last step."""

    def __init__(self) -> None:
        self._pending: list[Prefetch] = []

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, tables: EmbeddingTables, module: torch.nn.Module, ids: torch.Tensor) -> None:
        """Have the next step pull the rows ``module`` (a table of the model) will look up for ``ids``.

        Raises:
            TypeError: ``module`` is not a table of the model, or ``ids`` not a tensor.
            RowIdError: an id is not a row of the (fixed) table (nothing is sent).
        """
        table = tables.table_of(module)
        if not isinstance(ids, torch.Tensor):
            raise TypeError(
                f"prefetch of embedding table {table.name!r} takes a tensor of ids, not {type(ids).__name__}"
            )
        ids = ids.detach()
        distinct, position = torch.unique(ids, return_inverse=True)  # numbered as the lookup numbers them
        host_ids = distinct.to("cpu", torch.int64)
        if isinstance(table, DynamicTable):
            # Made on the ps tasks now rather than at the lookup, as a training lookup would make them.
            parts = [(slot, at, host_ids[at]) for slot, at in table.split(host_ids)]
            wanted, placed = plan_parts(parts)
            keep = functools.partial(_keep_dynamic, table, host_ids)
            self._pending.append(Prefetch(wanted, placed, host_ids.numel(), table.module.row_template, keep))
            return
        table.check_ids(host_ids)
        wanted, placed = plan_parts(table.split(host_ids))
        # A copy of the ids: the caller may reuse its tensor before the lookup.
        keep = functools.partial(_keep_fixed, table, ids.clone(), distinct, position, host_ids)
        self._pending.append(Prefetch(wanted, placed, host_ids.numel(), table.param, keep))

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
                prefetch.keep(assemble_parts(rows, prefetch.placed, prefetch.count, prefetch.like))
        self._pending = []

    def drop(self) -> None:
        """Forget the pending prefetches (a step that failed, a closed trainer)."""
        self._pending = []


def _keep_fixed(
    table: Table, ids: torch.Tensor, distinct: torch.Tensor, position: torch.Tensor, host_ids: torch.Tensor, rows
) -> None:
    table.prefetched.append(Prefetched(ids, distinct, position, host_ids, rows))


def _keep_dynamic(table: DynamicTable, host_ids: torch.Tensor, rows: torch.Tensor) -> None:
    table.prefetched.append((host_ids, rows))

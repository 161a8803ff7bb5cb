"""What one step sends the ps tasks, on whatever layout it goes to.

A step's push is an attempt of :meth:`psframe.worker.session.session.Session.call`: tried
first with the rows the step prefetches (and, with ``overlap_backward``, the requests sent
during backward); sent again, with the numbers it had, once lost ps tasks are back (a ps task
that applied one before the stream died answers it without applying it twice:
:mod:`psframe.ps.protocol.ledger`); and sent on the layout the ps tasks moved to, its requests of
that layout's plan and its rows cut for its parts (nothing of it applied before the move).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe.tables.rows import RowPull
from psframe.worker.client.operations import DenseReply
from psframe.worker.client.streams import Exchange
from psframe.worker.plan.step_plan import Request
from psframe.worker.session.session import Attempt, Retry

log = logging.getLogger(__name__)

# The requests sent (of the plan of the layout they went to), their replies, and the rows prefetched.
Sent = tuple[tuple[Request, ...], list[DenseReply], dict[int, list[torch.Tensor]]]


@dataclass(frozen=True)
class StepPush:
    """One step's push (or, with no gradient, its pull), as an attempt of ``Session.call``."""

    name: str  # the worker's, in the log
    pushed: bool  # the step has gradients; else it only pulls the values
    row_gradients: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None]  # the tables' (take_row_gradients)
    computed_at: int  # the global step the gradients were computed at (sync: their round)
    sync: bool
    async_tables: frozenset[str]  # sync: tables applied at once (variable names)
    prefetch: Mapping[int, Sequence[RowPull]]  # rows pulled behind the step's messages
    exchange: Exchange | None = None  # the step's requests sent during backward (overlap_backward)

    def __call__(self, at: Attempt) -> Sent:
        requests = at.replica.plan.step if self.pushed else at.replica.plan.pull
        if self.exchange is not None and at.retry is None:  # some requests went during backward; the rest go now
            return requests, at.client.finish_step(self.exchange), {}
        rows = None
        if self.pushed and at.replica.has_tables:
            rows = at.replica.tables.cut(self.row_gradients, every_table=self.sync, except_tables=self.async_tables)
        # The gradients each request carries (views, no copies on a CPU replica).
        sent = [(r, at.replica.gradients(r) if self.pushed else ()) for r in requests]
        if at.retry is None:
            replies, prefetched = at.client.push_pull_and_prefetch(
                sent, self.computed_at, self.prefetch, rows=rows, pulls_with_pushes=not self.sync
            )
            return requests, replies, prefetched
        # Sent again with its numbers on the client that first sent it; a client the rejoin made
        # anew (the ps tasks had moved meanwhile) never numbered this step: it goes there fresh.
        again = at.retry is Retry.LOST and at.client.push_numbers.holds_a_step
        replies, _ = at.client.push_pull_and_prefetch(sent, self.computed_at, {}, rows=rows, again=again)
        if again:
            log.info(
                "%s: the ps tasks are back; step %d sent again (%d of its pushes had been applied before)",
                self.name,
                self.computed_at,
                sum(reply.duplicate for reply in replies),
            )
        return requests, replies, {}

"""The mean a synchronous round applies: its members' gradients, summed in task-index order, over their number.

Each member's :class:`Contribution` holds its gradients: whole ones by
variable, and the rows it touched by table. :class:`RoundMean` makes the
mean of the whole ones, :func:`mean_rows` that of one table's rows. Plain
torch, no network.

Where every member's whole gradients came as the spans of messages laid out
alike (:class:`GradientSpan`, read from the message by the service:
:class:`psframe.wire.layouts.Span`; the workers' step plans are the same, so
they are), the sum
takes one operation per message a member sent, into a buffer laid out as
that message and kept from round to round, and the division one per message;
otherwise it takes one operation per variable and member. Both are the same
elementwise additions in the same order, then the same division, so their
bits are the same (the tests compare them); only the number of calls into
torch differs, each of which a ps task pays in CPU and in hand-offs between
the members' threads.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from psframe.tables.rows import RowPush

Places = tuple[tuple[str, int, tuple[int, ...]], ...]  # each gradient's name, first element and shape in a span
SpanKey = tuple[torch.dtype, Places]  # the same for the spans of messages laid out alike


class GradientSpan(NamedTuple):
    """A push's whole gradients as one 1-D tensor they all lie in (the message they came in, the
    padding between them included), and where each lies in it."""

    tensor: torch.Tensor
    places: Places

    @property
    def key(self) -> SpanKey:
        return self.tensor.dtype, self.places


@dataclass
class Contribution:
    """One worker's gradients for a round: whole ones by variable (and the spans of the messages
    that carried them), and rows (ids, gradients) by table."""

    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    spans: dict[SpanKey, GradientSpan] = field(default_factory=dict)  # only spans whose every gradient is in ``grads``
    progress: Any = None  # how far into its range of data the step took the worker (psframe.ps.protocol.data_ranges)

    def __len__(self) -> int:
        return len(self.grads) + len(self.rows)

    def __iter__(self) -> Iterator[str]:
        return itertools.chain(self.grads, self.rows)

    def add(self, grads: Mapping[str, torch.Tensor], span: GradientSpan | None = None) -> None:
        """Add whole gradients (a push; ``span``: the span of the message they all lie in, if
        any). A gradient sent again replaces the one before, and a span that held it is dropped."""
        self.grads.update(grads)
        if self.spans and grads:
            self.spans = {key: kept for key, kept in self.spans.items() if not any(n in grads for n, _, _ in key[1])}
        if span is not None:
            self.spans[span.key] = span


class RoundMean:
    """The mean of a round's whole gradients, in buffers kept from round to round where the
    members' gradients came in spans laid out alike (see the module). Used under the store's lock;
    the mean it gives is valid until its next call."""

    def __init__(self) -> None:
        self._buffers: dict[SpanKey, tuple[torch.Tensor, list[torch.Tensor]]] = {}

    def of(self, names: Sequence[str], members: Sequence[Contribution]) -> dict[str, torch.Tensor]:
        """The mean of the gradients of variables ``names`` over ``members`` (in task-index order),
        by name in the order of ``names``: ``((g0 + g1) + g2 ...) / len(members)``.

        A single member's gradients are its own (the optimizer only reads them).
        """
        if len(members) == 1:
            own = members[0].grads
            return {name: own[name] for name in names}
        in_spans = self._in_spans(names, members)
        if in_spans is not None:
            return in_spans
        mean = {}
        for name in names:
            grads = [member.grads[name] for member in members]
            total = grads[0] + grads[1]  # one pass over both, into a new tensor
            for grad in grads[2:]:
                total.add_(grad)
            mean[name] = total.div_(len(grads))
        return mean

    def _in_spans(self, names: Sequence[str], members: Sequence[Contribution]) -> dict[str, torch.Tensor] | None:
        """The mean taken span by span, or None where the members' spans do not hold exactly
        ``names``, each in messages laid out alike."""
        first = members[0].spans
        if not first or any(member.spans.keys() != first.keys() for member in members[1:]):
            return None
        covered = [name for _, places in first for name, _, _ in places]
        if len(covered) != len(names) or set(covered) != set(names):
            return None
        buffers = {}
        views: dict[str, torch.Tensor] = {}
        for key, span in first.items():
            kept = self._buffers.get(key)
            if kept is None:
                buffer = torch.empty_like(span.tensor)
                kept = (buffer, [buffer[first : first + _numel(shape)].view(shape) for _, first, shape in span.places])
            buffer, parts = buffers[key] = kept
            torch.add(span.tensor, members[1].spans[key].tensor, out=buffer)
            for member in members[2:]:
                buffer.add_(member.spans[key].tensor)
            buffer.div_(len(members))
            views.update(zip((name for name, _, _ in span.places), parts))
        self._buffers = buffers  # those of layouts no longer sent go
        return {name: views[name] for name in names}


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def mean_rows(name: str, grads: list[tuple[torch.Tensor, torch.Tensor]]) -> RowPush:
    """The members' row gradients of one table (in task-index order), repeated rows summed, over their number."""
    ids = torch.cat([ids for ids, _ in grads])
    values = torch.cat([values for _, values in grads])
    # Ids as their rank among the distinct ids (any int64, a dynamic table's too) make a
    # sparse tensor whose coalescing sums repeated rows as it would by the ids themselves.
    distinct, rank = torch.unique(ids, return_inverse=True)
    total = torch.sparse_coo_tensor(
        rank.unsqueeze(0), values, (distinct.numel(), *values.shape[1:]), check_invariants=False
    ).coalesce()
    return name, distinct[total.indices()[0]], total.values().div_(len(grads))

"""One PushPull request as a ps task reads it: who sends, what it pushes, what it pulls.

A worker's operations (:mod:`psframe.worker.client.operations`) share one stream
message; :meth:`PushPullRequest.decode` turns its header and tensors back
into what the ps task acts on, so that the data plane
(:meth:`psframe.ps.service.push_pull_handler.PushPullHandler.answer`) reads
named fields, not a header's raw lists; :func:`outgoing` is what it pulls, as
the reply carries it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psframe.ps.protocol.data_ranges import Progress
from psframe.ps.protocol.round_mean import GradientSpan
from psframe.tables.rows import RowPush
from psframe.wire import dtypes, row_tensors
from psframe.wire import psframe_pb2 as pb
from psframe.wire.layouts import Span


@dataclass(slots=True)
class PushPullRequest:
    """A decoded PushPull request (its tensors are views of the message, or of a shared region)."""

    worker: int  # the sender's task index
    step: int  # the global step its gradients were computed at
    push_id: int  # its number among the worker's pushes to this task; 0: it pushes nothing
    end_of_step: bool  # the worker's last push of its step to this task
    grads: dict[str, torch.Tensor]  # dense gradients by variable, in the wire dtype if there is one
    rows: list[RowPush]  # gradients of rows of table parts
    row_pulls: list[row_tensors.RowRead]  # rows of table parts wanted back
    pull: list[str]  # variables whose values are wanted back, after the update
    wire_dtype: torch.dtype | None  # the dtype gradients came in and values go back in; None: as stored
    progress: Progress | None = None  # how far into its range of data the step took the worker
    rows_async: bool = False  # sync training: rows of tables applied at once, not in the round
    span: GradientSpan | None = None  # where ``grads`` all lie in one stretch of the message

    @property
    def pushes(self) -> bool:
        """Whether it carries gradients (dense or rows)."""
        return bool(self.grads or self.rows)

    @classmethod
    def decode(
        cls, header: pb.PushPullHeader, tensors: Sequence[torch.Tensor], span: Span | None = None
    ) -> PushPullRequest:
        """The request ``header`` describes, carrying ``tensors`` (whose span ``span`` is, if known:
        kept where they are all gradients of full precision).

        Raises:
            WireFormatError: tensors of an unknown kind, or ids without their rows.
            ValueError: an unknown wire dtype.
        """
        grads, rows, row_pulls = row_tensors.split(header.tensors, tensors)
        wire_dtype = dtypes.wire_dtype_from_name(header.wire_dtype)
        return cls(
            worker=header.caller.task_index,
            step=header.step,
            push_id=header.push_id,
            end_of_step=header.end_of_step,
            grads=grads,
            rows=rows,
            row_pulls=row_pulls,
            pull=list(header.pull),
            wire_dtype=wire_dtype,
            progress=_progress_of(header.progress) if header.HasField("progress") else None,
            rows_async=header.rows_async,
            span=GradientSpan(*span) if span is not None and wire_dtype is None and not (rows or row_pulls) else None,
        )


def outgoing(
    names: Sequence[str], values: Sequence[torch.Tensor], wire_dtype: torch.dtype | None
) -> list[tuple[str, torch.Tensor]]:
    """The pulled variables as they travel: compressed when the worker asked."""
    return [(name, dtypes.to_wire(value, wire_dtype)) for name, value in zip(names, values)]


def _progress_of(progress: pb.DataProgress) -> Progress:
    """What a push says it consumed of a data set's range, or of a stream's partition."""
    return Progress(
        progress.name,
        progress.lease,
        progress.offset,
        progress.start,
        progress.seen,
        progress.partition,
        progress.partitions,
    )

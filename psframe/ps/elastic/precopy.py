"""Table parts copied ahead of a re-layout's cut, while training goes on: at the cut only rows changed cross.

A stage of a re-layout pauses training from its cut until every task of the
new layout holds its parts (:mod:`psframe.ps.elastic.relayout`). Copying a table part
whole in that pause costs its bytes; but a step changes few of a table's rows.
So before the cut, the chief has each task of the next layout copy the fixed
table parts it will take (the ``Precopy`` RPC): it reads them from the
tasks that hold them *live* (``CopyPartsLive``), each copy taken
under the holder's store lock with the *mark* of its rows' versions then
(:meth:`psframe.ps.store.row_versions.RowVersions.mark`). At the cut the holder keeps
its rows' versions with its snapshot; asked with the mark, it sends of such a
part only the rows whose version is past it (with their optimizer state), and
the taking task puts them into its copy: the part as the cut holds it, bit for bit.

A copy counts only if the holder took exactly one cut since (its layout
version then is the copy's plus one): otherwise it sends the part whole, as
without a copy. Dense variables and dynamic tables are never copied ahead (a
step changes every value of a dense variable; a dynamic table's rows come and go).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from psframe.checkpoint.deltas import RowChanges, with_rows
from psframe.checkpoint.shard import ShardData, VariableData
from psframe.wire import psframe_pb2 as pb


def copied_ahead(definition: pb.VariableDef) -> bool:
    """Whether a part of this definition is copied ahead of a cut: a fixed table's part."""
    return definition.table and not definition.HasField("dynamic")


@dataclass(frozen=True)
class Copy:
    """The parts one task before handed over live (by part name), at ``mark`` of its layout ``version``."""

    mark: int
    version: int
    parts: Mapping[str, VariableData]


class Copies:
    """The copies a ps task made ahead of the next cut, by the task before each came from.

    Kept for one layout before (its addresses): taken once, when the stage's parts are taken
    (``TakeParts``). Safe to call from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._before: tuple[str, ...] = ()
        self._copies: dict[int, Copy] = {}

    def keep(self, before: Sequence[str], copies: Mapping[int, Copy]) -> None:
        """Keep ``copies`` (by task index in ``before``), in place of any made before."""
        with self._lock:
            self._before, self._copies = tuple(before), dict(copies)

    def take(self, before: Sequence[str]) -> dict[int, Copy]:
        """The copies made from the tasks of ``before``; forgotten here (none: of another layout)."""
        with self._lock:
            copies = self._copies if self._before == tuple(before) else {}
            self._before, self._copies = (), {}
            return copies

    def nbytes(self) -> int:
        """The bytes the copies kept hold (values and optimizer state)."""
        with self._lock:
            return sum(_nbytes(p) for c in self._copies.values() for p in c.parts.values())


def changed_rows(part: VariableData, versions: torch.Tensor, mark: int) -> RowChanges:
    """The rows of fixed table ``part`` (as a cut's snapshot holds it) whose version is past
    ``mark``, with their optimizer state (:meth:`RowChanges.of`)."""
    return RowChanges.of(torch.nonzero(versions > mark).squeeze(1), part.value, part.state)


def split_changed(
    shard: ShardData, versions: Mapping[str, torch.Tensor], precopied: Iterable[str], mark: int
) -> tuple[ShardData, dict[str, RowChanges]]:
    """``shard`` (parts of a cut's snapshot) with the parts ``precopied`` taken out, and of each of
    them the rows changed since ``mark``. A part is taken out only whole (not cut to some rows)
    and where its rows' versions were kept."""
    asked = set(precopied)
    whole, rows = [], {}
    for part in shard.variables:
        kept = versions.get(part.name)
        if part.name in asked and kept is not None and part.shape and kept.shape[0] == part.shape[0]:
            rows[part.name] = changed_rows(part, kept, mark)
        else:
            whole.append(part)
    return dataclasses.replace(shard, variables=tuple(whole)), rows


def completed(shard: ShardData, rows: Mapping[str, RowChanges], copy: Copy | None) -> ShardData:
    """A task's reply at the cut (parts whole, and the changed rows of those copied ahead) made
    whole again with ``copy``.

    Raises:
        ValueError: the reply sent rows of a part that was not copied, or of another shape.
    """
    merged = []
    for name, changes in rows.items():
        part = None if copy is None else copy.parts.get(name)
        if part is None or (changes.index.numel() and int(changes.index.max()) >= part.shape[0]):
            raise ValueError(f"sent the changed rows of table part {name!r}, which this task did not copy as sent")
        merged.append(with_rows(part, changes, in_place=True))  # the copy is this task's own
    return dataclasses.replace(shard, variables=(*shard.variables, *merged))


def _nbytes(part: VariableData) -> int:
    return part.value.nbytes + sum(x.nbytes for x in part.state.values() if isinstance(x, torch.Tensor))

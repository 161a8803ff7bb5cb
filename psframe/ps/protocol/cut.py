"""A cut: one point of the job's updates that every ps task agrees on, for a checkpoint or a re-layout.

The chief takes a cut in two calls to every ps task. First each task
**holds** its updates back and says where it is (the *point* it is at);
the chief works out the cut from every task's answer, the latest point of
any task. Then each task **reaches** that point (applies what other tasks
had begun, and holds the rest), **checks** under the store's lock that it
is still there right before its snapshot, and **releases** the hold. A hold
ends by itself after its seconds, so a chief lost between the two calls
never stalls training for long.

Two kinds, one interface:

- asynchronous training: the push ledger's cut
  (:class:`psframe.ps.protocol.ledger_cut.LedgerCut`), whose point is each
  worker's steps begun (``list[int]``);
- synchronous training: the rounds' cut
  (:class:`psframe.ps.protocol.round_cut.RoundCut`), whose point is a round
  boundary, the global step (``int``).

The cut's handlers (:mod:`psframe.ps.service.cut_handler`) take both through this
interface, for a checkpoint and for a re-layout's stage alike.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

Point = TypeVar("Point")


class Cut(Protocol[Point]):
    """A ps task's part of a cut (see the module)."""

    def hold(self, seconds: float) -> Point:
        """Hold updates back for ``seconds`` at most; the point this task is at."""
        ...

    def reach(self, point: Point) -> None:
        """Apply updates up to ``point`` (the cut the chief worked out), then hold the rest.

        Raises:
            CheckpointCutError: the hold ended first, or the point cannot be reached here.
        """
        ...

    def check(self) -> None:
        """Raise unless this task is still at the point reached (under the store's lock, right
        before the snapshot).

        Raises:
            CheckpointCutError: the hold ended, or updates went past the point.
        """
        ...

    def release(self) -> None:
        """End the hold: updates apply again (after the snapshot, or after a failed one)."""
        ...

"""One cut across the ps tasks: every task held (``HoldCut``), then each takes its part there.

The caller (the chief, or a ps task leaving) holds every ps task, works the cut
out from their holds (:func:`cut_points`: each worker's steps begun anywhere, or
the latest round), and sends each task the request that reaches the cut and takes
its part: a checkpoint's shard (``SaveShard``) or a re-layout's snapshot
(``MoveCut``). A cut lost to a worker that died in the middle of a step
(:class:`~psframe.errors.CheckpointCutError`) is taken again without the steps it
waited for (better a part than none): that step may be applied on some parts and
not on others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from psframe import errors
from psframe.wire import psframe_pb2 as pb
from psframe.wire import transport

log = logging.getLogger(__name__)


def at_one_cut(
    connections: Sequence[transport.Connection],
    caller: pb.Caller,
    method: str,
    requests: Sequence[Any],
    timeout: Callable[[], float],
    *,
    hold_seconds: float,
    for_move: bool = False,
    lost: str,
) -> list[Any]:
    """Hold every ps task (``connections``, by index) at one cut, then call ``method`` on each
    with its request of ``requests`` (each has a ``cut`` field: its point is set here). ``lost``
    says, in the warning, what a cut lost to a worker lost mid-step means. ``timeout()``: the
    seconds each round of calls may take.

    Returns:
        Each task's reply, by task index.
    """
    hold = pb.HoldCutRequest(caller=caller, hold_seconds=hold_seconds, for_move=for_move)
    holds = transport.call_all([(ps, "HoldCut", hold) for ps in connections], timeout())
    for request, point in zip(requests, cut_points(holds)):
        request.cut.CopyFrom(point)
    try:
        return transport.call_all(list(zip(connections, [method] * len(requests), requests)), timeout())
    except errors.CheckpointCutError as e:  # a worker lost mid-step, say
        log.warning("%s: %s", lost, e)
        for request in requests:
            request.ClearField("cut")
        return transport.call_all(list(zip(connections, [method] * len(requests), requests)), timeout())


def cut_points(holds: Sequence[pb.HoldCutReply]) -> list[pb.CutPoint]:
    """Where each task reaches the cut, by task: each worker's steps begun on any task holding
    pushes (asynchronous training), or the latest round of any task holding rounds (synchronous:
    the tasks are at most one round apart)."""
    begun = [list(r.steps_begun) for r in holds if r.holds]
    targets = [max(steps) for steps in zip(*begun)] if begun else []
    round_target = max((r.round for r in holds if r.holds_rounds), default=0)
    return [
        pb.CutPoint(
            targets=targets if r.holds else [],
            rounds=r.holds_rounds,
            round_target=round_target if r.holds_rounds else 0,
        )
        for r in holds
    ]

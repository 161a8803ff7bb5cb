"""A worker's side of a live re-layout: ps tasks added or drained while training (:mod:`psframe.ps.elastic.relayout`).

- :func:`lead` is the chief's part, between two of its steps. It waits for the
  tasks added and has them get ready, takes the cut (every ps task snapshots its
  parts and moves), has every task of the new layout take its parts, and checks
  the model there; :func:`let_go`, once the chief trains on, lets the snapshots
  go and stops the drained tasks.
- :func:`follow` is a refused worker's part: it asks ps 0 where the ps tasks
  went, and waits until the new layout holds the model (asking again after
  5 ms, then twice as long each time, up to 100 ms).
- :func:`resume` is a chief's part when it starts again and finds a re-layout
  its run before had begun (cut taken, parts not placed): it finishes it.

Either gives a :class:`Layout`, the client and the placement of the new cluster,
which the worker then trains on (:meth:`psframe.worker.session.session.Session.switch_to`).

A re-layout moves the parts in stages, a few at a time (:mod:`psframe.cluster.moves`):
the chief leads one stage per step, each with its cut, and a refused worker follows
to the stage ps 0 is at. :class:`Layouts` makes the layout of any stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from psframe.cluster import ClusterSpec
from psframe.cluster.moves import MoveStage, moved_parts, parts_copied_ahead, sources, stages
from psframe.cluster.placement import ShardPlacement
from psframe.errors import (
    ClusterMismatchError,
    ConnectTimeoutError,
    LayoutChangedError,
    PsframeError,
    TrainingFinishedError,
)
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.status import TaskState
from psframe.worker.client import control_calls, relayout_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.client.relayout_calls import CutTaken, LayoutStatus
from psframe.worker.model.replica import Replica

log = logging.getLogger(__name__)

# How long a refused worker waits between two questions to the ps tasks of the layout it moves to
# (whether they hold the model): first briefly (training waits on it, for a stage's transfer,
# milliseconds when small), then twice as long each time, up to the last. ps 0 it asks where
# the tasks went once (STATUS_WAIT_SECONDS: ps 0 answers when they moved).
FIRST_ASK_SECONDS = 0.005
LAST_ASK_SECONDS = 0.1
# How long a following worker's status request waits for ps 0 to move (ps 0 caps it too).
STATUS_WAIT_SECONDS = 2.0
# How long a follower waits for a layout before it asks ps 0 again whether the ps tasks moved on.
RECHECK_SECONDS = 0.5


@dataclass(frozen=True)
class Settings:
    """What the ps tasks of a new layout are told of the model (as the chief's start-up tells
    them), and how long each wait may take."""

    optimizer: OptimizerSpec
    table_optimizer: OptimizerSpec | None
    sync: SyncReplicas | None
    timeout: float


@dataclass(frozen=True)
class Moves:
    """What a stage moves, as the chief computes it from the placements before and after it."""

    sources: list[list[int]]  # by task after: the tasks before it reads its parts from
    copied_ahead: list[str]  # the fixed table parts copied ahead of the cut
    parts: int  # the parts moved

    @classmethod
    def between(cls, before: ShardPlacement, after: ShardPlacement) -> Moves:
        """The moves of a stage from placement ``before`` to ``after`` (:mod:`psframe.cluster.moves`)."""
        return cls(sources(before, after), parts_copied_ahead(before, after), moved_parts(before, after))


@dataclass
class Layout:
    """The model on the ps tasks of ``cluster``: the client that reaches them and the placement."""

    cluster: ClusterSpec
    client: PsClient
    replica: Replica
    stage: MoveStage | None = None  # the stage of a re-layout this layout is after; None: a layout of its own

    @property
    def final(self) -> bool:
        """Whether this is the layout a re-layout ends on (not one of its stages before)."""
        return self.stage is None or self.stage.done


class Layouts:
    """The layouts a worker trains on: the model's placement on a cluster, or the placement
    after one stage of a staged re-layout.

    Args:
        place: the model's placement on so many ps tasks.
        make: a layout of that placement on that cluster (a client of it, the model bound to it).
        max_stage_bytes: the most bytes a stage moves (one move at least).
    """

    def __init__(
        self,
        place: Callable[[int], ShardPlacement],
        make: Callable[[ClusterSpec, ShardPlacement], Layout],
        max_stage_bytes: int,
    ) -> None:
        self._place, self._make, self._max_stage_bytes = place, make, max_stage_bytes
        self._plan: tuple[tuple[str, str], list[ShardPlacement]] | None = None

    def stages(self, origin: ClusterSpec, target: ClusterSpec) -> list[ShardPlacement]:
        """The placement after each stage of the re-layout from ``origin`` to ``target``."""
        key = (origin.to_string(), target.to_string())
        if self._plan is None or self._plan[0] != key:
            plan = stages(self._place(origin.num_ps), self._place(target.num_ps), self._max_stage_bytes)
            self._plan = (key, plan)
        return self._plan[1]

    def plan(self, origin: ClusterSpec, target: ClusterSpec) -> list[MoveStage]:
        """The stages of the re-layout from ``origin`` to ``target``, in order."""
        count = len(self.stages(origin, target))
        return [MoveStage(origin.to_string(), target.to_string(), k, count) for k in range(1, count + 1)]

    def where(self, status: LayoutStatus) -> tuple[ClusterSpec, ShardPlacement]:
        """The cluster and the placement ps 0 says the ps tasks are at (``status.moved``): after
        a stage, on the larger of the two clusters (a task drained holds its parts not yet moved);
        at the end, the target's own placement."""
        stage = status.stage
        if stage is not None and not stage.done:
            origin, target = ClusterSpec.from_string(stage.origin), ClusterSpec.from_string(stage.target)
            cluster = target if target.num_ps >= origin.num_ps else origin
            return cluster, self.stages(origin, target)[stage.stage - 1]
        assert status.cluster is not None
        return status.cluster, self._place(status.cluster.num_ps)

    def of(self, status: LayoutStatus) -> Layout:
        """The layout (a client, the model bound to the placement) ps 0 says the ps tasks are at."""
        layout = self._make(*self.where(status))
        layout.stage = status.stage
        return layout

    def of_stage(self, stage: MoveStage) -> Layout:
        """The layout after ``stage``."""
        return self.of(LayoutStatus(ClusterSpec.from_string(stage.target), True, stage))


def get_ready(before: ClusterSpec, layout: Layout, settings: Settings, moves: Moves) -> None:
    """What a stage of a re-layout does before its cut, while training goes on: the tasks added
    are up and make ready what taking parts needs, and every task of ``layout`` copies the table
    parts it will take ahead (``moves.copied_ahead``, :mod:`psframe.ps.elastic.precopy`): the pause is
    for the rest alone.

    Raises:
        ConnectTimeoutError: a task added did not answer within ``settings.timeout``.
    """
    client, new = layout.client, layout.cluster
    added = range(before.num_ps, new.num_ps)
    control_calls.wait_for_ps(client, settings.timeout, tasks=added)
    relayout_calls.copy_ahead(
        client,
        layout.replica.slots,
        settings.optimizer,
        settings.table_optimizer,
        before.job_tasks("ps"),
        moves.sources,
        moves.copied_ahead,
    )


class Readying:
    """A stage's :func:`get_ready` (its copy ahead) run in a thread of its own while the chief
    trains on: the chief cuts the stage at a step once it is done (:attr:`done`).

    Args:
        stage: the stage it readies.
        layout: the layout after it (its client is used by the thread until done).
        before, settings, moves: as :func:`get_ready`.
    """

    def __init__(self, stage: MoveStage, layout: Layout, before: ClusterSpec, settings: Settings, moves: Moves) -> None:
        self.stage, self.layout, self.moves = stage, layout, moves
        self._failure: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(before, settings), name="psframe-relayout-ready", daemon=True
        )
        self._thread.start()

    def _run(self, before: ClusterSpec, settings: Settings) -> None:
        try:
            get_ready(before, self.layout, settings, self.moves)
        except BaseException as e:  # noqa: BLE001 - handed to the chief's thread by result()
            self._failure = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether it ended (ready, or failed: :meth:`result` says)."""
        return self._done.is_set()

    def result(self) -> Layout:
        """The layout, ready for its cut.

        Raises:
            ConnectTimeoutError, PsframeError: as :func:`get_ready` (the layout's client is closed).
        """
        if self._failure is not None:
            self.layout.client.close()
            raise self._failure
        return self.layout

    def cancel(self, seconds: float = 5.0) -> None:
        """Give it up: wait for the thread (``seconds`` at most: its calls have deadlines of their
        own) and close the layout's client."""
        self._done.wait(seconds)
        self.layout.client.close()


def lead(
    old: PsClient,
    before: ClusterSpec,
    layout: Layout,
    settings: Settings,
    moves: Moves,
    stage: MoveStage | None = None,
    ready: bool = False,
) -> float:
    """The chief's re-layout (or ``stage`` of one) from ``before`` (reached by ``old``) to
    ``layout``, which ``moves`` says (:meth:`Moves.between` the placements); closes the new
    layout's client if it fails. ``ready``: :func:`get_ready` was done for it (while training
    went on); otherwise it is done first.

    Returns:
        When (``time.monotonic()``) the cut began: training is paused from then on, until the
        chief trains on ``layout``.

    Raises:
        ConnectTimeoutError: a task added did not answer, or the new layout did not hold the
            model, within ``settings.timeout``.
        PsframeError: a ps task refused (the re-layout cannot be taken live, say).
    """
    client, new = layout.client, layout.cluster
    try:
        if not ready:
            get_ready(before, layout, settings, moves)
        start = time.monotonic()
        at_cut = relayout_calls.move(old, new, stage)
        cut = time.monotonic()
        held = take_parts(before, layout, settings, moves.sources, at_cut)
        log.debug("re-layout stage: the cut took %.4f s, taking the parts %.4f s", cut - start, held - cut)
    except BaseException:
        client.close()
        raise
    return start


def let_go(old: PsClient, before: ClusterSpec, layout: Layout) -> None:
    """What a stage leaves to do once ``layout`` holds the model, out of the pause (the chief
    trains on meanwhile): after the last stage, the tasks kept let their snapshots go, and the
    drained tasks (of ``before``, reached by ``old``) stop. A failure is logged only, training
    goes on: a snapshot left goes at the next cut; a drained task left holds nothing any more,
    and answers until its process is stopped."""
    try:
        if layout.final:
            relayout_calls.reshard_done(layout.client)
        for k in range(layout.cluster.num_ps, before.num_ps):  # drained: nothing is left on them
            control_calls.shutdown(old, k)
    except PsframeError as e:
        log.warning(
            "%s: the ps tasks of the layout before could not be let go (a drained task still up holds nothing: "
            "stop its process): %s",
            old.name,
            e,
        )


def take_parts(
    before: ClusterSpec,
    layout: Layout,
    settings: Settings,
    sources: Sequence[Sequence[int]] | None = None,
    at_cut: CutTaken | None = None,
) -> float:
    """After the cut: every ps task of ``layout`` takes its parts from the snapshots of the tasks of
    ``before`` (``sources``: by task, the tasks it reads from, :class:`Moves`; None: all), and the
    model is held there. ``at_cut``: ps 0's answer to the cut (None: ps 0 is asked). The
    snapshots stay until :func:`let_go` (after the last stage; those of a stage before go at the
    next stage's cut).

    Returns:
        When (``time.monotonic()``) the layout held the model: training goes on from then.
    """
    client = layout.client
    start = time.monotonic()
    if at_cut is None:  # ps 0 counted this re-layout at its cut, and knows who finished
        info = control_calls.wait_for_ps(client, settings.timeout, tasks=[0])[0]
        version, finished = info.layout_version, list(info.finished_workers)
    else:
        version, finished = at_cut.layout_version, list(at_cut.finished_workers)
    ledger = None if at_cut is None else at_cut.ledger
    if sources is not None and ledger is None:  # each task reads the push ledger from ps 0's snapshot
        sources = [sorted({0, *tasks}) for tasks in sources]
    asked = time.monotonic()
    held_model = relayout_calls.take_parts(
        client,
        layout.replica.slots,
        settings.optimizer,
        settings.table_optimizer,
        settings.sync,
        before.job_tasks("ps"),
        version,
        finished,
        sources,
        ledger,
    )
    parts_taken = time.monotonic()
    if not held_model:  # a task not ready yet (it should not be): wait for it, and check what it holds
        control_calls.check_model(
            client, control_calls.wait_for_ps(client, settings.timeout, ready=True), layout.replica.slots, settings.sync
        )
    held = time.monotonic()
    log.debug(
        "re-layout: asked ps 0 %.4f s, the tasks took their parts %.4f s, checked %.4f s",
        asked - start,
        parts_taken - asked,
        held - parts_taken,
    )
    return held


def resume(layout: Layout, settings: Settings, status: LayoutStatus) -> bool:
    """A chief started again finishes a re-layout its run before had begun (its cut taken, the
    parts not yet placed): the new layout takes its parts from the snapshots, the drained tasks
    stop. The model is never made anew over a re-layout under way. ``status``: ps 0's.

    Returns:
        Whether there was one to finish.
    """
    before = status.before
    if before is None or control_calls.get_info(layout.client, 0).state is TaskState.READY:
        return False
    log.warning(
        "chief: a re-layout from ps tasks %s to %s was under way without a chief: finishing it",
        before.job_tasks("ps"),
        layout.cluster.job_tasks("ps"),
    )
    # Every task of the new layout is up (the lead waits before its cut).
    control_calls.wait_for_ps(layout.client, settings.timeout)
    take_parts(before, layout, settings)
    with PsClient(before, 0, job_name="tool", rpc_timeout=layout.client.rpc_timeout) as old:
        let_go(old, before, layout)
    return True


def follow(
    old: PsClient,
    make: Callable[[LayoutStatus], Layout],
    sync: SyncReplicas | None,
    timeout: float,
) -> Layout:
    """The layout ps 0 moved to, once it holds the model (``make`` builds the layout ps 0 says
    it is at). A worker that missed a re-layout (or a stage) may find another under way: it asks again.

    Raises:
        ConnectTimeoutError: the ps tasks did not hold the model on a new layout within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    status = relayout_calls.layout_status(old)
    while True:
        moved = status.cluster is not None and status.moved
        if moved:  # the same cluster too: a layout later than this worker's
            layout = make(status)
            try:
                return _held(layout, old, status, sync, deadline)
            except (ClusterMismatchError, LayoutChangedError):
                layout.client.close()  # moved again meanwhile: ask again
            except BaseException:
                layout.client.close()
                raise
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectTimeoutError(
                f"{old.name}: the ps tasks moved, and did not hold the model on a new layout within {timeout:.0f}s"
            )
        if moved:  # taken, but not held as told: ask again in a moment
            time.sleep(min(FIRST_ASK_SECONDS, remaining))
            status = relayout_calls.layout_status(old)
        else:  # not moved yet: ps 0 answers once it has (or after a while), no asking again and again
            status = relayout_calls.layout_status(
                old, wait=min(STATUS_WAIT_SECONDS, remaining), after_version=status.version
            )


def _held(layout: Layout, old: PsClient, status: LayoutStatus, sync: SyncReplicas | None, deadline: float) -> Layout:
    """``layout`` once its ps tasks hold the model, waited for a slice at a time: between two,
    ps 0 is asked whether the layout moved on (a task of a stage's layout is drained at a later
    stage: it stops, and is waited for no longer).

    Raises:
        LayoutChangedError: ps 0 moved on meanwhile (ask it again).
        ConnectTimeoutError: not held by ``deadline``.
        TrainingFinishedError: a task of the layout ps 0 is still at saw every worker finish.
    """
    while True:
        try:
            slice_ = max(0.1, min(RECHECK_SECONDS, deadline - time.monotonic()))
            infos = control_calls.wait_for_ps(
                layout.client, slice_, ready=True, poll=FIRST_ASK_SECONDS, max_poll=LAST_ASK_SECONDS
            )
            control_calls.check_model(layout.client, infos, layout.replica.slots, sync)
            return layout
        except (ConnectTimeoutError, TrainingFinishedError) as e:
            now = relayout_calls.layout_status(old)
            if (now.cluster, now.stage, now.moved) != (status.cluster, status.stage, status.moved):
                raise LayoutChangedError(f"{old.name}: the ps tasks moved on while this worker followed") from e
            if isinstance(e, TrainingFinishedError) or time.monotonic() >= deadline:
                raise

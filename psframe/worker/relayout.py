"""A worker's side of a live re-layout: ps tasks added or drained while training (:mod:`psframe.ps.relayout`).

- :func:`lead` is the chief's part, between two of its steps. It waits for the
  tasks added and has them get ready, takes the cut (every ps task snapshots its
  parts and moves), has every task of the new layout take its parts, checks the
  model there, and stops the drained tasks.
- :func:`follow` is a refused worker's part: it asks ps 0 where the ps tasks
  went, and waits until the new layout holds the model.
- :func:`resume` is a chief's part when it starts again and finds a re-layout
  its run before had begun (cut taken, parts not placed): it finishes it.

Either gives a :class:`Layout`, the client and the placement of the new cluster,
which the trainer then trains on (``Trainer._switch_to``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError, ConnectTimeoutError, LayoutChangedError
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.status import TaskState
from psframe.worker.ps_client import PsClient
from psframe.worker.replica import Replica

log = logging.getLogger(__name__)

# How long a refused worker waits between two questions to ps 0 about the layout it moves to.
ASK_EVERY_SECONDS = 0.05


@dataclass(frozen=True)
class Settings:
    """What the ps tasks of a new layout are told of the model (as the chief's start-up tells
    them), and how long each wait may take."""

    optimizer: OptimizerSpec
    table_optimizer: OptimizerSpec | None
    sync: SyncReplicas | None
    timeout: float


@dataclass
class Layout:
    """The model on the ps tasks of ``cluster``: the client that reaches them and the placement."""

    cluster: ClusterSpec
    client: PsClient
    replica: Replica


def lead(
    old: PsClient,
    before: ClusterSpec,
    layout: Layout,
    settings: Settings,
) -> float:
    """The chief's re-layout from ``before`` (reached by ``old``) to ``layout``; closes the new
    layout's client if it fails.

    Returns:
        The seconds training paused: from the cut until the new layout held the model.

    Raises:
        ConnectTimeoutError: a task added did not answer, or the new layout did not hold the
            model, within ``settings.timeout``.
        PsframeError: a ps task refused (the re-layout cannot be taken live, say).
    """
    client, new = layout.client, layout.cluster
    try:
        # The tasks added are up and ready before the cut: training pauses for the transfer alone.
        added = range(before.num_ps, new.num_ps)
        client.wait_for_ps(settings.timeout, tasks=added)
        if added:
            client.prepare(added)
        start = time.monotonic()
        old.move(new)
        take_parts(before, layout, settings)
    except BaseException:
        client.close()
        raise
    paused = time.monotonic() - start
    for k in range(new.num_ps, before.num_ps):  # drained: nothing is left on them
        old.shutdown(k)
    return paused


def take_parts(
    before: ClusterSpec,
    layout: Layout,
    settings: Settings,
) -> None:
    """After the cut: every ps task of ``layout`` takes its parts from the snapshots of the tasks of
    ``before``, the model is checked there, and the snapshots may go."""
    client = layout.client
    client.wait_for_ps(settings.timeout)
    at_cut = client.get_info(0)  # ps 0 counted this re-layout at its cut, and knows who finished
    client.adopt(
        layout.replica.slots,
        settings.optimizer,
        settings.table_optimizer,
        settings.sync,
        before.job_tasks("ps"),
        at_cut.layout_version,
        at_cut.finished_workers,
    )
    client.check_model(client.wait_for_ps(settings.timeout, ready=True), layout.replica.slots, settings.sync)
    client.reshard_done()


def resume(
    layout: Layout,
    settings: Settings,
) -> bool:
    """A chief started again finishes a re-layout its run before had begun (its cut taken, the
    parts not yet placed): the new layout takes its parts from the snapshots, the drained tasks
    stop. The model is never made anew over a re-layout under way.

    Returns:
        Whether there was one to finish.
    """
    before = layout.client.moved_from()
    if before is None or layout.client.get_info(0).state is TaskState.READY:
        return False
    log.warning(
        "chief: a re-layout from ps tasks %s to %s was under way without a chief: finishing it",
        before.job_tasks("ps"),
        layout.cluster.job_tasks("ps"),
    )
    take_parts(before, layout, settings)
    with PsClient(before, 0, job_name="tool", rpc_timeout=layout.client.rpc_timeout) as old:
        for k in range(layout.cluster.num_ps, before.num_ps):  # drained
            old.shutdown(k)
    return True


def follow(
    old: PsClient,
    make: Callable[[ClusterSpec], Layout],
    sync: SyncReplicas | None,
    timeout: float,
) -> Layout:
    """The layout ps 0 moved to, once it holds the model (``make`` builds one for a cluster). A
    worker that missed a re-layout may find another under way: it asks again.

    Raises:
        ConnectTimeoutError: the ps tasks did not hold the model on a new layout within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        new, moved = old.reshard_asked()
        if new is not None and moved:  # the same cluster too: a layout later than this worker's
            layout = make(new)
            try:
                infos = layout.client.wait_for_ps(max(0.1, deadline - time.monotonic()), ready=True)
                layout.client.check_model(infos, layout.replica.slots, sync)
                return layout
            except (ClusterMismatchError, LayoutChangedError):
                layout.client.close()  # moved again meanwhile: ask again
            except BaseException:
                layout.client.close()
                raise
        if time.monotonic() >= deadline:
            raise ConnectTimeoutError(
                f"{old.name}: the ps tasks moved, and did not hold the model on a new layout within {timeout:.0f}s"
            )
        time.sleep(ASK_EVERY_SECONDS)

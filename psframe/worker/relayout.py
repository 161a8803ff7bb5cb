"""A worker's side of a live re-layout: ps tasks added or drained while training (:mod:`psframe.ps.relayout`).

- :func:`lead` is the chief's part, between two of its steps. It waits for the
  tasks added and has them get ready, takes the cut (every ps task snapshots its
  parts and moves), has every task of the new layout take its parts, checks the
  model there, and stops the drained tasks.
- :func:`follow` is a refused worker's part: it asks ps 0 where the ps tasks
  went, and waits until the new layout holds the model.

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
from psframe.worker.ps_client import PsClient
from psframe.worker.replica import Replica

log = logging.getLogger(__name__)

# How long a refused worker waits between two questions to ps 0 about the layout it moves to.
ASK_EVERY_SECONDS = 0.05


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
    *,
    optimizer: OptimizerSpec,
    table_optimizer: OptimizerSpec | None,
    sync: SyncReplicas | None,
    timeout: float,
) -> float:
    """The chief's re-layout from ``before`` (reached by ``old``) to ``layout``; closes the new
    layout's client if it fails.

    Returns:
        The seconds training paused: from the cut until the new layout held the model.

    Raises:
        ConnectTimeoutError: a task added did not answer, or the new layout did not hold the
            model, within ``timeout``.
        PsframeError: a ps task refused (the re-layout cannot be taken live, say).
    """
    client, new = layout.client, layout.cluster
    try:
        # The tasks added are up and ready before the cut: training pauses for the transfer alone.
        added = range(before.num_ps, new.num_ps)
        client.wait_for_ps(timeout, tasks=added)
        if added:
            client.prepare(added)
        start = time.monotonic()
        old.move(new)
        client.wait_for_ps(timeout)
        at_cut = old.get_info(0)  # ps 0 counted this re-layout at its cut, and knows who finished
        client.adopt(
            layout.replica.slots,
            optimizer,
            table_optimizer,
            sync,
            before.job_tasks("ps"),
            at_cut.layout_version,
            at_cut.finished_workers,
        )
        client.check_model(client.wait_for_ps(timeout, ready=True), layout.replica.slots, sync)
        client.reshard_done()
    except BaseException:
        client.close()
        raise
    paused = time.monotonic() - start
    for k in range(new.num_ps, before.num_ps):  # drained: nothing is left on them
        old.shutdown(k)
    return paused


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

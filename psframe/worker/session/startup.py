"""How a worker joins the model on the ps tasks: at start-up, and again after a ps task was lost.

The chief (worker 0) creates the variables, or has the ps tasks restore
them from the latest checkpoint; every other worker waits until the ps
tasks hold the model. Both then check that the model on the ps tasks is
the one they built, with the same sync settings.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.worker.client import control_calls
from psframe.worker.client.ps_client import PsClient
from psframe.worker.model.replica import Replica

log = logging.getLogger(__name__)


def join(
    client: PsClient,
    replica: Replica,
    *,
    is_chief: bool,
    optimizer: OptimizerSpec,
    sync: SyncReplicas | None,
    checkpoint_dir: str | None,
    deadline: float,
    table_optimizer: OptimizerSpec | None = None,
    global_step: int = 0,
    resume: Callable[[SyncReplicas | None], object] | None = None,
) -> SyncReplicas | None:
    """Wait for the ps tasks; the chief creates (or restores) the variables; all check the model.

    ``sync``: the settings as given, resolved here: for the cluster's workers, or for
    the live workers where the ps tasks take workers joining and leaving (``max_workers``).
    ``global_step``: the worker's (0 when it starts). After a ps task was lost,
    the chief gives one that comes back with neither variables nor a checkpoint
    the values of its replica, and this step to go on from. ``resume``: the chief calls it with the sync
    settings resolved once the ps tasks answer, before it creates the variables (it finishes a
    re-layout under way). ``deadline`` (``time.monotonic()``): one for every wait here, so that
    ``connect_timeout`` bounds the whole join.

    Returns:
        The sync settings resolved (None: asynchronous training).

    Raises:
        ConnectTimeoutError: a ps task (or the model) did not come up by ``deadline``.
        ClusterMismatchError: a ps task holds another model, cluster or sync setting.
        ValueError: the sync settings do not fit the cluster.
    """
    infos = control_calls.wait_for_ps(client, max(0.0, deadline - time.monotonic()))
    if sync is not None:
        sync = sync.resolve(client.cluster.num_workers, elastic=infos[0].max_workers is not None)
    if is_chief:
        if resume is not None:
            resume(sync)
        create_variables(client, replica, optimizer, sync, checkpoint_dir, table_optimizer, global_step)
    infos = control_calls.wait_for_ps(client, max(0.0, deadline - time.monotonic()), ready=True)
    control_calls.check_model(client, infos, replica.slots, sync)
    return sync


def create_variables(
    client: PsClient,
    replica: Replica,
    optimizer: OptimizerSpec,
    sync: SyncReplicas | None,
    checkpoint_dir: str | None,
    table_optimizer: OptimizerSpec | None = None,
    global_step: int = 0,
) -> None:
    """The chief's part: send every ps task its variables' definitions and initial values.

    One message at a time, so that nobody buffers the whole model: whole
    variables in the messages of a full pull, embedding table parts in runs
    of rows. A ps task that holds the model already, or restores it from a
    checkpoint (a restarted ps, or a job run again), keeps what it has.
    """
    created = False

    def mine(ps_task: int) -> list:
        return [s for s in replica.slots if s.shard.ps_task == ps_task]

    create = functools.partial(
        control_calls.create,
        client,
        table_optimizer=table_optimizer if replica.tables else None,
        global_step=global_step,
    )
    told = set()  # the ps tasks sent a definition of what they hold
    for request in replica.plan.pull:
        created |= create(
            request.ps_task,
            mine(request.ps_task),
            replica.values(request.pull),
            optimizer,
            sync,
            checkpoint_dir,
        )
        told.add(request.ps_task)
    for slot in replica.slots:
        if slot.shard.table and slot.shard.dynamic is None:
            for run in replica.table_rows(slot):
                created |= create(
                    slot.shard.ps_task,
                    mine(slot.shard.ps_task),
                    (),
                    optimizer,
                    sync,
                    checkpoint_dir,
                    rows=[run],
                )
                told.add(slot.shard.ps_task)
    # A ps task holding only dynamic tables gets no values; one holding nothing at all (a model of
    # fewer variables than ps tasks) is told so: every ps task must hold the model to be ready.
    for ps_task in sorted(set(range(client.num_ps)) - told):
        created |= create(ps_task, mine(ps_task), (), optimizer, sync, checkpoint_dir)
    log.info("chief %s the model on %d ps tasks", "created" if created else "found (or restored)", client.num_ps)

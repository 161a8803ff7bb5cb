"""The Init handler: the chief makes (or finds) the model a ps task serves.

The chief sends every ps task the definitions of the variables placed there,
and the optimizers. A task answers by the first of five branches that applies:

1. **ready already**: the definitions and optimizers must be those it holds
   (a worker restarted, or a chief of the same job);
2. **adopt from peers** (``adopt_from``): a task of a re-layout's new layout
   takes its parts from the tasks before
   (:meth:`~psframe.ps.service.relayout_participant.RelayoutParticipant.adopt`);
3. **a re-layout's snapshot pending**: the task took a cut and its new parts
   are not taken: it refuses, and the chief takes the re-layout up again;
4. **restore**: the latest checkpoint of the chief's (or the task's) folder;
5. **assemble**: the chief's initial values, arriving in chunks
   (:class:`~psframe.ps.service.incoming_model.PendingModel`); a chief past
   step 0 gives a task that lost its model and has no checkpoint the values
   of its replica, and training goes on from the step it had reached.
"""

from __future__ import annotations

import logging

import torch

from psframe import errors
from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError
from psframe.optim import OptimizerSpec
from psframe.ps import recovery
from psframe.ps.elastic.relayout import Relayout
from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.service.definitions import dynamic_parts
from psframe.ps.service.incoming_model import PendingModel
from psframe.ps.service.membership import Membership
from psframe.ps.service.place import TaskPlace
from psframe.ps.service.relayout_participant import RelayoutParticipant
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.ps.store.table_parts import DynamicPart
from psframe.wire import codec, messages
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


class ModelInit:
    """The Init handler of ps task ``task_index``.

    Args:
        store, model: the variables and what goes with them.
        membership: admits the chief.
        roster: the chief is alive while its call runs.
        ledger: the chief's last push applied here (it numbers its pushes on from there).
        relayout, participant: the re-layouts taken, and the adopt branch.
        place: the task's cluster and its connections to the other ps tasks.
        elastic: workers may join beyond the cluster's (the sync definition is checked so).
        keeps_data: this process keeps the task's data queues (a checkpoint restores them).
        checkpoint_dir: the task's own checkpoint folder, where the chief names none.
    """

    def __init__(
        self,
        store: VariableStore,
        model: ServedModel,
        membership: Membership,
        roster: WorkerRoster,
        ledger: PushLedger,
        relayout: Relayout,
        participant: RelayoutParticipant,
        place: TaskPlace,
        *,
        task_index: int,
        elastic: bool,
        keeps_data: bool,
        checkpoint_dir: str | None,
    ) -> None:
        self._store, self._model, self._membership, self._roster = store, model, membership, roster
        self._ledger, self._relayout, self._participant, self._place = ledger, relayout, participant, place
        self._task_index = task_index
        self._task_name = ClusterSpec.task_name("ps", task_index)
        self._elastic, self._keeps_data, self._checkpoint_dir = elastic, keeps_data, checkpoint_dir
        self._pending: PendingModel | None = None  # the chief's initial values, while they arrive

    def init(self, data: bytes) -> bytes:
        """Answer an Init request (its header and the chief's initial values, or a chunk of them)."""
        header, tensors = codec.decode(data, pb.InitHeader)
        self._membership.check_caller(header.caller)
        with self._roster.call(header.caller.task_index):
            return self._init(header, tensors)

    def _init(self, header: pb.InitHeader, tensors: list[torch.Tensor]) -> bytes:
        if header.caller.task_index != 0:
            raise ClusterMismatchError(
                f"only the chief ({ClusterSpec.task_name('worker', 0)}) creates variables, "
                f"not {ClusterSpec.caller_name('worker', header.caller.task_index)}"
            )
        optimizer = messages.optimizer_from_proto(header.optimizer)
        table_optimizer = (
            messages.optimizer_from_proto(header.table_optimizer) if header.HasField("table_optimizer") else None
        )
        defs = list(header.variables)
        messages.check_definitions(
            self._task_name,
            defs,
            header.sync if header.HasField("sync") else None,
            self._place.cluster.num_workers,
            elastic=self._elastic,
        )
        dynamic = dynamic_parts(defs)
        static = [d for d in defs if d.name not in dynamic]  # the variables with initial values
        tables = [d.name for d in static if d.table]
        sync = header.sync if header.HasField("sync") else None
        store, model = self._store, self._model
        with model.lock:
            created = False
            if store.ready:
                # The store checks the variables and the optimizers are those it holds.
                store.create(
                    _values_like(static), optimizer, tables=tables, table_optimizer=table_optimizer, dynamic=dynamic
                )
                messages.check_same_sync(
                    f"the chief's model does not match what {self._task_name} holds", sync, model.sync_def
                )
            elif header.adopt_from:
                self._participant.adopt(header, defs, optimizer, sync, table_optimizer)
            elif self._relayout.snapshot is not None:  # moved, its new parts not taken: never made anew
                raise errors.LayoutChangedError(
                    f"{self._task_name} is in the middle of a re-layout (its parts of before are in the snapshots "
                    f"of the ps tasks before): the chief takes it up again (it asks ps 0) instead of making the model"
                )
            elif self._restore_for_chief(
                header.checkpoint_dir or self._checkpoint_dir, defs, optimizer, sync, table_optimizer
            ):
                pass
            else:
                created = self._assemble(
                    header,
                    tensors,
                    defs,
                    static,
                    optimizer,
                    sync,
                    tables=tables,
                    table_optimizer=table_optimizer,
                    dynamic=dynamic,
                )
            state = pb.TaskInfo.READY if store.ready else pb.TaskInfo.WAITING_FOR_MODEL
            reply = pb.InitReplyHeader(
                state=state,
                created=created,
                global_step=store.global_step,
                last_push_id=self._ledger.last_push(header.caller.task_index),
                layout_version=self._relayout.version,
            )
        return codec.encode(reply, ())

    def _assemble(
        self,
        header: pb.InitHeader,
        tensors: list[torch.Tensor],
        defs: list[pb.VariableDef],
        static: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        *,
        tables: list[str],
        table_optimizer: OptimizerSpec | None,
        dynamic: dict[str, DynamicPart],
    ) -> bool:
        """Add the chief's chunk of initial values (of the ``static`` variables: those not of dynamic
        tables); once they are all here, create the model.

        Returns:
            Whether this chunk created the model.
        """
        store, model = self._store, self._model
        if self._pending is None or static != self._pending.defs:  # a new (or restarted) chief: start over
            self._pending = PendingModel(self._task_name, static, store)
        self._pending.add(header.tensors, tensors)
        if not self._pending.complete:
            return False
        # A chief past step 0 gives the values of its replica to a task that lost its
        # own and has no checkpoint: training goes on from the step it had reached.
        resumed = max([header.global_step, *self._place.peers.global_steps()]) if header.global_step else 0
        # Under the store's lock, GetInfo sees the model whole or not at all:
        # READY with the definitions, and the barrier, in one step.
        with store.lock:
            created = store.create(
                self._pending.values(),
                optimizer,
                copy=False,
                tables=tables,
                table_optimizer=table_optimizer,
                dynamic=dynamic,
            )
            model.defs = defs
            if resumed:
                store.global_step = resumed
            if sync is not None:
                model.start_sync(sync)
        self._pending = None
        if resumed:
            log.warning(
                "%s: started again without a checkpoint to restore: took the values of the "
                "chief's replica (at most a step old) for its %d variables and goes on at "
                "global step %d; their optimizer state starts afresh (give the job a "
                "checkpoint_dir to keep it)",
                self._task_name,
                len(defs),
                resumed,
            )
        else:
            log.info(
                "%s: created %d variables (%d bytes) with %r", self._task_name, len(defs), store.nbytes(), optimizer
            )
        return created

    def _restore_for_chief(
        self,
        url: str | None,
        defs: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        table_optimizer: OptimizerSpec | None,
    ) -> bool:
        """Restore the variables the chief placed here from the latest checkpoint, if any."""
        if not url:
            return False
        restored = recovery.restore_onto(
            url, defs, optimizer, table_optimizer, keeps_data=self._task_index == 0 and self._keeps_data
        )
        if restored is None:
            return False
        restored.sync = sync
        self._model.adopt(restored)
        return True


def _values_like(defs: list[pb.VariableDef]) -> dict[str, torch.Tensor]:
    """Tensors of the definitions' shapes and dtypes, holding nothing (to check a model against)."""
    return {d.name: torch.empty(tuple(d.shape), dtype=codec.dtype_from_name(d.dtype), device="meta") for d in defs}

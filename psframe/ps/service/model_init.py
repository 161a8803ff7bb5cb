"""The Init and TakeParts handlers: the chief makes (or finds) the model a ps task serves.

Init: the chief sends every ps task the definitions of the variables placed
there, and the optimizers. A task answers by the first of four branches that applies:

1. **ready already**: the definitions and optimizers must be those it holds
   (a worker restarted, or a chief of the same job);
2. **a re-layout's snapshot pending**: the task took a cut and its new parts
   are not taken: it refuses, and the chief takes the re-layout up again;
3. **restore**: the latest checkpoint of the chief's (or the task's) folder;
4. **assemble**: the chief's initial values, arriving in chunks
   (:class:`~psframe.ps.service.incoming_model.PendingModel`); a chief past
   step 0 gives a task that lost its model and has no checkpoint the values
   of its replica, and training goes on from the step it had reached.

TakeParts: at a re-layout, a task of the new layout takes its parts from the
tasks before
(:meth:`~psframe.ps.service.relayout_participant.RelayoutParticipant.take_parts`);
a task ready already checks, as Init's first branch does.
"""

from __future__ import annotations

import dataclasses
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
from psframe.wire import codec, dtypes, messages
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)


class ModelInit:
    """The Init and TakeParts handlers of ps task ``task_index``.

    Args:
        store, model: the variables and what goes with them.
        membership: admits the chief.
        roster: the chief is alive while its call runs.
        ledger: the chief's last push applied here (it numbers its pushes on from there).
        relayout, participant: the re-layouts taken, and what a task does to take its parts at one.
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

    def take_parts(self, request: pb.TakePartsRequest) -> pb.TakePartsReply:
        """Answer a TakeParts request: take the parts the chief placed here from the tasks before a
        re-layout (or, holding the model already, check it is this one)."""
        self._membership.check_caller(request.caller)
        with self._roster.call(request.caller.task_index):
            model = _Definitions.read(request, self._task_name, self._place.cluster.num_workers, self._elastic)
            store = self._store
            with self._model.lock:
                if store.ready:
                    self._check_held(model)
                else:
                    self._participant.take_parts(
                        request, model.defs, model.optimizer, model.sync, model.table_optimizer
                    )
                return pb.TakePartsReply(
                    state=pb.TaskInfo.READY if store.ready else pb.TaskInfo.WAITING_FOR_MODEL,
                    global_step=store.global_step,
                    last_push_id=self._ledger.last_push(request.caller.task_index),
                    layout_version=self._relayout.version,
                )

    def _check_held(self, model: _Definitions) -> None:
        """Check that the model this task holds is ``model`` (the store checks the variables and the optimizers)."""
        self._store.create(
            _values_like(model.static),
            model.optimizer,
            tables=model.tables,
            table_optimizer=model.table_optimizer,
            dynamic=model.dynamic,
        )
        messages.check_same_sync(
            f"the chief's model does not match what {self._task_name} holds", model.sync, self._model.sync_def
        )

    def _init(self, header: pb.InitHeader, tensors: list[torch.Tensor]) -> bytes:
        model = _Definitions.read(header, self._task_name, self._place.cluster.num_workers, self._elastic)
        defs, static, optimizer, sync = model.defs, model.static, model.optimizer, model.sync
        table_optimizer, tables, dynamic = model.table_optimizer, model.tables, model.dynamic
        store = self._store
        with self._model.lock:
            created = False
            if store.ready:
                self._check_held(model)
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
        self._model.take_restored(restored)
        return True


def _values_like(defs: list[pb.VariableDef]) -> dict[str, torch.Tensor]:
    """Tensors of the definitions' shapes and dtypes, holding nothing (to check a model against)."""
    return {d.name: torch.empty(tuple(d.shape), dtype=dtypes.dtype_from_name(d.dtype), device="meta") for d in defs}


@dataclasses.dataclass(frozen=True)
class _Definitions:
    """The model the chief sends (Init, TakeParts), read and checked."""

    defs: list[pb.VariableDef]
    static: list[pb.VariableDef]  # those with initial values (not of dynamic tables)
    tables: list[str]  # of those, the embedding tables' parts
    dynamic: dict[str, DynamicPart]
    optimizer: OptimizerSpec
    table_optimizer: OptimizerSpec | None
    sync: pb.SyncDef | None

    @classmethod
    def read(
        cls, request: pb.InitHeader | pb.TakePartsRequest, task_name: str, num_workers: int, elastic: bool
    ) -> _Definitions:
        """The model of ``request``, checked.

        Raises:
            ClusterMismatchError: the caller is not the chief.
            WireFormatError: the definitions are not a model psframe serves.
        """
        if request.caller.task_index != 0:
            raise ClusterMismatchError(
                f"only the chief ({ClusterSpec.task_name('worker', 0)}) creates variables, "
                f"not {ClusterSpec.caller_name('worker', request.caller.task_index)}"
            )
        optimizer = messages.optimizer_from_proto(request.optimizer)
        table_optimizer = (
            messages.optimizer_from_proto(request.table_optimizer) if request.HasField("table_optimizer") else None
        )
        defs = list(request.variables)
        sync = request.sync if request.HasField("sync") else None
        messages.check_definitions(task_name, defs, sync, num_workers, elastic=elastic)
        dynamic = dynamic_parts(defs)
        static = [d for d in defs if d.name not in dynamic]
        tables = [d.name for d in static if d.table]
        return cls(defs, static, tables, dynamic, optimizer, table_optimizer, sync)

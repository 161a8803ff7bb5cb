"""A ps task's part in a live re-layout: ps tasks added or drained while training goes on.

The state machine of what a task knows of re-layouts is
:class:`psframe.ps.elastic.relayout.Relayout`; this is what a task does in one:

- ``AskRelayout``: ps 0 is asked for a re-layout (and checks it can take it
  live); ``RelayoutStatus``: where it stands (anyone may ask);
  ``RelayoutDone``: the chief says a layout's parts are all taken.
- ``Precopy``: before a stage's cut, a task of the layout after it copies
  the table parts it will take (each through ``CopyPartsLive``), while
  training goes on (:mod:`psframe.ps.elastic.precopy`).
- The cut (``MoveCut``, :mod:`~psframe.ps.service.cut_handler`): the
  task snapshots its parts into memory and lets its model go, under the
  store's lock, and moves to the cluster after it if it keeps its index.
- ``FetchParts``: the tasks of the new layout read those parts.
- ``TakeParts``: a task of the new layout takes its parts from the tasks
  before (:meth:`RelayoutParticipant.take_parts`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import torch

from psframe import errors
from psframe.checkpoint.shard import OptimizerData, ShardData
from psframe.cluster import ClusterSpec
from psframe.errors import ClusterMismatchError
from psframe.optim import OptimizerSpec
from psframe.ps import recovery
from psframe.ps.elastic import precopy
from psframe.ps.elastic.fetch import copy_ahead, fetch_shards, ps_host
from psframe.ps.elastic.relayout import Relayout, select
from psframe.ps.elastic.relayout import prepare as relayout_prepare
from psframe.ps.elastic.shard_codec import encode_shard, shard_chunks
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.service.place import TaskPlace
from psframe.ps.service.served_model import ServedModel
from psframe.ps.store import VariableStore
from psframe.wire import codec, dtypes, messages
from psframe.wire import psframe_pb2 as pb

log = logging.getLogger(__name__)

# The longest a task of a new layout waits for the parts of one task before it (FetchParts).
MAX_FETCH_SECONDS = 120.0

# The longest a RelayoutStatus request waits for the layout to move (it holds a server thread).
STATUS_WAIT_SECONDS = 5.0


class RelayoutParticipant:
    """What ps task ``task_index`` does in a re-layout: its handlers of the re-layout's calls
    (see the module), the cut's move, and taking its parts from the tasks before.

    Args:
        store, model: the variables and what goes with them.
        relayout: the task's re-layout state machine.
        place: the task's cluster and connections; a move changes them.
        pushes: what a snapshot keeps of the pushes its values hold.
        roster: the workers (those finished are told to the new layout).
        check_tool_or_worker: refuses a caller that is no worker or tool of the task's cluster.
        take_finished: the workers that finished before a re-layout finish here too.
        on_moved: called with the cluster after a cut that kept this task at its index.

    Attributes:
        live: the task may take a re-layout live (False where it serves from several processes).
        parts_copied_ahead: table parts this task took as copies made ahead of their cut,
        rows_changed_since_copy: and the rows of them changed since.
    """

    def __init__(
        self,
        store: VariableStore,
        model: ServedModel,
        relayout: Relayout,
        place: TaskPlace,
        pushes: recovery.PushRecord,
        roster: WorkerRoster,
        *,
        task_index: int,
        check_tool_or_worker: Callable[[pb.Caller], None],
        take_finished: Callable[[Iterable[int]], None],
        on_moved: Callable[[ClusterSpec], None],
    ) -> None:
        self._store, self._model, self._relayout, self._place = store, model, relayout, place
        self._pushes, self._roster = pushes, roster
        self._task_index = task_index
        self._task_name = ClusterSpec.task_name("ps", task_index)
        self._check_tool_or_worker, self._take_finished, self._on_moved = check_tool_or_worker, take_finished, on_moved
        self._copies = precopy.Copies()  # table parts copied ahead of a re-layout's next cut
        self.live = True
        self.parts_copied_ahead = 0
        self.rows_changed_since_copy = 0

    # ---- AskRelayout, RelayoutStatus, RelayoutDone, Precopy

    def ask(self, request: pb.AskRelayoutRequest) -> pb.RelayoutStatusReply:
        """Ask ps 0 for a re-layout to ``request.cluster_spec`` (a tool or worker of the cluster)."""
        self._check_tool_or_worker(request.caller)
        new = ClusterSpec.from_string(request.cluster_spec)
        self._check_possible()
        self._relayout.ask(self._place.cluster, new)
        log.info("%s: a re-layout to ps tasks %s is asked for", self._task_name, new.job_tasks("ps"))
        return self._relayout.reply()

    def status(self, request: pb.RelayoutStatusRequest) -> pb.RelayoutStatusReply:
        """What is asked or taken (to anyone, as GetInfo: a worker started with the ps tasks of
        before asks where they went); with ``wait_seconds``, once the layout moved past
        ``after_version`` (a following worker waits here rather than asking again and again)."""
        if request.wait_seconds > 0:
            self._relayout.wait_past(request.after_version, min(request.wait_seconds, STATUS_WAIT_SECONDS))
        return self._relayout.reply()

    def done(self, request: pb.RelayoutDoneRequest) -> pb.RelayoutDoneReply:
        """The chief: every task of layout ``caller.layout_version`` holds its parts; the cut's snapshot may go."""
        self._check_tool_or_worker(request.caller)
        self._relayout.release(request.caller.layout_version)
        return pb.RelayoutDoneReply()

    def precopy(self, request: pb.PrecopyRequest) -> pb.PrecopyReply:
        """The chief, before a stage's cut, to a task of the layout after it (:meth:`_copy_ahead`)."""
        self._copy_ahead(request)
        return pb.PrecopyReply()

    def _check_possible(self) -> None:
        """Refuse a re-layout this task cannot take live (see :mod:`psframe.ps.elastic.relayout`).

        Raises:
            ClusterSpecError: naming why, and what to do instead.
        """
        why = ""
        if self._task_index != 0:
            why = f"ask {ClusterSpec.task_name('ps', 0)}, which leads it, not {self._task_name}"
        elif not self.live:
            why = "the ps tasks serve from several processes (start them with --serving_processes 1)"
        elif not self._store.ready:
            why = "the ps tasks hold no model yet: start the job with the new ps tasks instead"
        if why:
            raise errors.ClusterSpecError(
                f"{self._task_name} cannot take this re-layout while training: {why}. Otherwise save a checkpoint, "
                f"stop the job and start it with the new --ps_hosts: it restores onto the new layout"
            )

    def _copy_ahead(self, request: pb.PrecopyRequest) -> None:
        """Before a stage's cut, while training goes on: make ready the optimizers this task will
        build, and copy the fixed table parts it takes at the cut from the tasks before that hold
        them (:mod:`psframe.ps.elastic.precopy`); kept until that stage's parts are taken.

        Raises:
            ClusterMismatchError: the caller is no worker or tool of the cluster after the stage,
                or that cluster has not this task at its index.
        """
        start = time.monotonic()
        cluster, k, caller = self._place.cluster, self._task_index, request.caller
        try:
            after = ClusterSpec.from_string(request.cluster_spec)
        except ValueError:  # no cluster: no caller of it either
            after = None
        if (
            after is None
            or caller.job_name not in ("tool", "worker")
            or caller.cluster_fingerprint != after.fingerprint
            or k >= after.num_ps
            or after.task_address("ps", k) != cluster.task_address("ps", k)
        ):
            raise ClusterMismatchError(
                f"{self._task_name} copies parts ahead of a re-layout's cut for a worker or tool of the cluster "
                f"after it, where it is {self._task_name}; the caller has job {caller.job_name!r} and "
                f"fingerprint {caller.cluster_fingerprint or 'none'}, the cluster {request.cluster_spec!r}"
            )
        dense = {dtypes.dtype_from_name(d.dtype) for d in request.variables if not d.table}
        tables = {dtypes.dtype_from_name(d.dtype) for d in request.variables if d.table}
        ready = []
        if request.HasField("optimizer") and dense:
            ready.append((messages.optimizer_from_proto(request.optimizer), sorted(dense, key=str), False))
        if request.HasField("table_optimizer") and tables:
            ready.append((messages.optimizer_from_proto(request.table_optimizer), sorted(tables, key=str), True))
        relayout_prepare(ready)
        named = set(request.parts)
        held = {(d.name, d.row_start, tuple(d.shape)) for d in self._model.defs}
        gained = [d for d in request.variables if d.name in named and (d.name, d.row_start, tuple(d.shape)) not in held]
        addresses = list(request.before)
        asking = pb.Caller(job_name="ps", task_index=k, cluster_fingerprint=cluster.fingerprint)
        own = k if k < len(addresses) else None  # a task kept keeps its index
        try:
            copies = copy_ahead(
                self._place.peers_at(addresses), gained, asking, MAX_FETCH_SECONDS, list(request.read_from), own
            )
        except errors.PsframeError as e:  # the copies only shorten the pause: the parts cross whole at the cut
            log.warning(
                "%s: could not copy table parts ahead of a re-layout's cut (%s): they cross at it", self._task_name, e
            )
            copies = {}
        self._copies.keep(addresses, copies)
        if copies:
            log.info(
                "%s: copied %d table parts (%d bytes with optimizer state) ahead of a re-layout's cut in %.3f s",
                self._task_name,
                sum(len(c.parts) for c in copies.values()),
                self._copies.nbytes(),
                time.monotonic() - start,
            )

    # ---- the cut (MoveCut)

    def move(self, after: ClusterSpec, cut: Callable[[], None] | None, stage: pb.MoveStage | None = None) -> None:
        """Take a re-layout's cut (of ``stage``): snapshot the parts into memory and move to ``after``.

        Under the store's lock with the snapshot, before a push can apply: the variables go (the
        snapshot holds them), and a worker of the cluster before is refused from then on. A task
        ``after`` keeps takes its cluster, and waits for its new parts; one it lacks only hands over.
        ``cut``: raises unless the cut still holds (checked under that lock, before the snapshot).
        """
        before = self._place.cluster
        model, store, relayout = self._model, self._store, self._relayout
        row_versions: dict[str, torch.Tensor] = {}

        def stop_pushes() -> None:
            row_versions.update(store.row_versions())  # for the tasks that copied parts ahead
            relayout.move(before, after, stage)
            model.let_go(relayout.refusal())  # a round under way is refused, and sent again
            if self._task_index < after.num_ps and after != before:
                self._place.move(after)
                self._on_moved(after)

        snapshot = recovery.snapshot_shard(
            store,
            model.defs,
            model.sync_def,
            self._task_index,
            before.num_ps,
            self._pushes,
            cut,
            then=stop_pushes,
            copy=False,  # the store lets go of its tensors under the same lock: the snapshot holds them
        )
        relayout.keep(snapshot, row_versions)
        kept = "keeps its index, and waits for its new parts" if self._task_index < after.num_ps else "is drained"
        log.info(
            "%s: took a re-layout's cut at global step %d (%d parts, %d bytes); it %s",
            self._task_name,
            snapshot.global_step,
            len(snapshot.variables),
            sum(v.value.nbytes for v in snapshot.variables),
            kept,
        )

    def moved_reply(self) -> pb.MoveCutReply:
        """What a re-layout's cut answers: where this task stands after it."""
        snapshot = self._relayout.snapshot
        pushes = (snapshot.pushes if snapshot is not None else None) or {}
        return pb.MoveCutReply(
            global_step=self._store.global_step,
            layout_version=self._relayout.version,
            finished_workers=sorted(self._roster.finished),
            ledger=pb.PushLedger(last_push=pushes.get("last_push", ()), applied_steps=pushes.get("applied_steps", ())),
        )

    # ---- FetchParts, CopyPartsLive

    def fetch_parts(self, data: bytes) -> bytes:
        """A task of the new layout reads the parts of some variables, as this task snapshot them at
        the cut (those it copied ahead: their rows changed since)."""
        header, _ = codec.decode(data, pb.FetchPartsHeader)
        moved_to = self._relayout.moved_to
        caller = header.caller
        if caller.job_name != "ps" or moved_to is None or caller.cluster_fingerprint != moved_to.fingerprint:
            raise ClusterMismatchError(
                f"{self._task_name} hands its parts over only to the ps tasks of the re-layout it took "
                f"({'none taken' if moved_to is None else moved_to.job_tasks('ps')}), not to "
                f"{ClusterSpec.caller_name(caller.job_name, caller.task_index)} of fingerprint "
                f"{caller.cluster_fingerprint or 'none'}"
            )
        return self._relayout.hand_over(shard_chunks(*self._relayout.parts_since(header)), header.same_host)

    def copy_parts_live(self, data: bytes) -> bytes:
        """Copies of this task's fixed table parts that hold rows ``header`` wants, as they are now,
        with the mark of their rows' versions and the layout version: a task of a re-layout's next
        layout copies them ahead of the cut (:mod:`psframe.ps.elastic.precopy`)."""
        header, _ = codec.decode(data, pb.CopyPartsLiveHeader)
        if header.caller.job_name != "ps":
            raise ClusterMismatchError(
                f"{self._task_name} hands its parts over only to ps tasks, not to "
                f"{ClusterSpec.caller_name(header.caller.job_name, header.caller.task_index)}"
            )
        store = self._store
        with store.lock:  # the copies, their mark and the layout version of one instant
            held = [recovery.part_record(d) for d in self._model.defs if precopy.copied_ahead(d)]
            wanted = select(held, list(header.variables), header.rows)
            values, states, mark = store.live_copies([p.name for p in wanted])
            version = self._relayout.version
            spec = store.table_optimizer_spec or store.optimizer_spec
        assert spec is not None  # the store holds a model: it was read
        parts = [dataclasses.replace(p, value=values[p.name], state=states[p.name]) for p in wanted]
        optimizer = OptimizerData(spec.name, dict(spec.kwargs))
        num_ps = self._place.cluster.num_ps
        shard = ShardData(store.global_step, self._task_index, num_ps, optimizer, None, tuple(parts))
        return encode_shard(shard, mark=mark, layout_version=version)

    # ---- TakeParts: the parts of the new layout

    def take_parts(
        self,
        request: pb.TakePartsRequest,
        defs: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        table_optimizer: OptimizerSpec | None,
    ) -> None:
        """Take the parts the chief placed here (``defs``) from the ps tasks ``request.before``
        names, and the workers finished there; a task new in this layout counts the re-layouts as
        the others do. Call with the model's lock held."""
        ledger = request.ledger if request.HasField("ledger") else None
        addresses = list(request.before)
        self._read_from_peers(addresses, defs, optimizer, sync, table_optimizer, list(request.read_from), ledger)
        self._take_finished(request.finished_workers)
        if self._relayout.moved_to is None:  # new in this layout
            cluster = self._place.cluster
            before = ClusterSpec({"ps": addresses, "worker": cluster.job_tasks("worker")})
            self._relayout.took_parts(before, cluster, request.layout_version)

    def _read_from_peers(
        self,
        addresses: list[str],
        defs: list[pb.VariableDef],
        optimizer: OptimizerSpec,
        sync: pb.SyncDef | None,
        table_optimizer: OptimizerSpec | None,
        tasks: list[int],
        ledger: pb.PushLedger | None = None,
    ) -> None:
        """Take the parts the chief placed here from the ps tasks of the layout before (their cut's
        snapshots): from ``tasks`` of them, or all.

        Every task of the new layout takes the push ledger of ps 0 at the cut (every task had
        applied the same steps of every worker then): ``ledger``, as ps 0 answered the cut; or,
        without, read from ps 0's snapshot (then ps 0 is among ``tasks``). ps 0, which a
        re-layout always keeps, keeps its data queues as they are.
        """
        start = time.monotonic()
        k = self._task_index
        caller = pb.Caller(job_name="ps", task_index=k, cluster_fingerprint=self._place.cluster.fingerprint)
        # A task kept reads its own snapshot in place: no copy of the parts it keeps.
        own = (k, self._relayout) if self._relayout.snapshot is not None else None
        if tasks and ((ledger is None and 0 not in tasks) or not all(0 <= t < len(addresses) for t in tasks)):
            raise errors.ClusterMismatchError(
                f"{self._task_name} takes its parts from ps tasks {tasks} of the {len(addresses)} before the "
                f"re-layout: expected indices below {len(addresses)}, and ps 0 among them unless the chief "
                f"sends its push ledger"
            )
        copies = self._copies.take(addresses)
        host = ps_host(self._place.cluster, k)
        peers = self._place.peers_at(addresses)
        taken = fetch_shards(peers, defs, caller, MAX_FETCH_SECONDS, own, tasks, copies, host)
        shards = taken.shards
        fetched = time.monotonic() - start
        restored = recovery.restore_from_shards(
            shards, defs, optimizer, table_optimizer, source="the re-layout's snapshot"
        )
        if ledger is not None:
            restored.pushes = {"last_push": list(ledger.last_push), "applied_steps": list(ledger.applied_steps)}
        else:  # shards[0] is ps 0's: it is among the tasks read
            pushes = dict(shards[0].pushes or {})
            restored.pushes = {key: v for key, v in pushes.items() if key in ("last_push", "applied_steps")}
        restored.sync = sync
        # ps 0 is kept: its data queues stay, leases and all. The tensors restored are the
        # snapshot's own (nothing else writes them) or fresh: the store takes them as they are.
        self._model.take_restored(restored, peers=False, data=False, take=True)
        log.info(
            "%s: took %d parts (%d bytes with optimizer state) from %d of the %d ps tasks before the re-layout "
            "in %.3f s (%.3f s reading them; %d parts copied ahead, %d of their rows changed since), at global step %d",
            self._task_name,
            len(defs),
            self._store.nbytes(),
            len(shards),
            len(addresses),
            time.monotonic() - start,
            fetched,
            taken.copied_parts,
            taken.changed_rows,
            self._store.global_step,
        )
        self.parts_copied_ahead += taken.copied_parts
        self.rows_changed_since_copy += taken.changed_rows

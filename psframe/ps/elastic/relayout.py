"""A live re-layout: ps tasks added or drained while training goes on.

Placement is computed by every worker from the model and the number of ps
tasks (:mod:`psframe.cluster.placement`), so another number of ps tasks is
another layout of the same model. A re-layout moves the parts there through
memory, ps task to ps task, with their optimizer state:

1. **Asked.** A tool (``psframe reshard``: ``psframe.worker.client.relayout_calls.ask_reshard``) gives ps 0
   the new cluster (:meth:`Relayout.ask`); the new ps tasks are started with it, empty.
2. **Cut.** Between two of its steps the chief, told of such a request by ps 0's
   step replies (``PushPullReplyHeader.relayout_pending``), takes a checkpoint's
   cut of every ps task of the layout before (each worker's steps begun anywhere
   applied everywhere; in synchronous training, a round boundary). At the cut each task snapshots its parts into
   memory (:func:`psframe.ps.recovery.snapshot_shard`) and moves (``MoveCut``): from then on
   a worker of the cluster before is refused with
   :class:`~psframe.errors.LayoutChangedError`, nothing of its push applied.
3. **Take parts.** The chief places the model for the new cluster and sends every
   task of it its definitions (``TakeParts``) and ps 0's push
   ledger at the cut. Each reads the rows it now holds from the snapshots of
   the tasks before (the ``FetchParts`` RPC), re-sliced as a restore onto
   another number of ps tasks is (:func:`psframe.ps.recovery.restore_from_shards`);
   ps 0 keeps the data queues. Fixed table parts that move alone were copied
   ahead of the cut while training went on (``Precopy``, :mod:`psframe.ps.elastic.precopy`): of
   those, only the rows written since cross.
4. **Reroute.** A refused worker asks ps 0 where the ps tasks went, places the
   model for the new cluster, pulls, and sends its step again there.
5. **Drain.** A ps task the new cluster lacks answers ``FetchParts`` until the
   chief stops it, once every task of the new layout holds its parts (``RelayoutDone``).

The chief takes these steps once per stage (:mod:`psframe.cluster.moves`): each
stage moves a few parts, with a cut of its own (``MoveCutRequest.stage``), and
ps 0 says which stage the layout is at (``RelayoutStatusReply.stage``). A stage that
keeps the cluster (parts moved among its tasks) refuses the workers of the layout
before by their layout version alone. Training pauses for one stage's transfer:
from its cut until the layout after it holds the model; a task keeps the parts it
keeps as they are (its own snapshot is read in place).

What may change (:func:`check_new_cluster`): the ps tasks kept keep their
index, so the new ps list begins with the old one (tasks added) or the old one
begins with it (the last tasks drained); the workers stay as they are.

This module is what one ps task knows of re-layouts (:class:`Relayout`) and
which parts of its snapshot a ``FetchParts`` request gets (:func:`select`).
The reads of step 3 are :mod:`psframe.ps.elastic.fetch`; the replies' format,
:mod:`psframe.ps.elastic.shard_codec`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psframe.checkpoint.shard import ShardData, VariableData
from psframe.cluster import ClusterSpec
from psframe.errors import CheckpointError, ClusterSpecError, LayoutChangedError
from psframe.optim import OptimizerSpec
from psframe.optim.row_state import is_row_state
from psframe.ps.elastic import precopy
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire import same_host as same_host_memory
from psframe.wire.same_host import HeldMessage


def check_new_cluster(before: ClusterSpec, after: ClusterSpec) -> None:
    """Check that ``after`` is a re-layout of ``before`` that psframe makes live.

    Raises:
        ClusterSpecError: naming what differs, and what may.
    """
    old, new = before.job_tasks("ps"), after.job_tasks("ps")
    if before.job_tasks("worker") != after.job_tasks("worker"):
        raise ClusterSpecError(
            "a re-layout moves ps tasks only: the new cluster must list the same workers "
            f"({before.job_tasks('worker')}), got {after.job_tasks('worker')}"
        )
    if old == new:
        raise ClusterSpecError(f"the new cluster has the ps tasks the job has already ({old}): nothing to move")
    if new[: len(old)] != old and old[: len(new)] != new:
        raise ClusterSpecError(
            f"the ps tasks kept keep their index: the new ps list must begin with the old one {old} "
            f"(tasks added at its end) or be a beginning of it (the last tasks drained), got {new}"
        )


class Relayout:
    """What one ps task knows of re-layouts: the one asked for, and the one it moved to.

    Every method is safe to call from any thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)  # notified when the layout version changes
        self.requested: ClusterSpec | None = None  # ps 0: asked for, not yet taken
        self.before: str | None = None  # the fingerprint of the cluster this task moved from
        self.before_cluster: ClusterSpec | None = None  # and that cluster
        self.moved_to: ClusterSpec | None = None
        self.snapshot: ShardData | None = None  # its parts at the cut, until the task stops
        self._row_versions: dict[str, torch.Tensor] = {}  # its fixed table rows' versions at the cut
        self._shared: list[HeldMessage] = []  # replies handed to tasks of this host, until taken
        self.version = 0
        self.stage: pb.MoveStage | None = None  # of the re-layout the last move was a stage of
        self.relayouts = 0  # re-layouts taken to their last stage
        self._cutting_until = 0.0  # a re-layout's cut is under way here until then (monotonic)
        # A re-layout asked for or under way: a plain attribute, written under the lock and read
        # without it by every step's reply (PushPullReplyHeader.relayout_pending), at no cost.
        self.pending = False

    def ask(self, current: ClusterSpec, new: ClusterSpec) -> None:
        """Record that the ps tasks move from ``current`` to ``new`` (ps 0; a tool asked).

        Raises:
            ClusterSpecError: ``new`` is no re-layout psframe makes live (:func:`check_new_cluster`),
                or another one is asked for already.
        """
        check_new_cluster(current, new)
        with self._lock:
            stage = self.stage
            if stage is not None and self.under_way:
                target = ClusterSpec.from_string(stage.target_spec)
                raise ClusterSpecError(
                    f"a re-layout to ps tasks {target.job_tasks('ps')} is under way (stage {stage.stage} of "
                    f"{stage.stages}); ask again once it is done"
                )
            if self.requested is not None and self.requested != new:
                raise ClusterSpecError(
                    f"a re-layout to ps tasks {self.requested.job_tasks('ps')} waits already; ask again once it is done"
                )
            self.requested = new
            self.pending = True

    def move(self, before: ClusterSpec, after: ClusterSpec, stage: pb.MoveStage | None = None) -> None:
        """Move at the cut (of ``stage`` of a staged re-layout): workers of the layout before are
        refused from now on."""
        with self._lock:
            self.before, self.before_cluster = before.fingerprint, before
            self.moved_to = after
            self.stage = _staged(stage)
            self.relayouts += not self.under_way
            self.snapshot, self._row_versions = None, {}
            self._drop_shared()
            self.requested = None
            self.pending = self.under_way
            self.version += 1
            self._moved.notify_all()

    def cutting_for(self, seconds: float) -> None:
        """A re-layout's cut begins here (its hold): other cuts are refused until it is taken, or
        for ``seconds`` at most (the hold's own deadline)."""
        self._cutting_until = time.monotonic() + seconds

    def check_not_cutting(self, task_name: str) -> None:
        """Refuse a checkpoint's cut while a re-layout's is under way here: two cuts at once
        would let pushes past the re-layout's.

        Raises:
            CheckpointError: saying to save again once the re-layout is taken.
        """
        if self.snapshot is None and time.monotonic() < self._cutting_until:
            raise CheckpointError(
                f"{task_name} is taking a re-layout's cut (psframe reshard): save again once it is taken"
            )

    def took(self, cluster_spec: str, stage: pb.MoveStage | None = None) -> bool:
        """Whether this task took the cut of the re-layout to ``cluster_spec`` (at ``stage``) already."""
        return (
            self.moved_to is not None
            and self.snapshot is not None
            and self.moved_to.to_string() == cluster_spec
            and self.stage == _staged(stage)
        )

    @property
    def under_way(self) -> bool:
        """Whether the last move was a stage of a re-layout, not its last."""
        return self.stage is not None and self.stage.stage < self.stage.stages

    def took_parts(self, before: ClusterSpec, after: ClusterSpec, version: int) -> None:
        """A task new in ``after`` took its parts: it counts the re-layouts as the others do."""
        with self._lock:
            self.before, self.before_cluster, self.moved_to, self.version = before.fingerprint, before, after, version
            self._moved.notify_all()

    def wait_past(self, version: int, seconds: float) -> None:
        """Return once this task's layout version is past ``version``, or after ``seconds``."""
        with self._moved:
            self._moved.wait_for(lambda: self.version > version, timeout=seconds)

    def keep(self, snapshot: ShardData, row_versions: Mapping[str, torch.Tensor] | None = None) -> None:
        """Keep the cut's snapshot, to hand its parts over (``FetchParts``): the cut is taken.
        ``row_versions``: its fixed table parts' rows' versions at the cut (tensors no one
        changes any more), for the tasks that copied some ahead (:mod:`psframe.ps.elastic.precopy`)."""
        with self._lock:
            self.snapshot, self._row_versions = snapshot, dict(row_versions or {})
            self._cutting_until = 0.0

    def release(self, version: int) -> bool:
        """Every task of layout ``version`` holds its parts: the snapshot goes, if this task is at
        that layout still (the chief says so after training went on: a late word of a layout
        before leaves a later cut's snapshot alone).

        Returns:
            Whether it went.
        """
        with self._lock:
            if version != self.version:
                return False
            self.snapshot, self._row_versions = None, {}
            self._drop_shared()
            return True

    def hand_over(self, reply: Sequence[Any], same_host: bool) -> bytes:
        """A ``FetchParts`` reply (its chunks, :func:`psframe.ps.elastic.shard_codec.shard_chunks`) as
        it is sent: through a file of this host's shared memory where the asking task is on this
        host (``same_host``) and one can be made, the file kept until the stage's snapshot goes
        (the asking task removes it once read); otherwise as one message."""
        if same_host and same_host_memory.available():
            try:
                held = HeldMessage(reply)
            except OSError:  # no room in /dev/shm: through gRPC
                pass
            else:
                with self._lock:
                    self._shared.append(held)
                return codec.encode(pb.FetchPartsReplyHeader(shared=held.message), ())
        return b"".join(reply)

    def _drop_shared(self) -> None:
        for region in self._shared:
            region.unlink()
        self._shared = []

    def check_caller(self, caller: pb.Caller) -> None:
        """Refuse a worker of the cluster this task moved from.

        Raises:
            LayoutChangedError: naming the ps tasks of the new cluster.
        """
        moved_to = self.moved_to
        if moved_to is not None and (
            # a stage that kept the cluster (parts moved among its tasks) tells its workers by version only
            (caller.cluster_fingerprint == self.before and self.before != moved_to.fingerprint)
            or (caller.job_name == "worker" and caller.layout_version != self.version)
        ):
            raise self.refusal()

    def refusal(self) -> LayoutChangedError:
        """The error a push of the layout before gets."""
        moved_to = self.moved_to
        return LayoutChangedError(
            f"the ps tasks moved to {moved_to and moved_to.job_tasks('ps')} (a re-layout); ask "
            f"{ClusterSpec.task_name('ps', 0)} for the new cluster and send the step there"
        )

    def reply(self) -> pb.RelayoutStatusReply:
        """What ``RelayoutStatus`` (and ``AskRelayout``) answers."""
        with self._lock:
            wanted = self.requested or self.moved_to
            moved = self.requested is None and self.moved_to is not None
            return pb.RelayoutStatusReply(
                cluster_spec="" if wanted is None else wanted.to_string(),
                moved=moved,
                layout_version=self.version,
                before_spec=self.before_cluster.to_string() if moved and self.before_cluster is not None else "",
                stage=self.stage if moved else None,
            )

    def parts(self, variables: Sequence[str], rows: Sequence[pb.RowRange] = (), *, trim: bool = False) -> ShardData:
        """What the ``FetchParts`` reply holds: the snapshot's parts of ``variables``; of a
        variable ``rows`` names, only the parts of runs of rows that hold some of those wanted.
        With ``trim``, a part of a run of rows is cut to the rows wanted (the rest goes to
        other tasks: only what the asking task holds next crosses the wire).

        Raises:
            LayoutChangedError: the task took no re-layout's snapshot (it was not asked to move).
        """
        snapshot = self.snapshot
        if snapshot is None:
            raise LayoutChangedError("this ps task took no re-layout's snapshot: it has no parts to hand over")
        kept = select(snapshot.variables, variables, rows)
        if trim:
            ranges = _by_variable(rows)
            kept = [piece for v in kept for piece in _trimmed(v, ranges.get(v.variable, ()))]
        return dataclasses.replace(snapshot, variables=tuple(kept))

    def parts_since(self, header: pb.FetchPartsHeader) -> tuple[ShardData, dict[str, precopy.RowChanges]]:
        """What a ``FetchParts`` reply holds (:meth:`parts`, trimmed), the parts the asking task copied
        ahead (``header.precopied``) as their rows changed since its copy: where this snapshot is
        of the cut right after that copy (:mod:`psframe.ps.elastic.precopy`); otherwise whole.

        Raises:
            LayoutChangedError: as :meth:`parts`.
        """
        with self._lock:
            shard = self.parts(list(header.variables), header.rows, trim=True)
            versions, version = self._row_versions, self.version
        if not header.precopied or version != header.since_version + 1:
            return shard, {}
        return precopy.split_changed(shard, versions, header.precopied, header.since_mark)


def select(parts: Sequence[VariableData], variables: Sequence[str], rows: Sequence[pb.RowRange]) -> list[VariableData]:
    """The parts of ``variables``; of a variable ``rows`` names, only those that hold some of its rows wanted."""
    named, ranges = set(variables), _by_variable(rows)

    def wanted(part: VariableData) -> bool:
        if part.variable not in named:
            return False
        return part.variable not in ranges or any(_holds(part, r) for r in ranges[part.variable])

    return [v for v in parts if wanted(v)]


def _by_variable(rows: Sequence[pb.RowRange]) -> dict[str, list[pb.RowRange]]:
    ranges: dict[str, list[pb.RowRange]] = {}
    for r in rows:
        ranges.setdefault(r.variable, []).append(r)
    return ranges


def _staged(stage: pb.MoveStage | None) -> pb.MoveStage | None:
    """``stage`` if it names one (a request's field unset has none)."""
    return stage if stage is not None and stage.stages else None


def _holds(part: VariableData, wanted: pb.RowRange) -> bool:
    """Whether ``part`` holds rows of ``wanted`` (one asked for of a ``FetchParts`` request). A part
    of a variable cut otherwise than ``wanted`` says holds some, and is sent: the rows are cut anew."""
    if wanted.num_parts:  # a dynamic table's part
        return part.dynamic is None or part.num_parts != wanted.num_parts or part.part_index == wanted.part_index
    if wanted.stride > 1:  # every stride-th row: the part of the same first row
        return part.row_stride != wanted.stride or part.row_start == wanted.start
    if part.dynamic is not None or part.row_stride > 1 or not part.shape:
        return True  # ids, every n-th row, or a 0-d variable: cut otherwise
    first, last = part.row_start, part.row_start + part.shape[0]
    return first < wanted.end and wanted.start < last


def _trimmed(part: VariableData, wanted: Sequence[pb.RowRange]) -> list[VariableData]:
    """``part`` cut to the rows of ``wanted`` it holds, with their element-wise optimizer state
    (views, not copies); whole where it is no run of rows, or where ``wanted`` names no run."""
    runs = [r for r in wanted if r.stride <= 1 and not r.num_parts]
    if part.dynamic is not None or part.row_stride > 1 or not part.shape or not runs:
        return [part]
    first, end = part.row_start, part.row_start + part.shape[0]
    pieces = []
    for r in sorted(runs, key=lambda r: r.start):
        lo, hi = max(first, r.start), min(end, r.end)
        if lo >= hi:
            continue
        if (lo, hi) == (first, end):
            return [part]
        pieces.append(
            dataclasses.replace(
                part,
                value=part.value[lo - first : hi - first],
                state={
                    k: x[lo - first : hi - first] if is_row_state(x, part.value.shape) else x
                    for k, x in part.state.items()
                },
                shape=(hi - lo, *part.shape[1:]),
                row_start=lo,
            )
        )
    return pieces


def prepare(optimizers: Sequence[tuple[OptimizerSpec, Sequence[torch.dtype], bool]] = ()) -> None:
    """Make ready, once per process, what taking parts needs: the first ``torch.optim`` optimizer a
    process makes costs about a second (imports behind it), and each optimizer's choice of kernels
    for its dtypes a few milliseconds (:func:`psframe.optim.kernels.foreach_same_results`),
    which a task should pay before the cut, not while training waits for it. ``optimizers``: those
    it will build, each with the dtypes of its variables and whether per parameter (tables')."""
    global _prepared
    with _prepare_lock:
        if not _prepared:
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
            _prepared = True
    for spec, dtypes, per_parameter in optimizers:  # each choice is memoised: made once per process
        spec.build([torch.zeros(1, dtype=d, requires_grad=True) for d in dtypes], per_parameter=per_parameter)


_prepared = False
_prepare_lock = threading.Lock()

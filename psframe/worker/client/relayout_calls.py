"""The chief's and a tool's calls of a live re-layout (:mod:`psframe.ps.elastic.relayout`).

Functions over a :class:`~psframe.worker.client.ps_client.PsClient`'s
connections to the ps tasks, one RPC each: where ps 0 stands (:func:`layout_status`,
``RelayoutStatus``), asking for a new layout (:func:`ask_reshard`, ``AskRelayout``), the
cut that moves the tasks there (:func:`move`, ``HoldCut`` then ``MoveCut``), the new
layout's tasks taking their parts (:func:`copy_ahead` ahead of the cut, ``Precopy``;
:func:`take_parts` at it, ``TakeParts``) and the end (:func:`reshard_done`, ``RelayoutDone``).
The step path stays on the client; a re-layout only changes whom it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psframe.cluster import ClusterSpec
from psframe.cluster.moves import MoveStage
from psframe.optim import OptimizerSpec, SyncReplicas
from psframe.wire import messages, transport
from psframe.wire import psframe_pb2 as pb
from psframe.worker.client.ps_client import PsClient
from psframe.worker.plan.step_plan import Slot


def layout_status(client: PsClient, *, wait: float = 0.0, after_version: int = 0) -> LayoutStatus:
    """Where ps 0 stands with re-layouts: asked for, or taken (and at which stage). With ``wait``
    (seconds), ps 0 answers once its layout version is past ``after_version``, or after ``wait``."""
    request = pb.RelayoutStatusRequest(caller=client.caller, wait_seconds=wait, after_version=after_version)
    reply = client.connections[0].call("RelayoutStatus", request, timeout=client.rpc_timeout + wait)
    stage = None
    if reply.moved and reply.HasField("stage"):
        s = reply.stage
        stage = MoveStage(s.origin_spec, s.target_spec, s.stage, s.stages)
    return LayoutStatus(
        ClusterSpec.from_string(reply.cluster_spec) if reply.cluster_spec else None,
        reply.moved,
        stage,
        ClusterSpec.from_string(reply.before_spec) if reply.moved and reply.before_spec else None,
        reply.layout_version,
    )


def ask_reshard(client: PsClient, new: ClusterSpec) -> None:
    """Ask ps 0 for a re-layout to ``new`` (from a tool); the chief takes it between two steps.

    Raises:
        ClusterSpecError: ``new`` cannot be taken live (the reason says what to do instead).
    """
    request = pb.AskRelayoutRequest(caller=client.caller, cluster_spec=new.to_string())
    client.connections[0].call("AskRelayout", request, timeout=client.rpc_timeout)


def move(client: PsClient, new: ClusterSpec, stage: MoveStage | None = None) -> CutTaken:
    """The chief's first part of a re-layout (or of its ``stage``): every ps task takes one cut,
    snapshots its parts into memory and moves to ``new`` (workers of the layout before are
    refused from then on). Returns ps 0's reply: the layout version and the workers that had
    finished, which the tasks of the new layout are told.

    A cut lost to a worker that died in the middle of a step (CheckpointCutError) is taken
    again without the steps it waited for, as a checkpoint is: that step may be applied on
    some parts and not on others.
    """
    requests = []
    for _ in client.connections:
        request = pb.MoveCutRequest(caller=client.caller, cluster_spec=new.to_string())
        if stage is not None:
            request.stage.CopyFrom(
                pb.MoveStage(origin_spec=stage.origin, target_spec=stage.target, stage=stage.stage, stages=stage.stages)
            )
        requests.append(request)
    replies = client.take_cut(
        "MoveCut",
        requests,
        f"{client.name}: the re-layout's cut is taken without waiting for a lost worker's step",
        for_move=True,
    )
    first = replies[0]
    ledger = (tuple(first.ledger.last_push), tuple(first.ledger.applied_steps)) if first.HasField("ledger") else None
    return CutTaken(first.layout_version, tuple(first.finished_workers), ledger)


def take_parts(
    client: PsClient,
    slots: Sequence[Slot],
    optimizer: OptimizerSpec,
    table_optimizer: OptimizerSpec | None,
    sync: SyncReplicas | None,
    before: Sequence[str],
    layout_version: int,
    finished_workers: Sequence[int] = (),
    sources: Sequence[Sequence[int]] | None = None,
    ledger: tuple[Sequence[int], Sequence[int]] | None = None,
) -> bool:
    """The chief's second part of a re-layout: every ps task of this (new) cluster takes the
    parts placed on it from the snapshots of the tasks before (``before``), in parallel;
    ps task ``k`` from tasks ``sources[k]`` only (:func:`psframe.cluster.moves.sources`), or all.
    ``ledger``: ps 0's pushes applied at the cut (:class:`CutTaken`), which every task takes;
    None: each reads it from ps 0's snapshot (then ps 0 must be among ``sources[k]``).

    Returns:
        Whether every task now holds the model (then it holds these variables, and this
        client numbers its pushes from the replies: no :func:`~psframe.worker.client.control_calls.wait_for_ps` needed).
    """
    client.caller.layout_version = layout_version  # the tasks kept refuse a caller of the layout before
    calls = []
    for k, ps in enumerate(client.connections):
        request = pb.TakePartsRequest(
            caller=client.caller,
            variables=messages.variable_defs(s for s in slots if s.shard.ps_task == k),
            optimizer=messages.optimizer_to_proto(optimizer),
            sync=messages.sync_def(sync),
            before=before,
            read_from=() if sources is None else sources[k],
            layout_version=layout_version,
            finished_workers=finished_workers,
        )
        if table_optimizer is not None:
            request.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
        if ledger is not None:
            request.ledger.CopyFrom(pb.PushLedger(last_push=ledger[0], applied_steps=ledger[1]))
        calls.append((ps, "TakeParts", request))
    replies = transport.call_all(calls, client.rpc_timeout)
    if any(r.state != pb.TaskInfo.READY for r in replies):
        return False
    for k, reply in enumerate(replies):  # as wait_for_ps would: above the pushes each task applied
        client.push_numbers.start_after(k, reply.last_push_id)
    client.caller.layout_version = replies[0].layout_version
    return True


def copy_ahead(
    client: PsClient,
    slots: Sequence[Slot],
    optimizer: OptimizerSpec,
    table_optimizer: OptimizerSpec | None,
    before: Sequence[str],
    sources: Sequence[Sequence[int]] | None = None,
    parts: Sequence[str] = (),
) -> None:
    """Before a re-layout stage's cut, while training goes on: every ps task of this (the
    next) layout makes its optimizers ready and copies the fixed table parts it takes at the
    cut (``parts``, those of them it holds next) from the tasks before (``before``;
    ``sources``: as :func:`take_parts`), in parallel; at the cut only their rows changed since
    cross (:mod:`psframe.ps.elastic.precopy`)."""
    copied = set(parts)
    calls = []
    for k, ps in enumerate(client.connections):
        held = [s for s in slots if s.shard.ps_task == k]
        precopy = pb.PrecopyRequest(
            caller=client.caller,
            variables=messages.variable_defs(held),
            parts=[s.name for s in held if s.name in copied],
            before=before,
            read_from=() if sources is None else sources[k],
            optimizer=messages.optimizer_to_proto(optimizer),
            cluster_spec=client.cluster.to_string(),
        )
        if table_optimizer is not None:
            precopy.table_optimizer.CopyFrom(messages.optimizer_to_proto(table_optimizer))
        calls.append((ps, "Precopy", precopy))
    transport.call_all(calls, client.rpc_timeout)


def reshard_done(client: PsClient) -> None:
    """Tell the ps tasks the new layout holds the model: their snapshots may go."""
    request = pb.RelayoutDoneRequest(caller=client.caller)
    transport.call_all([(ps, "RelayoutDone", request) for ps in client.connections], client.rpc_timeout)


@dataclass(frozen=True)
class CutTaken:
    """What ps 0 answers a re-layout's cut: what the tasks of the new layout are told with their parts."""

    layout_version: int  # the re-layouts gone through, this one counted
    finished_workers: tuple[int, ...]  # the workers that had finished before
    # ps 0's pushes applied at the cut, by worker: each one's last push and steps applied (None: unsaid)
    ledger: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class LayoutStatus:
    """What ps 0 says of re-layouts: the one asked for, or the layout taken, and its stage."""

    cluster: ClusterSpec | None  # asked for (not yet taken), or the cluster of the layout taken; None: none
    moved: bool  # a layout was taken (``cluster`` is where the ps tasks are)
    stage: MoveStage | None = None  # taken: the stage of the re-layout it is at; None: a layout of one stage
    before: ClusterSpec | None = None  # taken: the cluster of the layout it moved from (the last stage's)
    version: int = 0  # ps 0's layout version: the re-layouts it went through

    @property
    def moving(self) -> bool:
        """Whether a staged re-layout is under way: taken, its last stage not yet."""
        return self.moved and self.stage is not None and not self.stage.done

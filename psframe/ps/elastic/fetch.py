"""A re-layout's reads from the ps tasks of the layout before: parts at the cut, and copies ahead of it.

A task of the layout after a stage reads the parts it now holds from the
snapshots of the tasks before (:func:`fetch_shards`, the ``FetchParts`` RPC,
over :class:`~psframe.ps.elastic.peers.PsPeers`), its own snapshot in place;
while training still goes on, it copies the fixed table parts that move
alone (:func:`copy_ahead`, the ``CopyPartsLive`` RPC, :mod:`psframe.ps.elastic.precopy`), so that at the
cut only their rows changed since cross. The replies' format is
:mod:`psframe.ps.elastic.shard_codec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from psframe.checkpoint.shard import ShardData, VariableData
from psframe.cluster import ClusterSpec, parse_address
from psframe.errors import SharedRegionError, WireFormatError
from psframe.ps.elastic import precopy
from psframe.ps.elastic.peers import PsPeers
from psframe.ps.elastic.relayout import Relayout
from psframe.ps.elastic.shard_codec import Fetched, decode_shard, received
from psframe.wire import codec, transport
from psframe.wire import psframe_pb2 as pb
from psframe.wire import same_host as same_host_memory


def wanted_rows(defs: Sequence[pb.VariableDef]) -> list[pb.RowRange]:
    """The rows ``defs`` hold, for a task before to send only the parts that hold some: a run of
    rows, every n-th row, or a dynamic table's part. A 0-d variable's part is always sent."""
    wanted = []
    for d in defs:
        if d.HasField("dynamic"):
            wanted.append(pb.RowRange(variable=d.variable, num_parts=d.num_parts, part_index=d.part_index))
        elif d.row_stride > 1:
            end = d.row_start + d.row_stride * max(0, d.shape[0] - 1) + 1
            wanted.append(pb.RowRange(variable=d.variable, start=d.row_start, end=end, stride=d.row_stride))
        elif len(d.shape):
            wanted.append(pb.RowRange(variable=d.variable, start=d.row_start, end=d.row_start + d.shape[0]))
    return wanted


def fetch_shards(
    peers: PsPeers,
    defs: Sequence[pb.VariableDef],
    caller: pb.Caller,
    timeout: float,
    own: tuple[int, Relayout] | None = None,
    tasks: Sequence[int] = (),
    copies: Mapping[int, precopy.Copy] | None = None,
    host: str = "",
) -> Taken:
    """From each ps task of the layout before (``peers``: the connections to its tasks, kept
    from one stage to the next), its snapshot's parts that hold rows of ``defs``: the shards a
    re-layout restores from, in task order. Only ``tasks`` are asked (those that hold rows of
    ``defs``, and ps 0 first among them), or every task; in parallel. ``own`` (this task's
    index before, and its :class:`Relayout`) is read in place. ``copies``: the parts this task
    copied ahead from some of them (:mod:`psframe.ps.elastic.precopy`), by task: those send only the
    rows changed since. ``host``: this task's host; a task of the same host is asked to answer
    through shared memory (:meth:`Relayout.hand_over`).

    Returns:
        The shards, and how many parts of them were copied ahead and how many rows changed since.

    Raises:
        PsframeError: a task could not be reached in ``timeout`` seconds, or refused.
        WireFormatError: a task sent changed rows of a part not copied from it.
    """
    copies = copies or {}
    variables, rows = sorted({d.variable for d in defs}), wanted_rows(defs)
    read = sorted(set(tasks)) if tasks else list(range(peers.cluster.num_ps))
    asked = [k for k in read if own is None or k != own[0]]

    def request(k: int, shared: bool) -> bytes:
        header = pb.FetchPartsHeader(caller=caller, variables=variables, rows=rows)
        copy = copies.get(k)
        if copy is not None:
            header.precopied.extend(sorted(copy.parts))
            header.since_mark, header.since_version = copy.mark, copy.version
        header.same_host = shared and same_host_memory.available() and ps_host(peers.cluster, k) == host
        return codec.encode(header, ())

    calls = [(peers.connection(k), "FetchParts", request(k, bool(host))) for k in asked]
    replies = transport.call_all(calls, timeout, wait_for_ready=True) if calls else []
    # A part that is one of ``defs`` whole is kept as it comes (a copy of its own); a piece of one
    # (rows cut anew) is copied once, into the part made of it, from a view of the reply.
    whole = {(d.variable, d.row_start, tuple(d.shape)) for d in defs}

    shards, copied, changed = {}, 0, 0
    for k, reply in zip(asked, replies):
        try:
            fetched = received(reply, whole)
        except SharedRegionError:  # not this host's after all: through gRPC
            reply = peers.connection(k).call("FetchParts", request(k, False), timeout=timeout, wait_for_ready=True)
            fetched = received(reply, whole)
        try:
            shards[k] = precopy.completed(fetched.shard, fetched.rows, copies.get(k))
        except ValueError as e:
            raise WireFormatError(f"ps task {k} before the re-layout {e}") from e
        copied += len(fetched.rows)
        changed += sum(r.index.numel() for r in fetched.rows.values())
    if own is not None and own[0] in read:
        shards[own[0]] = own[1].parts(variables, rows)
    return Taken([shards[k] for k in read], copied, changed)


def ps_host(cluster: ClusterSpec, task: int) -> str:
    """The host part of ps task ``task``'s address in ``cluster``."""
    return parse_address(cluster.task_address("ps", task), any_port=True)[0]


@dataclasses.dataclass(frozen=True)
class Taken:
    """What :func:`fetch_shards` read: the shards, in task order, and of their parts how many
    were copied ahead (completed with the rows changed since: ``changed_rows`` in all)."""

    shards: list[ShardData]
    copied_parts: int
    changed_rows: int


def copy_ahead(
    peers: PsPeers,
    defs: Sequence[pb.VariableDef],
    caller: pb.Caller,
    timeout: float,
    tasks: Sequence[int] = (),
    skip: int | None = None,
) -> dict[int, precopy.Copy]:
    """Copies of the fixed table parts of ``defs`` from the tasks of the layout before that hold
    them (``tasks``, or all; not ``skip``, this task's own index there), read live while training
    goes on (:mod:`psframe.ps.elastic.precopy`): by task, those parts it sent whole as ``defs`` name them.

    One part a call, each copied under its holder's store lock on its own: training waits at
    most one part's copy there. A task's copy is of the earliest mark its parts were read at
    (rows written since any of them cross at the cut), and of one layout version only. The
    connections to those tasks are made here too, for the cut's reads.
    """
    wanted = [d for d in defs if precopy.copied_ahead(d)]
    read = [k for k in (sorted(set(tasks)) if tasks else range(peers.cluster.num_ps)) if k != skip]
    # The connections the cut's reads go through are made now, not in the pause.
    transport.call_all([(peers.connection(k), "GetInfo", pb.InfoRequest()) for k in read], timeout, wait_for_ready=True)
    got: dict[int, list[Fetched]] = {k: [] for k in read}
    for d in wanted:  # part after part; the tasks before in parallel (the one that holds it sends it)
        header = pb.CopyPartsLiveHeader(caller=caller, variables=[d.variable], rows=wanted_rows([d]))
        request = codec.encode(header, ())
        calls = [(peers.connection(k), "CopyPartsLive", request) for k in read]
        replies = transport.call_all(calls, timeout, wait_for_ready=True)
        for k, reply in zip(read, replies):
            fetched = decode_shard(reply)
            if any(_same_part(p, d) for p in fetched.shard.variables):
                got[k].append(fetched)
    names = {d.name: d for d in wanted}
    copies = {}
    for k, replies in got.items():
        if replies and len({f.layout_version for f in replies}) == 1:  # no cut between two of them
            parts = {
                p.name: p
                for f in replies
                for p in f.shard.variables
                if p.name in names and _same_part(p, names[p.name])
            }
            copies[k] = precopy.Copy(min(f.mark for f in replies), replies[0].layout_version, parts)
    return copies


def _same_part(part: VariableData, definition: pb.VariableDef) -> bool:
    """Whether a part sent whole is the part ``definition`` places (its rows alike)."""
    return (part.name, tuple(part.shape), part.row_start) == (
        definition.name,
        tuple(definition.shape),
        definition.row_start,
    )

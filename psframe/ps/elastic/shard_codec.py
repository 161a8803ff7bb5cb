"""The replies' format of ``FetchParts`` and ``CopyPartsLive``: a re-layout's parts, and rows changed, on the wire.

A task of the layout after a re-layout stage reads its parts from the tasks of
the layout before (:mod:`psframe.ps.elastic.fetch`); each answers with the
parts of its snapshot (:meth:`psframe.ps.elastic.relayout.Relayout.parts`) and,
of the fixed table parts the asking task copied ahead, the rows changed since
(:mod:`psframe.ps.elastic.precopy`):

- :func:`encode_shard` / :func:`shard_chunks` make the reply: a codec envelope
  whose JSON record holds builtins only (no pickle crosses the wire), each
  tensor in it travelling as raw bytes;
- :func:`decode_shard` reads it back into a :class:`Fetched`, the shard checked
  as a checkpoint's is; :func:`received` does so for a reply as it came, or
  handed over through a file of this host's shared memory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

import torch

from psframe.checkpoint.shard import ShardData
from psframe.errors import WireFormatError
from psframe.optim.row_state import is_row_state
from psframe.ps.elastic import precopy
from psframe.wire import codec, encoding
from psframe.wire import psframe_pb2 as pb
from psframe.wire import same_host as same_host_memory
from psframe.wire.same_host import SameHostRegion

_TENSOR_KEY = "__tensor__"


def encode_shard(
    shard: ShardData, rows: Mapping[str, precopy.RowChanges] | None = None, *, mark: int = 0, layout_version: int = 0
) -> bytes:
    """A ``FetchParts`` reply: the shard record, and the changed rows of parts copied ahead
    (:mod:`psframe.ps.elastic.precopy`), as a codec envelope: a dict as JSON, each tensor in it
    travelling as raw bytes. ``mark``, ``layout_version``: a live copy's.

    No pickle crosses the wire: the JSON holds builtins only.
    """
    return b"".join(shard_chunks(shard, rows, mark=mark, layout_version=layout_version))


def shard_chunks(
    shard: ShardData, rows: Mapping[str, precopy.RowChanges] | None = None, *, mark: int = 0, layout_version: int = 0
) -> list[Any]:
    """:func:`encode_shard`'s message as chunks (:func:`psframe.wire.codec.encode_chunks`): the
    tensors' own bytes, a view of the snapshot's rows included, not copies."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def plain(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append((str(len(tensors)), x.detach().cpu().contiguous()))
            return {_TENSOR_KEY: len(tensors) - 1}
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    changed = {name: {"index": r.index, "value": r.value, "state": dict(r.state)} for name, r in (rows or {}).items()}
    record = json.dumps(plain({"shard": shard.to_dict(compact=False), "rows": changed}))
    header = pb.FetchPartsReplyHeader(record=record, mark=mark, layout_version=layout_version)
    return codec.encode_chunks(header, tensors)


@dataclasses.dataclass(frozen=True)
class Fetched:
    """A ``FetchParts`` reply, decoded: parts whole, the changed rows of parts copied ahead, and
    (of a live read) the mark and layout version of the copy."""

    shard: ShardData
    rows: dict[str, precopy.RowChanges]
    mark: int
    layout_version: int


def decode_shard(data: bytes | memoryview, whole: Collection[tuple[str, int, tuple]] | None = None) -> Fetched:
    """The reply :func:`encode_shard` made, its shard checked as a checkpoint's is.

    Every tensor is a copy of its own (the reply's buffer goes). With ``whole`` (the parts the
    asking task makes, as ``(variable, row_start, shape)``), a run of rows that is none of them
    is only a piece of one (rows cut anew, copied once more into the part made of them): its
    rows are views of ``data``, which they keep alive.

    Raises:
        WireFormatError: the message is not such a reply.
        CheckpointError: the record fails a check of :meth:`ShardData.from_dict`.
    """
    header, tensors = codec.decode(data, pb.FetchPartsReplyHeader)
    try:
        record = json.loads(header.record)
    except ValueError as e:
        raise WireFormatError(f"a FetchParts reply's record is not JSON: {e}") from e

    def rebuilt(x: Any, copy: bool = True) -> Any:
        if isinstance(x, dict):
            if set(x) == {_TENSOR_KEY}:
                index = x[_TENSOR_KEY]
                if not isinstance(index, int) or not 0 <= index < len(tensors):
                    raise WireFormatError(f"a FetchParts reply names tensor {index!r} of {len(tensors)}")
                return tensors[index].clone() if copy else tensors[index]
            return {k: rebuilt(v, copy) for k, v in x.items()}
        if isinstance(x, list):
            return [rebuilt(v, copy) for v in x]
        return x

    def piece(part: Any) -> bool:  # a run of rows that is only a piece of a part to be made
        if whole is None or not isinstance(part, dict) or part.get("dynamic") is not None:
            return False
        start, shape, stride = part.get("row_start"), part.get("shape"), part.get("row_stride", 0)
        if not isinstance(start, int) or not isinstance(shape, list) or not shape or stride not in (0, 1):
            return False
        return (part.get("variable"), start, tuple(shape)) not in whole

    if not isinstance(record, dict) or set(record) != {"shard", "rows"} or not isinstance(record["rows"], dict):
        raise WireFormatError("a FetchParts reply's record holds no {'shard', 'rows'}")
    shard = record["shard"]
    if isinstance(shard, dict) and isinstance(shard.get("variables"), list):  # each part copied or not
        parts = shard["variables"]
        plain = rebuilt({"shard": {k: v for k, v in shard.items() if k != "variables"}, "rows": record["rows"]})
        plain["shard"]["variables"] = [
            _own_scalars(rebuilt(part, False)) if piece(part) else rebuilt(part) for part in parts
        ]
    else:
        plain = rebuilt(record)
    rows = {}
    for name, r in plain["rows"].items():
        complete = isinstance(r, dict) and {"index", "value", "state"} <= set(r)
        changes = precopy.RowChanges(r["index"], r["value"], r["state"]) if complete else None
        if changes is None or not changes.well_formed():
            raise WireFormatError(f"a FetchParts reply's changed rows of {name!r} need 1-d int64 indices, a row each")
        rows[name] = changes
    return Fetched(ShardData.from_dict(plain["shard"]), rows, header.mark, header.layout_version)


def _own_scalars(part: dict) -> dict:
    """A piece's record (its tensors views of the reply) with the tensors other than its rows
    (an optimizer's step count, say) copied: those are taken as they are, not cut."""
    value, state = part.get("value"), part.get("state")
    if isinstance(value, torch.Tensor) and isinstance(state, dict):
        part["state"] = {
            k: x.clone() if isinstance(x, torch.Tensor) and not is_row_state(x, value.shape) else x
            for k, x in state.items()
        }
    return part


def received(reply: bytes, whole: Collection[tuple[str, int, tuple]] | None = None) -> Fetched:
    """A ``FetchParts`` reply, decoded: as it came, or read from the shared-memory file it names
    (which is removed then: its mapping stays while the pieces decoded as views hold it).
    ``whole``: as :func:`decode_shard`.

    Raises:
        SharedRegionError: it names a file this process cannot map as such (another host's).
        WireFormatError, CheckpointError: as :func:`decode_shard`.
    """
    header = encoding.parse(reply, pb.FetchPartsReplyHeader).header
    if not header.HasField("shared"):
        return decode_shard(reply, whole)
    region = SameHostRegion.attach(header.shared)
    try:
        return decode_shard(region.request_bytes(), whole)
    finally:
        same_host_memory.remove(header.shared.path)

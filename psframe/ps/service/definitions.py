"""The chief's variable definitions, read from their wire form into what the store takes.

The store (:mod:`psframe.ps.store`) never sees the wire: the service reads
the definitions of an Init request, or of a checkpoint, with these.
"""

from __future__ import annotations

from collections.abc import Sequence

from psframe.ps.store.table_parts import DynamicPart
from psframe.wire import dtypes, messages
from psframe.wire import psframe_pb2 as pb


def dynamic_parts(defs: Sequence[pb.VariableDef]) -> dict[str, DynamicPart]:
    """The dynamic table parts among variable definitions, by name."""
    return {
        d.name: DynamicPart(messages.dynamic_spec(d.dynamic), tuple(d.shape[1:]), dtypes.dtype_from_name(d.dtype))
        for d in defs
        if d.HasField("dynamic")
    }

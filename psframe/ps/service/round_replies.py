"""The replies of a synchronous round's members, who all read the variables the round left.

Every member of a round is released at once, to read the same variables at
the same version. A member on another host gets a message: the first to
answer encodes it and the others send the same bytes (the step goes on when
the last worker has its reply, so this takes one encode, and a wait for the
store's lock, out of every step's critical path). A member on the ps task's
host that gave its request a shared region (:mod:`psframe.wire.same_host`)
gets the values written into that region and a header alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from psframe.ps.store import VariableStore
from psframe.wire import codec
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding
from psframe.wire.same_host import SameHostRegion


class RoundReplies:
    """The replies to pushes the sync barrier released, for the version they read."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        # Encoded replies of the current version only: those of the last round.
        self._released: tuple[tuple, dict[tuple, bytes]] = ((), {})
        self._in_regions = RegionReplies()

    def reply(
        self,
        pull: list[str],
        wire_dtype: torch.dtype | None,
        dropped: bool,
        region: SameHostRegion | None = None,
        refused: str = "",
        *,
        pending: bool = False,
    ) -> bytes:
        """A released member's reply (the caller holds the store's lock): in ``region`` where
        the member gave one, else a message, saying why its region was ``refused`` if it was,
        and whether a re-layout is ``pending`` (``PushPullReplyHeader.relayout_pending``)."""
        store = self.store
        if region is not None and wire_dtype is None:
            data = self._in_regions.reply(
                region,
                pull,
                store.read(pull),
                store.generation,
                pb.PushPullReplyHeader(global_step=store.global_step, dropped=dropped, relayout_pending=pending),
            )
            if data is not None:
                return data
        version = (store.version, store.global_step)
        kept_version, replies = self._released
        if kept_version != version:
            replies = {}
            self._released = (version, replies)
        key = (tuple(pull), wire_dtype, dropped, refused, pending)
        data = replies.get(key)
        if data is None:
            reply = pb.PushPullReplyHeader(
                global_step=store.global_step, dropped=dropped, region_refused=refused, relayout_pending=pending
            )
            data = replies[key] = codec.encode(reply, outgoing(pull, store.read(pull), wire_dtype))
        return data


class RegionReplies:
    """Replies to synchronous requests from this host, their values written into each worker's
    shared region instead of the message.

    The layout of a reply and the views of the variables it pulls are made
    once per set of names and generation of the store's variables, as a
    :class:`CachedRequest` makes them for asynchronous requests.
    """

    def __init__(self) -> None:
        self._laid_out: dict[tuple[int, tuple[str, ...]], tuple[MessageEncoding, list]] = {}

    def reply(
        self,
        region: SameHostRegion,
        pull: Sequence[str],
        values: Sequence[torch.Tensor],
        generation: int,
        header: pb.PushPullReplyHeader,
    ) -> bytes | None:
        """The reply (``header`` alone) once ``values`` (the live variables named ``pull``) are
        written into ``region``; None if they do not fit it. The caller holds the store's lock."""
        key = (generation, tuple(pull))
        laid_out = self._laid_out.get(key)
        if laid_out is None:
            layout = MessageEncoding(
                pb.PushPullReplyHeader, [(name, value.dtype, tuple(value.shape)) for name, value in zip(pull, values)]
            )
            # Only the current generation's layouts are kept: older variables are gone.
            self._laid_out = {k: v for k, v in self._laid_out.items() if k[0] == generation}
            laid_out = self._laid_out[key] = (layout, layout.buffers(values))
        layout, buffers = laid_out
        if not region.fits_reply(layout):
            return None
        region.write_reply(layout, buffers)
        header.in_region = True
        return layout.encode_header(header)


def outgoing(
    names: Sequence[str], values: Sequence[torch.Tensor], wire_dtype: torch.dtype | None
) -> list[tuple[str, torch.Tensor]]:
    """The pulled variables as they travel: compressed when the worker asked."""
    return [(name, codec.to_wire(value, wire_dtype)) for name, value in zip(names, values)]

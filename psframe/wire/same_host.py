"""Tensor bytes through shared memory, for a worker and a ps task on one host.

Through gRPC, every byte of a request is copied about five times on its way
from a worker's gradients to the ps task's optimizer (into the message, into
gRPC's buffers, through the socket twice, into a Python object on the other
side, twice), and the reply as many times back. On one host -- ``psframe
launch``, a GPU box with CPU ps tasks beside its workers -- the worker can
instead write its gradients into a file in ``/dev/shm`` that both processes
map, and the ps task write its reply there; gRPC then carries the headers
only. One copy each way.

A worker makes one :class:`SameHostRegion` per kind of planned request (the
same tensors every step), once it has seen the request's and the reply's
layouts, and *offers* it: the next request names the region but still carries
its tensors. A ps task that can map the file, finds it begins with the
request's random key (so the worker made it, on this host) writes its
replies to requests of that kind into the region; from then on the worker's
requests of that kind leave their tensors there. A ps task that cannot map it
(another host) says so, and the worker stops offering one to that task. In
synchronous training the barrier keeps a member's gradients as views of its
region until the round is applied, and writes each member's reply into its
own region; the worker writes there again only after its step's last reply,
or after a failed step, which gives it new regions.

The tensors lie in the region as in a message's payload (:mod:`psframe.wire.codec`):
a region's parts start where each tensor is aligned, so either side reads them
through :class:`~psframe.wire.encoding.Envelope` like a received message.
"""

from __future__ import annotations

import errno
import hmac
import mmap
import os
import secrets
import stat
import weakref
from collections.abc import Sequence
from typing import Any

import numpy

from psframe.errors import SharedRegionError
from psframe.wire import encoding
from psframe.wire import psframe_pb2 as pb
from psframe.wire.encoding import MessageEncoding

DIRECTORY = "/dev/shm"  # a tmpfs on Linux: files there are memory
PREFIX = "psframe-"
KEY_BYTES = 16
_LINE = 64  # each part starts on a cache line


def available() -> bool:
    """Whether this host has a shared-memory folder this process may make files in."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK | os.X_OK)


class SameHostRegion:
    """One mapped region file: a request's tensors, then its reply's.

    Made by a worker with :meth:`create` (which owns the file) or mapped by a
    ps task with :meth:`attach`. The mapping lives as long as anything refers
    to it: tensors read from it keep it mapped.
    """

    def __init__(self, mapping: mmap.mmap, message: pb.SameHostRegion, owner: bool) -> None:
        self.message = message
        self._mapping = mapping
        self._view = memoryview(mapping)
        # The worker's file goes when it is unlinked, dropped, or at exit at the latest.
        self._remove = weakref.finalize(self, remove, message.path) if owner else None
        self._targets: dict[tuple[int, int], list[numpy.ndarray]] = {}

    @classmethod
    def create(cls, request: MessageEncoding, reply: MessageEncoding) -> SameHostRegion:
        """A new region for requests of layout ``request`` answered in layout ``reply`` (worker side).

        Raises:
            OSError: the file could not be made or mapped (no ``/dev/shm``, out of space).
        """
        request_start = _aligned(KEY_BYTES, request.lead)
        reply_start = _aligned(request_start + request.payload_length, reply.lead)
        return cls._made(request_start, request.payload_length, reply_start, reply_start + reply.payload_length)

    @classmethod
    def _made(cls, request_start: int, request_length: int, reply_start: int, size: int) -> SameHostRegion:
        """A new region file of ``size`` bytes, its key first, mapped (this process owns it)."""
        path = os.path.join(DIRECTORY, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        key = secrets.token_bytes(KEY_BYTES)
        mapping[:KEY_BYTES] = key
        message = pb.SameHostRegion(
            path=path,
            key=key,
            size=size,
            request_start=request_start,
            request_length=request_length,
            reply_start=reply_start,
        )
        return cls(mapping, message, owner=True)

    @classmethod
    def attach(cls, message: pb.SameHostRegion) -> SameHostRegion:
        """Map the region a request names (ps side), after checking that it is what it says.

        Raises:
            SharedRegionError: not a psframe region file of this host and user,
                not of the size named, or not beginning with the key named.
        """
        path = message.path
        if os.path.dirname(path) != DIRECTORY or not os.path.basename(path).startswith(PREFIX):
            raise SharedRegionError(f"a shared region must be a {DIRECTORY}/{PREFIX}* file; got {path!r}")
        if len(message.key) != KEY_BYTES:
            raise SharedRegionError(f"a shared region's key has {KEY_BYTES} bytes; got {len(message.key)}")
        if not (
            KEY_BYTES
            <= message.request_start
            <= message.request_start + message.request_length
            <= message.reply_start
            <= message.size
        ):
            raise SharedRegionError(f"shared region {path}: its parts do not fit its {message.size} bytes")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise SharedRegionError(
                f"shared region {path!r} cannot be opened here: {getattr(e, 'strerror', None) or e}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise SharedRegionError(f"shared region {path} is not a regular file of this user")
            if info.st_size != message.size:
                raise SharedRegionError(f"shared region {path} has {info.st_size} bytes, not {message.size}")
            mapping = mmap.mmap(fd, message.size)
        except (OSError, ValueError, OverflowError) as e:  # fstat or mmap: no mapping, no region
            raise SharedRegionError(f"shared region {path} cannot be mapped here: {e}") from None
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapping[:KEY_BYTES], message.key):
            mapping.close()
            raise SharedRegionError(f"shared region {path} does not begin with the key named")
        attached = pb.SameHostRegion()
        attached.CopyFrom(message)
        attached.in_region = False
        return cls(mapping, attached, owner=False)

    def matches(self, message: pb.SameHostRegion) -> bool:
        """Whether ``message`` names this region, as it was mapped."""
        mine = self.message
        return (
            message.path == mine.path
            and message.key == mine.key
            and message.size == mine.size
            and message.request_start == mine.request_start
            and message.request_length == mine.request_length
            and message.reply_start == mine.reply_start
        )

    # ---- the two parts

    def request_envelope(self, header: Any) -> encoding.Envelope:
        """The request's tensors as a received envelope: ``header`` places them in the request part."""
        return encoding.Envelope(header, self._view, self.message.request_start, self.message.request_length)

    def reply_envelope(self, header: Any) -> encoding.Envelope:
        """The reply's tensors as a received envelope: ``header`` places them in the reply part."""
        start = self.message.reply_start
        return encoding.Envelope(header, self._view, start, self.message.size - start)

    def request_bytes(self) -> memoryview:
        """The request part's bytes, in place (a message of a :class:`HeldMessage`)."""
        start = self.message.request_start
        return self._view[start : start + self.message.request_length]

    def fits_reply(self, layout: MessageEncoding) -> bool:
        """Whether a reply of ``layout`` fits the reply part."""
        return self.message.reply_start + layout.payload_length <= self.message.size

    def write_request(self, layout: MessageEncoding, buffers: list[Any]) -> None:
        """Copy a request's tensors (``layout.buffers``) into the request part."""
        layout.write(self._targets_of(layout, self.message.request_start), buffers)

    def write_reply(self, layout: MessageEncoding, buffers: list[Any]) -> None:
        """Copy a reply's tensors (``layout.buffers``) into the reply part (it must :meth:`fits_reply`)."""
        layout.write(self._targets_of(layout, self.message.reply_start), buffers)

    def _targets_of(self, layout: MessageEncoding, start: int) -> list[numpy.ndarray]:
        key = (id(layout), start)
        targets = self._targets.get(key)
        if targets is None:
            targets = self._targets[key] = layout.targets(self._mapping, start)
        return targets

    def unlink(self) -> None:
        """Remove the file (worker side): the mappings stay, and the memory goes with the last one."""
        if self._remove is not None:
            self._remove()


class HeldMessage:
    """A message written into a new file of ``/dev/shm`` for another process of this host to
    read once: it maps the file as a :class:`SameHostRegion` (:meth:`SameHostRegion.attach`,
    the message in its request part, :meth:`SameHostRegion.request_bytes`) and removes it
    (:func:`remove`). The file goes with :meth:`unlink`, this object, or at exit at the latest.

    The message is written with ``writev``, not through a mapping: a write into tmpfs allocates
    its pages in the kernel (a mapping would fault on each), and a full ``/dev/shm`` fails the
    write with ``OSError`` where a mapping would fault (``SIGBUS``).
    """

    def __init__(self, chunks: Sequence[Any]) -> None:
        """Write ``chunks`` (objects with the buffer protocol: a message in order,
        :func:`psframe.wire.codec.encode_chunks`) into a new file.

        Raises:
            OSError: the file could not be made or written (no ``/dev/shm``, out of space).
        """
        views = [memoryview(c).cast("B") for c in chunks]
        length = sum(v.nbytes for v in views)
        path = os.path.join(DIRECTORY, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        key = secrets.token_bytes(KEY_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, [memoryview(key), memoryview(bytes(_LINE - KEY_BYTES)), *views])
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.message = pb.SameHostRegion(
            path=path,
            key=key,
            size=_LINE + length,
            request_start=_LINE,
            request_length=length,
            reply_start=_LINE + length,
        )
        self._remove = weakref.finalize(self, remove, path)

    def unlink(self) -> None:
        """Remove the file (a reader that mapped it keeps its mapping)."""
        self._remove()


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` one after the other at ``fd``: ``writev`` takes at most ``IOV_MAX``
    buffers a call, and may write fewer bytes than asked (then the rest is written after)."""
    at = 0
    while at < len(views):
        batch = views[at : at + _IOV_MAX]
        written = os.writev(fd, batch)
        if not written:  # a regular file takes some bytes or fails: never loop without end
            raise OSError(errno.ENOSPC, "writev wrote nothing")
        for v in batch:
            if written < v.nbytes:
                views[at] = v[written:]
                break
            written -= v.nbytes
            at += 1


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def remove(path: str) -> None:
    """Remove a region's file (one already gone is left so): its mappings stay until dropped."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _aligned(at_least: int, lead: int) -> int:
    """The first offset from ``at_least`` where a payload of lead ``lead`` puts its tensors on a cache line."""
    return -(-(at_least + lead) // _LINE) * _LINE - lead

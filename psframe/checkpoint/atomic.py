"""Durable, atomic writes through fsspec, hashed as they are written.

A checkpoint's files are written whole or not at all: a temporary file is
filled, made durable, then moved into place.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from collections.abc import Callable
from typing import Any


class HashingWriter:
    """A write-only file object that hashes and counts what passes through."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._sha.update(view)
        self._f.write(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def atomic_write(fs: Any, final: str, write: Callable[[Any], Any]) -> HashingWriter:
    """Write ``final`` whole or not at all: ``write`` fills a temporary file,
    which is made durable, then moved into place.

    Returns:
        The hash and size of what was written.
    """
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            writer = HashingWriter(f)
            write(writer)
            fsync(f)
        # A local rename is atomic; on object stores mv is a copy then a
        # delete, and that single write of the final object is what counts.
        fs.mv(tmp, final)
    except BaseException:
        remove_quietly(fs, tmp)
        raise
    return writer


def norm(url: str) -> str:
    stripped = url.rstrip("/")
    return url if not stripped or stripped.endswith(":") else stripped


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def fsync(f: Any) -> None:
    # On a local disk the bytes must be durable before the rename publishes
    # them; other stores have no fileno and make the object durable on close.
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass


def remove_quietly(fs: Any, path: str) -> None:
    try:
        fs.rm(path)
    except Exception:  # noqa: BLE001 - best effort: the save already failed for a better reason
        pass

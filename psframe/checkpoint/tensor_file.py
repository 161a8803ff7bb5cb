"""Whole files of named tensors in safetensors format, through fsspec, written atomically and checksummed.

The files of :mod:`psframe.export`. A file is written whole or not at all
(a temporary name, then moved into place, as checkpoints are:
:func:`psframe.checkpoint.atomic.atomic_write`). Its header's metadata
names its ``format`` and ``format_version`` and holds ``sha256``, the
SHA-256 of the bytes after the header, so that a reader tells a file of
another kind, another version, or damaged, from the one it expects before it
takes a tensor from it.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Collection
from typing import Any

import fsspec
import safetensors
import safetensors.torch
import torch

from psframe.checkpoint.atomic import atomic_write
from psframe.errors import SnapshotError

HEADER_LIMIT = 100 << 20  # safetensors' own cap on a header's size


def write_tensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``path`` (a file or fsspec URL), whole or not at all, its folder made if need be.

    Args:
        path: where.
        tensors: by name; any device, layout or view (they are packed first).
        metadata: the header's strings (``format``, ``format_version``, ...);
            ``sha256`` is added.

    Raises:
        SnapshotError: a tensor safetensors cannot hold (sparse, or of a
            dtype it has no code for); nothing is written.
    """
    try:
        blob = safetensors.torch.save(_packed(tensors), metadata)
    except KeyError as e:  # safetensors names a dtype it has no code for by the dtype alone
        raise SnapshotError(f"cannot write {path}: safetensors cannot hold tensors of {e.args[0]}") from e
    except (ValueError, RuntimeError) as e:
        raise SnapshotError(f"cannot write {path}: {e}") from e
    header, data = _header_and_data(blob)
    header["__metadata__"]["sha256"] = hashlib.sha256(data).hexdigest()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors writes it
    fs, final = fsspec.core.url_to_fs(path)
    folder = posixpath.dirname(final)
    if folder:
        fs.makedirs(folder, exist_ok=True)

    def write(f: Any) -> None:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.write(data)

    atomic_write(fs, final, write)


def read_tensors(path: str, kind: str, versions: Collection[int]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of the file at ``path``, a ``kind`` file of one of ``versions``.

    Raises:
        SnapshotError: no such file; not a safetensors file; one whose
            ``format`` is not ``kind`` or whose ``format_version`` is not
            among ``versions``; or one whose bytes fail their ``sha256``.
    """
    try:
        fs, where = fsspec.core.url_to_fs(path)
        with fs.open(where, "rb") as f:
            blob = f.read()
    except FileNotFoundError as e:
        raise SnapshotError(f"{path}: no such file") from e
    try:
        header, data = _header_and_data(blob)
    except ValueError as e:
        raise SnapshotError(f"{path} is not a safetensors file ({e}), so not a {kind} file") from e
    metadata = header.get("__metadata__") or {}
    found = metadata.get("format")
    if found != kind:
        what = f"a {found} file" if isinstance(found, str) else "a safetensors file with no format in its metadata"
        raise SnapshotError(f"{path} is {what}, not a {kind} file")
    if metadata.get("format_version") not in {str(v) for v in versions}:
        raise SnapshotError(
            f"{path} is a {kind} file of format version {metadata.get('format_version')!r}; this psframe reads "
            f"versions {sorted(versions)}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != metadata.get("sha256"):
        raise SnapshotError(
            f"{path} is corrupt: the bytes after its header have sha256 {digest}; it records {metadata.get('sha256')}"
        )
    try:
        tensors = safetensors.torch.load(blob)
    except (safetensors.SafetensorError, ValueError, KeyError) as e:
        raise SnapshotError(f"{path} is corrupt: {e}") from e
    return metadata, tensors


def _header_and_data(blob: bytes) -> tuple[dict, memoryview]:
    """A safetensors file's header (parsed) and the bytes after it; ValueError if it is not one."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes")
    size = int.from_bytes(blob[:8], "little")
    if size > min(len(blob) - 8, HEADER_LIMIT):
        raise ValueError(f"a header of {size} bytes in a file of {len(blob)}")
    try:
        header = json.loads(bytes(blob[8 : 8 + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__", {}), dict):
        raise ValueError("its header is not a JSON object of tensors and metadata")
    return header, memoryview(blob)[8 + size :]


def _packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors detached, on the CPU, contiguous, none sharing memory with another (as safetensors needs)."""
    packed = {}
    storages: set[int] = set()
    for key, value in tensors.items():
        if value.layout != torch.strided:
            raise SnapshotError(f"{key!r} is a {value.layout} tensor; a safetensors file holds dense tensors only")
        t = value.detach().cpu().contiguous()
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
        if t.numel() and (not whole or t.untyped_storage().data_ptr() in storages):
            t = t.clone()  # a view, or a tensor given twice: its own bytes
        storages.add(t.untyped_storage().data_ptr())
        packed[key] = t
    return packed

"""The on-disk checkpoint format: one shard per ps task, committed by a manifest.

Each ps task writes its own shard; the chief commits the checkpoint by writing
its manifest last::

    DIR/ckpt-000000001000/shard-00000-of-00002.pt    <- ps task 0 (write_shard)
    DIR/ckpt-000000001000/shard-00001-of-00002.pt    <- ps task 1 (write_shard)
    DIR/ckpt-000000001000/MANIFEST.json              <- chief, last (write_manifest)

A checkpoint exists only once its manifest does, so a save interrupted at any
point leaves the previous checkpoint usable. The manifest records each shard's
size and sha256; readers verify them before loading anything, and
:func:`latest_valid` skips (and logs) a damaged checkpoint in favour of the one
before it.

A shard is a :class:`~psframe.checkpoint.shard.ShardData` record, saved with
``torch.save`` as a plain dict and loaded with ``weights_only=True``; its
layout and its checks are :mod:`psframe.checkpoint.shard`.
:mod:`psframe.checkpoint.slices` rebuilds variables from the parts, also onto a
different number of ps tasks.

Every path goes through fsspec, so local paths, ``file://``, ``memory://``,
``s3://`` and ``hdfs://`` all work where their fsspec backend is installed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
import time
from collections.abc import Sequence
from typing import Any

import fsspec
import torch

from psframe.checkpoint.atomic import atomic_write, join, norm
from psframe.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardRecord,
    folder_name,
    manifest_from_json,
    manifest_to_json,
    shard_name,
)
from psframe.checkpoint.shard import DELTA_FORMAT_VERSION, FORMAT_VERSION, ShardData
from psframe.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20
_FOLDER_RE = re.compile(r"ckpt-(\d{12,})")
_DELTA_RE = re.compile(r"delta-(\d{12,})")


# ---- writing


def write_shard(url: str, step: int, shard: ShardData) -> ShardRecord:
    """Write one ps task's shard of the checkpoint at ``step`` under ``url``.

    The record is checked up front; tensors are saved detached, on the CPU
    and compact (a view saves its rows, not its whole storage). The file is
    written under a temporary name, hashed as it is written, then moved into
    place; it counts for nothing until :func:`write_manifest` commits it.

    Args:
        url: the checkpoint directory ``DIR``.
        step: the checkpoint's step (names the ``ckpt-*`` folder).
        shard: what this ps task saves; its ``ps_task`` and ``num_shards``
            name the file.

    Returns:
        The record to hand to the chief for :func:`write_manifest`.

    Raises:
        CheckpointError: the record is malformed (see
            :meth:`ShardData.to_dict`), or that checkpoint is already
            committed (a committed checkpoint is never rewritten).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step ({step!r}) must be an int >= 0")
    if not isinstance(shard, ShardData):
        raise CheckpointError(f"a shard must be a ShardData, got {type(shard).__name__}")
    return write_content(join(norm(url), folder_name(step)), shard.to_dict())


def write_content(folder_url: str, content: dict) -> ShardRecord:
    """Write a shard's ``content`` (a dict with ``ps_task``, ``num_shards`` and ``global_step``)
    with ``torch.save`` into checkpoint folder ``folder_url``, atomically; see :func:`write_shard`."""
    fs, folder = fsspec.core.url_to_fs(folder_url)
    if fs.exists(join(folder, MANIFEST_NAME)):
        raise CheckpointError(
            f"checkpoint {folder_url} is already committed; "
            f"a committed checkpoint is never rewritten: save under a new step"
        )
    fs.makedirs(folder, exist_ok=True)
    name = shard_name(content["ps_task"], content["num_shards"])
    writer = atomic_write(fs, join(folder, name), lambda f: torch.save(content, f))
    return ShardRecord(
        ps_task=content["ps_task"],
        file=name,
        sha256=writer.hexdigest(),
        nbytes=writer.nbytes,
        global_step=content["global_step"],
    )


def write_manifest(url: str, step: int, records: Sequence[ShardRecord], parent: int | None = None) -> Manifest:
    """Commit the checkpoint at ``step`` by writing its manifest, atomically.

    Args:
        url: the checkpoint directory ``DIR``.
        step: the checkpoint's step.
        records: what :func:`write_shard` returned on every ps task.
        parent: for a delta checkpoint (:mod:`psframe.checkpoint.deltas`),
            the step of the checkpoint it follows.

    Returns:
        The committed checkpoint.

    Raises:
        CheckpointError: the records do not cover ps tasks ``0..n-1`` exactly
            once, a shard file is missing or has another size than recorded,
            or the checkpoint is already committed.
    """
    url = norm(url)
    records = tuple(sorted(records, key=lambda r: r.ps_task))
    num_shards = len(records)
    tasks = [r.ps_task for r in records]
    if tasks != list(range(num_shards)) or num_shards == 0:
        raise CheckpointError(
            f"the shards of checkpoint step {step} must cover ps tasks "
            f"0..{num_shards - 1} exactly once; got ps tasks {tasks}"
        )
    manifest = Manifest(
        url=url,
        step=step,
        num_shards=num_shards,
        shards=records,
        created=time.time(),
        format_version=FORMAT_VERSION if parent is None else DELTA_FORMAT_VERSION,
        parent=parent,
    )
    fs, folder = fsspec.core.url_to_fs(manifest.folder)
    for record in records:
        expected = shard_name(record.ps_task, num_shards)
        if record.file != expected:
            raise CheckpointError(
                f"shard record of ps task {record.ps_task} names {record.file!r}; "
                f"a checkpoint of {num_shards} shards expects {expected!r}"
            )
        path = join(folder, record.file)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            size = None
        if size != record.nbytes:
            found = "no file" if size is None else f"{size} bytes"
            raise CheckpointError(
                f"cannot commit {manifest.folder}: shard {record.file} should hold {record.nbytes} bytes, found {found}"
            )
    final = join(folder, MANIFEST_NAME)
    if fs.exists(final):
        raise CheckpointError(f"checkpoint {manifest.folder} is already committed")
    text = json.dumps(manifest_to_json(manifest), indent=2, sort_keys=True)
    # The commit point: readers either see the whole manifest or none.
    atomic_write(fs, final, lambda f: f.write(text.encode()))
    return manifest


# ---- finding and reading


def list_checkpoints(url: str, deltas: bool = False) -> list[Manifest]:
    """The committed full checkpoints under ``url`` (or, with ``deltas``, the delta checkpoints), ascending by step.

    A folder without a manifest is an unfinished save and is left out
    silently; a manifest that cannot be read or parsed is left out with a
    logged warning. A missing directory has no checkpoints.
    """
    url = norm(url)
    fs, _ = fsspec.core.url_to_fs(url)
    manifests = []
    for step, folder in _scan(url, deltas):
        try:
            with fs.open(join(folder, MANIFEST_NAME), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue  # never committed
        except OSError as e:
            logger.warning(
                "skipping checkpoint %s: its manifest cannot be read (%s)", join(url, folder_name(step, deltas)), e
            )
            continue
        try:
            manifests.append(manifest_from_json(url, step, data, delta=deltas))
        except (ValueError, KeyError, TypeError) as e:
            logger.warning(
                "skipping checkpoint %s: its manifest is unreadable (%s)", join(url, folder_name(step, deltas)), e
            )
    return manifests


def read_shard(manifest: Manifest, ps_task: int) -> ShardData:
    """Load ``ps_task``'s shard of a committed checkpoint, after verifying it.

    The file is hashed in one streaming pass and loaded in a second, so its
    bytes are never held twice; committed files are never rewritten. Shards
    of every format in :data:`READABLE_FORMATS` are read.

    Returns:
        The shard, checked as :meth:`ShardData.from_dict` checks it.

    Raises:
        CheckpointCorruptError: the file is missing, has the wrong size or
            fails its sha256 (the message names the file and both hashes).
        CheckpointError: the file verifies but is not a shard this version of
            psframe can load, or is another ps task's than the manifest says.
    """
    content, where = load_verified(manifest, ps_task)
    try:
        shard = ShardData.from_dict(content)
    except CheckpointError as e:
        raise CheckpointError(f"{where} is not a shard this psframe can read: {e}") from e
    if shard.ps_task != ps_task or shard.num_shards != manifest.num_shards:
        raise CheckpointError(
            f"{where} holds ps task {shard.ps_task} of {shard.num_shards}; "
            f"the manifest expects ps task {ps_task} of {manifest.num_shards}"
        )
    return shard


def load_verified(manifest: Manifest, ps_task: int) -> tuple[Any, str]:
    """The dict ``ps_task``'s file of a committed checkpoint (full or delta) holds, after checking
    its size and sha256, and the file's URL (for messages).

    Raises:
        CheckpointCorruptError: the file is missing or does not match the manifest.
        CheckpointError: it matches, but ``torch.load`` (``weights_only``) cannot read it.
    """
    record = manifest.shard(ps_task)
    fs, path = _check_file(manifest, record)
    where = join(manifest.folder, record.file)
    try:
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True), where
    except Exception as e:
        raise CheckpointError(f"{where} matches its sha256 but cannot be loaded: {e}") from e


def verify(manifest: Manifest) -> None:
    """Check that every shard is present with its recorded size and sha256.

    Raises:
        CheckpointCorruptError: naming the first shard that is not.
    """
    for record in manifest.shards:
        _check_file(manifest, record)


def latest_valid(url: str) -> Manifest | None:
    """The newest committed checkpoint whose shards all verify, or None.

    A newer checkpoint that fails :func:`verify` is skipped with a logged
    warning naming it and why. Errors other than corruption (a store that
    cannot be reached) are raised, not taken for corruption.
    """
    for manifest in reversed(list_checkpoints(url)):
        try:
            verify(manifest)
        except CheckpointCorruptError as e:
            logger.warning(
                "skipping checkpoint %s (step %d), falling back to an older one: %s", manifest.folder, manifest.step, e
            )
            continue
        return manifest
    return None


def prune(url: str, keep: int) -> list[int]:
    """Delete old checkpoints, keeping the newest ``keep`` committed ones.

    Also deletes uncommitted ``ckpt-*`` folders older than the newest
    committed checkpoint (leftovers of interrupted saves); newer ones may be
    saves in progress and are kept. Delta checkpoints older than the oldest
    full checkpoint kept go too (no chain starts before it), as do
    uncommitted delta folders older than the newest commit. A folder whose manifest exists but cannot
    be read is never deleted. A committed checkpoint loses its manifest first,
    so an interrupted prune never leaves a manifest without its shards.

    Returns:
        The steps deleted, ascending.

    Raises:
        CheckpointError: ``keep`` is less than 1.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep ({keep!r}) must be an int >= 1")
    url = norm(url)
    fs, _ = fsspec.core.url_to_fs(url)
    committed = [m.step for m in list_checkpoints(url)]
    if not committed:
        return []
    newest = committed[-1]
    doomed = set(committed[:-keep])
    deleted = []
    for step, folder in _scan(url):
        manifest = join(folder, MANIFEST_NAME)
        if step in doomed:
            fs.rm(manifest)
        elif step >= newest or fs.exists(manifest):
            continue
        fs.rm(folder, recursive=True)
        deleted.append(step)
    # A delta follows a full checkpoint: one not after the oldest full checkpoint kept
    # belongs to no chain any more. An uncommitted delta older than the newest commit is a leftover.
    oldest_kept = committed[-keep:][0]
    newest_commit = max([newest, *(m.step for m in list_checkpoints(url, deltas=True))])
    for step, folder in _scan(url, deltas=True):
        manifest = join(folder, MANIFEST_NAME)
        if step <= oldest_kept or (step < newest_commit and not fs.exists(manifest)):
            if fs.exists(manifest):
                fs.rm(manifest)
            fs.rm(folder, recursive=True)
            deleted.append(step)
    return sorted(deleted)


# ---- helpers


def _check_file(manifest: Manifest, record: ShardRecord) -> tuple[Any, str]:
    """Size and sha256 check of one shard; returns its (fs, path)."""
    where = join(manifest.folder, record.file)
    fs, path = fsspec.core.url_to_fs(where)
    try:
        size = fs.size(path)
        if size != record.nbytes:
            kind = "truncated" if size < record.nbytes else "too long"
            raise CheckpointCorruptError(
                f"{where} is {kind}: {size} bytes, the manifest records {record.nbytes} (sha256 {record.sha256})"
            )
        sha = hashlib.sha256()
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
    except FileNotFoundError as e:
        raise CheckpointCorruptError(
            f"{where} is missing; the manifest records {record.nbytes} bytes with sha256 {record.sha256}"
        ) from e
    if sha.hexdigest() != record.sha256:
        raise CheckpointCorruptError(
            f"{where} is corrupt: sha256 {sha.hexdigest()}, the manifest records {record.sha256}"
        )
    return fs, path


def _scan(url: str, deltas: bool = False) -> list[tuple[int, str]]:
    """(step, folder path) of every ``ckpt-*`` (or ``delta-*``) folder under ``url``, ascending."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(root)  # other tasks write here; a cached listing is stale
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        name = posixpath.basename(entry["name"].rstrip("/"))
        match = (_DELTA_RE if deltas else _FOLDER_RE).fullmatch(name)
        if match and entry.get("type") == "directory":
            found.append((int(match.group(1)), join(root, name)))
    return sorted(found)

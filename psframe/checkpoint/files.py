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

A shard is a dict saved with ``torch.save`` and loaded with
``weights_only=True``::

    {"format_version": 1, "global_step": int, "ps_task": int, "num_shards": int,
     "optimizer": {"name": "Adam", "kwargs": {"lr": 0.001}},
     "sync": None or {"replicas_to_aggregate": int, "total_num_replicas": int,
                      "timeout": float},
     "variables": [{"name": "emb.weight/part_1", "variable": "emb.weight",
                    "dtype": "float32", "shape": [r, c], "full_shape": [R, c],
                    "row_start": int, "part_index": int, "num_parts": int,
                    "value": Tensor, "state": {"step": Tensor, "exp_avg": Tensor}}]}

``state`` is the variable's ``torch.optim`` per-parameter state: a tensor shaped
like ``value`` is element-wise state, anything else is per-parameter scalar
state. :mod:`psframe.checkpoint.slices` rebuilds variables from the parts, also
onto a different number of ps tasks.

Every path goes through fsspec, so local paths, ``file://``, ``memory://``,
``s3://`` and ``hdfs://`` all work where their fsspec backend is installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from psframe.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
_CHUNK = 8 << 20
_FOLDER_RE = re.compile(r"ckpt-(\d{12,})")

_SHARD_KEYS = ("global_step", "optimizer", "sync", "variables")
_VARIABLE_KEYS = ("name", "variable", "dtype", "shape", "full_shape", "row_start",
                  "part_index", "num_parts", "value", "state")
_SYNC_KEYS = ("replicas_to_aggregate", "total_num_replicas", "timeout")


@dataclass(frozen=True)
class ShardRecord:
    """One shard as the manifest records it.

    ``file`` is relative to the checkpoint folder.
    """

    ps_task: int
    file: str
    sha256: str
    nbytes: int
    global_step: int


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: where it lives and what its shards must be.

    ``url`` is the checkpoint directory (``DIR``), not the ``ckpt-*`` folder.
    """

    url: str
    step: int
    num_shards: int
    shards: tuple[ShardRecord, ...]
    created: float
    format_version: int

    @property
    def folder(self) -> str:
        """The URL of this checkpoint's folder, ``DIR/ckpt-<step>``."""
        return _join(self.url, _folder_name(self.step))

    def shard(self, ps_task: int) -> ShardRecord:
        """The record of ``ps_task``'s shard.

        Raises:
            CheckpointError: the checkpoint has no shard for that ps task.
        """
        for record in self.shards:
            if record.ps_task == ps_task:
                return record
        raise CheckpointError(
            f"checkpoint {self.folder} has no shard for ps task {ps_task}; "
            f"it holds ps tasks 0..{self.num_shards - 1}"
        )


# ---- writing


def write_shard(url: str, step: int, ps_task: int, num_shards: int, shard: dict) -> ShardRecord:
    """Write one ps task's shard of the checkpoint at ``step`` under ``url``.

    The dict is checked up front; tensors are saved detached, on the CPU and
    compact (a view saves its rows, not its whole storage). The file is
    written under a temporary name, hashed as it is written, then moved into
    place; it counts for nothing until :func:`write_manifest` commits it.

    Args:
        url: the checkpoint directory ``DIR``.
        step: the checkpoint's step (names the ``ckpt-*`` folder).
        ps_task: this ps task's index.
        num_shards: the number of ps tasks saving this checkpoint.
        shard: the shard dict described in the module docstring;
            ``format_version``, ``ps_task`` and ``num_shards`` may be left
            out and are filled in.

    Returns:
        The record to hand to the chief for :func:`write_manifest`.

    Raises:
        CheckpointError: the dict is malformed, or that checkpoint is already
            committed (a committed checkpoint is never rewritten).
    """
    _check_index(step, ps_task, num_shards)
    content = _clean_shard(shard, step, ps_task, num_shards)
    url = _norm(url)
    fs, folder = fsspec.core.url_to_fs(_join(url, _folder_name(step)))
    if fs.exists(_join(folder, MANIFEST_NAME)):
        raise CheckpointError(
            f"checkpoint {_join(url, _folder_name(step))} is already committed; "
            f"a committed checkpoint is never rewritten: save under a new step"
        )
    fs.makedirs(folder, exist_ok=True)
    name = _shard_name(ps_task, num_shards)
    final = _join(folder, name)
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    try:
        with fs.open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(content, writer)
            _fsync(f)
        fs.mv(tmp, final)
    except BaseException:
        _remove_quietly(fs, tmp)
        raise
    return ShardRecord(ps_task=ps_task, file=name, sha256=writer.hexdigest(),
                       nbytes=writer.nbytes, global_step=content["global_step"])


def write_manifest(url: str, step: int, records: Sequence[ShardRecord]) -> Manifest:
    """Commit the checkpoint at ``step`` by writing its manifest, atomically.

    Args:
        url: the checkpoint directory ``DIR``.
        step: the checkpoint's step.
        records: what :func:`write_shard` returned on every ps task.

    Returns:
        The committed checkpoint.

    Raises:
        CheckpointError: the records do not cover ps tasks ``0..n-1`` exactly
            once, a shard file is missing or has another size than recorded,
            or the checkpoint is already committed.
    """
    url = _norm(url)
    records = tuple(sorted(records, key=lambda r: r.ps_task))
    num_shards = len(records)
    tasks = [r.ps_task for r in records]
    if tasks != list(range(num_shards)) or num_shards == 0:
        raise CheckpointError(
            f"the shards of checkpoint step {step} must cover ps tasks "
            f"0..{num_shards - 1} exactly once; got ps tasks {tasks}"
        )
    manifest = Manifest(url=url, step=step, num_shards=num_shards, shards=records,
                        created=time.time(), format_version=FORMAT_VERSION)
    fs, folder = fsspec.core.url_to_fs(manifest.folder)
    for record in records:
        expected = _shard_name(record.ps_task, num_shards)
        if record.file != expected:
            raise CheckpointError(
                f"shard record of ps task {record.ps_task} names {record.file!r}; "
                f"a checkpoint of {num_shards} shards expects {expected!r}"
            )
        path = _join(folder, record.file)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            size = None
        if size != record.nbytes:
            found = "no file" if size is None else f"{size} bytes"
            raise CheckpointError(
                f"cannot commit {manifest.folder}: shard {record.file} should hold "
                f"{record.nbytes} bytes, found {found}"
            )
    final = _join(folder, MANIFEST_NAME)
    if fs.exists(final):
        raise CheckpointError(f"checkpoint {manifest.folder} is already committed")
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    text = json.dumps(_manifest_to_json(manifest), indent=2, sort_keys=True)
    try:
        with fs.open(tmp, "wb") as f:
            f.write(text.encode())
            _fsync(f)
        # The commit point. A local rename is atomic; on object stores mv is a
        # copy then a delete, and that single write of the final object is the
        # commit: readers either see the whole manifest or none.
        fs.mv(tmp, final)
    except BaseException:
        _remove_quietly(fs, tmp)
        raise
    return manifest


# ---- finding and reading


def list_checkpoints(url: str) -> list[Manifest]:
    """The committed checkpoints under ``url``, ascending by step.

    A folder without a manifest is an unfinished save and is left out
    silently; a manifest that cannot be read or parsed is left out with a
    logged warning. A missing directory has no checkpoints.
    """
    url = _norm(url)
    fs, _ = fsspec.core.url_to_fs(url)
    manifests = []
    for step, folder in _scan(url):
        try:
            with fs.open(_join(folder, MANIFEST_NAME), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue  # never committed
        except OSError as e:
            logger.warning("skipping checkpoint %s: its manifest cannot be read (%s)",
                           _join(url, _folder_name(step)), e)
            continue
        try:
            manifests.append(_manifest_from_json(url, step, data))
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("skipping checkpoint %s: its manifest is unreadable (%s)",
                           _join(url, _folder_name(step)), e)
    return manifests


def read_shard(manifest: Manifest, ps_task: int) -> dict:
    """Load ``ps_task``'s shard of a committed checkpoint, after verifying it.

    The file is hashed in one streaming pass and loaded in a second, so its
    bytes are never held twice; committed files are never rewritten.

    Raises:
        CheckpointCorruptError: the file is missing, has the wrong size or
            fails its sha256 (the message names the file and both hashes).
        CheckpointError: the file verifies but is not a shard this version of
            psframe can load.
    """
    record = manifest.shard(ps_task)
    fs, path = _check_file(manifest, record)
    try:
        with fs.open(path, "rb") as f:
            content = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{_join(manifest.folder, record.file)} matches its sha256 but cannot be "
            f"loaded as a shard: {e}"
        ) from e
    where = _join(manifest.folder, record.file)
    if not isinstance(content, dict) or "format_version" not in content:
        raise CheckpointError(f"{where} does not hold a shard dict")
    if content["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} is in checkpoint format {content['format_version']}; "
            f"this psframe reads format {FORMAT_VERSION}"
        )
    if content.get("ps_task") != ps_task or content.get("num_shards") != manifest.num_shards:
        raise CheckpointError(
            f"{where} holds ps task {content.get('ps_task')} of {content.get('num_shards')}; "
            f"the manifest expects ps task {ps_task} of {manifest.num_shards}"
        )
    return content


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
            logger.warning("skipping checkpoint %s (step %d), falling back to an older one: %s",
                           manifest.folder, manifest.step, e)
            continue
        return manifest
    return None


def prune(url: str, keep: int) -> list[int]:
    """Delete old checkpoints, keeping the newest ``keep`` committed ones.

    Also deletes uncommitted ``ckpt-*`` folders older than the newest
    committed checkpoint (leftovers of interrupted saves); newer ones may be
    saves in progress and are kept. A folder whose manifest exists but cannot
    be read is never deleted. A committed checkpoint loses its manifest first,
    so an interrupted prune never leaves a manifest without its shards.

    Returns:
        The steps deleted, ascending.

    Raises:
        CheckpointError: ``keep`` is less than 1.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep ({keep!r}) must be an int >= 1")
    url = _norm(url)
    fs, _ = fsspec.core.url_to_fs(url)
    committed = [m.step for m in list_checkpoints(url)]
    if not committed:
        return []
    newest = committed[-1]
    doomed = set(committed[:-keep])
    deleted = []
    for step, folder in _scan(url):
        manifest = _join(folder, MANIFEST_NAME)
        if step in doomed:
            fs.rm(manifest)
        elif step >= newest or fs.exists(manifest):
            continue
        fs.rm(folder, recursive=True)
        deleted.append(step)
    return sorted(deleted)


# ---- helpers


class _HashingWriter:
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


def _check_file(manifest: Manifest, record: ShardRecord) -> tuple[Any, str]:
    """Size and sha256 check of one shard; returns its (fs, path)."""
    where = _join(manifest.folder, record.file)
    fs, path = fsspec.core.url_to_fs(where)
    try:
        size = fs.size(path)
        if size != record.nbytes:
            kind = "truncated" if size < record.nbytes else "too long"
            raise CheckpointCorruptError(
                f"{where} is {kind}: {size} bytes, the manifest records {record.nbytes} "
                f"(sha256 {record.sha256})"
            )
        sha = hashlib.sha256()
        with fs.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
    except FileNotFoundError as e:
        raise CheckpointCorruptError(
            f"{where} is missing; the manifest records {record.nbytes} bytes "
            f"with sha256 {record.sha256}"
        ) from e
    if sha.hexdigest() != record.sha256:
        raise CheckpointCorruptError(
            f"{where} is corrupt: sha256 {sha.hexdigest()}, the manifest records "
            f"{record.sha256}"
        )
    return fs, path


def _scan(url: str) -> list[tuple[int, str]]:
    """(step, folder path) of every ``ckpt-*`` folder under ``url``, ascending."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(root)  # other tasks write here; a cached listing is stale
    try:
        entries = fs.ls(root, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        name = posixpath.basename(entry["name"].rstrip("/"))
        match = _FOLDER_RE.fullmatch(name)
        if match and entry.get("type") == "directory":
            found.append((int(match.group(1)), _join(root, name)))
    return sorted(found)


def _manifest_to_json(manifest: Manifest) -> dict:
    return {
        "format_version": manifest.format_version,
        "step": manifest.step,
        "num_shards": manifest.num_shards,
        "created": manifest.created,
        "shards": [
            {"ps_task": r.ps_task, "file": r.file, "sha256": r.sha256,
             "nbytes": r.nbytes, "global_step": r.global_step}
            for r in manifest.shards
        ],
    }


def _manifest_from_json(url: str, step: int, data: bytes) -> Manifest:
    """Parse and check a manifest; ValueError/KeyError/TypeError if it is not one."""
    obj = json.loads(data)
    if obj["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format {obj['format_version']}, this psframe reads {FORMAT_VERSION}")
    if obj["step"] != step:
        raise ValueError(f"it records step {obj['step']}, its folder is step {step}")
    num_shards = obj["num_shards"]
    records = tuple(
        ShardRecord(ps_task=int(s["ps_task"]), file=str(s["file"]), sha256=str(s["sha256"]),
                    nbytes=int(s["nbytes"]), global_step=int(s["global_step"]))
        for s in obj["shards"]
    )
    if [r.ps_task for r in records] != list(range(num_shards)):
        raise ValueError(f"its shards do not cover ps tasks 0..{num_shards - 1} once")
    for r in records:  # names are fixed by the layout, never paths to elsewhere
        if r.file != _shard_name(r.ps_task, num_shards):
            raise ValueError(f"unexpected shard file name {r.file!r}")
    return Manifest(url=url, step=step, num_shards=num_shards, shards=records,
                    created=float(obj["created"]), format_version=FORMAT_VERSION)


def _clean_shard(shard: Any, step: int, ps_task: int, num_shards: int) -> dict:
    """A checked copy of a shard dict, with portable tensors; raises CheckpointError."""
    if not isinstance(shard, Mapping):
        raise CheckpointError(f"a shard must be a dict, got {type(shard).__name__}")
    missing = [k for k in _SHARD_KEYS if k not in shard]
    if missing:
        raise CheckpointError(f"shard dict of ps task {ps_task} lacks keys {missing}; "
                              f"it needs {list(_SHARD_KEYS)}")
    for key, want in (("format_version", FORMAT_VERSION), ("ps_task", ps_task),
                      ("num_shards", num_shards)):
        if key in shard and shard[key] != want:
            raise CheckpointError(f"shard dict says {key}={shard[key]!r}, expected {want!r}")
    unknown = sorted(set(shard) - set(_SHARD_KEYS) - {"format_version", "ps_task", "num_shards"})
    if unknown:
        raise CheckpointError(f"shard dict of ps task {ps_task} has unknown keys {unknown}")
    if not _is_int(shard["global_step"]):
        raise CheckpointError(f"global_step must be an int, got {shard['global_step']!r}")

    optimizer = shard["optimizer"]
    if (not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("name"), str)
            or not isinstance(optimizer.get("kwargs"), Mapping)):
        raise CheckpointError(
            f"optimizer must be {{'name': str, 'kwargs': dict}}, got {optimizer!r}")
    _check_plain(dict(optimizer["kwargs"]), "optimizer kwargs")

    sync = shard["sync"]
    if sync is not None:
        if not isinstance(sync, Mapping) or set(sync) != set(_SYNC_KEYS):
            raise CheckpointError(f"sync must be None or a dict with keys {list(_SYNC_KEYS)}, "
                                  f"got {sync!r}")
        _check_plain(dict(sync), "sync")

    if not isinstance(shard["variables"], Sequence):
        raise CheckpointError("variables must be a list of dicts")
    variables = [_clean_variable(v, i) for i, v in enumerate(shard["variables"])]
    names = [v["name"] for v in variables]
    if len(set(names)) != len(names):
        raise CheckpointError(f"shard of ps task {ps_task} names a variable twice: {names}")
    return {
        "format_version": FORMAT_VERSION,
        "global_step": int(shard["global_step"]),
        "ps_task": ps_task,
        "num_shards": num_shards,
        "optimizer": {"name": optimizer["name"], "kwargs": dict(optimizer["kwargs"])},
        "sync": None if sync is None else dict(sync),
        "variables": variables,
    }


def _clean_variable(var: Any, index: int) -> dict:
    if not isinstance(var, Mapping):
        raise CheckpointError(f"variables[{index}] must be a dict, got {type(var).__name__}")
    label = f"variables[{index}] ({var.get('name', '?')!r})"
    missing = [k for k in _VARIABLE_KEYS if k not in var]
    if missing:
        raise CheckpointError(f"{label} lacks keys {missing}; it needs {list(_VARIABLE_KEYS)}")
    value = var["value"]
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{label}: value must be a tensor, got {type(value).__name__}")
    for key in ("name", "variable", "dtype"):
        if not isinstance(var[key], str):
            raise CheckpointError(f"{label}: {key} must be a str, got {var[key]!r}")
    for key in ("row_start", "part_index", "num_parts"):
        if not _is_int(var[key]):
            raise CheckpointError(f"{label}: {key} must be an int, got {var[key]!r}")
    shape, full_shape = _shape(var["shape"], label), _shape(var["full_shape"], label)
    if shape != list(value.shape):
        raise CheckpointError(f"{label}: shape {shape} but value has shape {list(value.shape)}")
    if var["dtype"] != _dtype_name(value.dtype):
        raise CheckpointError(f"{label}: dtype {var['dtype']!r} but value is "
                              f"{_dtype_name(value.dtype)!r}")
    rows_ok = (shape == full_shape == [] and var["row_start"] == 0) or (
        len(shape) == len(full_shape) >= 1 and shape[1:] == full_shape[1:]
        and 0 <= var["row_start"] and var["row_start"] + shape[0] <= full_shape[0])
    if not rows_ok:
        raise CheckpointError(f"{label}: shape {shape} at row_start {var['row_start']} "
                              f"does not fit in full_shape {full_shape}")
    if not isinstance(var["state"], Mapping):
        raise CheckpointError(f"{label}: state must be a dict, got {type(var['state']).__name__}")
    state = {}
    for key, x in var["state"].items():
        if not isinstance(key, str):
            raise CheckpointError(f"{label}: state keys must be str, got {key!r}")
        if isinstance(x, torch.Tensor):
            state[key] = _portable(x)
        else:
            _check_plain(x, f"{label} state {key!r}")
            state[key] = x
    out = {k: var[k] for k in ("name", "variable", "dtype", "row_start", "part_index", "num_parts")}
    out.update(shape=shape, full_shape=full_shape, value=_portable(value), state=state)
    return out


def _check_plain(obj: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would not load back."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _check_plain(x, where)
        return
    if isinstance(obj, dict):
        for k, x in obj.items():
            _check_plain(k, where)
            _check_plain(x, where)
        return
    raise CheckpointError(f"{where}: {type(obj).__name__} values cannot be checkpointed; "
                          f"use tensors, numbers, strings, lists, tuples or dicts")


def _portable(t: torch.Tensor) -> torch.Tensor:
    """Detached, on the CPU, and owning exactly its own bytes (torch.save writes
    a view's whole storage otherwise)."""
    t = t.detach().cpu()
    if t.layout != torch.strided:
        return t
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _shape(shape: Any, label: str) -> list[int]:
    if not isinstance(shape, (list, tuple, torch.Size)) or not all(
            _is_int(n) and n >= 0 for n in shape):
        raise CheckpointError(f"{label}: shapes must be lists of ints >= 0, got {shape!r}")
    return [int(n) for n in shape]


def _check_index(step: int, ps_task: int, num_shards: int) -> None:
    if not (_is_int(step) and step >= 0):
        raise CheckpointError(f"step ({step!r}) must be an int >= 0")
    if not (_is_int(num_shards) and num_shards >= 1):
        raise CheckpointError(f"num_shards ({num_shards!r}) must be an int >= 1")
    if not (_is_int(ps_task) and 0 <= ps_task < num_shards):
        raise CheckpointError(f"ps_task ({ps_task!r}) must be in 0..{num_shards - 1}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _folder_name(step: int) -> str:
    return f"ckpt-{step:012d}"


def _shard_name(ps_task: int, num_shards: int) -> str:
    return f"shard-{ps_task:05d}-of-{num_shards:05d}.pt"


def _norm(url: str) -> str:
    stripped = url.rstrip("/")
    return url if not stripped or stripped.endswith(":") else stripped


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _fsync(f: Any) -> None:
    # On a local disk the bytes must be durable before the rename publishes
    # them; other stores have no fileno and make the object durable on close.
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass


def _remove_quietly(fs: Any, path: str) -> None:
    try:
        fs.rm(path)
    except Exception:  # best effort: the save already failed for a better reason
        pass

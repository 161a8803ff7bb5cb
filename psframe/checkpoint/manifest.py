"""A checkpoint's manifest: what a committed checkpoint holds, and where.

The chief writes it last (:func:`psframe.checkpoint.files.write_manifest`);
a checkpoint exists only once its manifest does. Folder and shard file names
are fixed by the layout, never read as paths from elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from psframe.checkpoint.atomic import join
from psframe.checkpoint.shard import DELTA_FORMATS, READABLE_FORMATS
from psframe.errors import CheckpointError

MANIFEST_NAME = "MANIFEST.json"


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
    A delta checkpoint (:mod:`psframe.checkpoint.deltas`) names the step of
    the checkpoint it follows, ``parent``, and lives in a ``delta-*`` folder.
    """

    url: str
    step: int
    num_shards: int
    shards: tuple[ShardRecord, ...]
    created: float
    format_version: int
    parent: int | None = None  # a delta's: the step of the checkpoint it follows; None: a full checkpoint

    @property
    def folder(self) -> str:
        """The URL of this checkpoint's folder, ``DIR/ckpt-<step>`` (``DIR/delta-<step>`` for a delta)."""
        return join(self.url, folder_name(self.step, delta=self.parent is not None))

    def shard(self, ps_task: int) -> ShardRecord:
        """The record of ``ps_task``'s shard.

        Raises:
            CheckpointError: the checkpoint has no shard for that ps task.
        """
        for record in self.shards:
            if record.ps_task == ps_task:
                return record
        raise CheckpointError(
            f"checkpoint {self.folder} has no shard for ps task {ps_task}; it holds ps tasks 0..{self.num_shards - 1}"
        )


def manifest_to_json(manifest: Manifest) -> dict:
    parent = {} if manifest.parent is None else {"parent": manifest.parent}
    return {
        "format_version": manifest.format_version,
        "step": manifest.step,
        "num_shards": manifest.num_shards,
        "created": manifest.created,
        "shards": [asdict(r) for r in manifest.shards],
        **parent,
    }


def manifest_from_json(url: str, step: int, data: bytes, delta: bool = False) -> Manifest:
    """Parse and check a manifest (of a delta: ``delta``); ValueError/KeyError/TypeError if it is not one."""
    obj = json.loads(data)
    version = obj["format_version"]
    formats = DELTA_FORMATS if delta else READABLE_FORMATS
    if version not in formats:
        raise ValueError(f"format {version}, this psframe reads formats {list(formats)}")
    parent = obj["parent"] if delta else None
    if delta and not (isinstance(parent, int) and not isinstance(parent, bool) and 0 <= parent < step):
        raise ValueError(f"a delta of step {step} must name an earlier parent step, got {parent!r}")
    if obj["step"] != step:
        raise ValueError(f"it records step {obj['step']}, its folder is step {step}")
    num_shards = obj["num_shards"]
    records = tuple(
        ShardRecord(
            ps_task=int(s["ps_task"]),
            file=str(s["file"]),
            sha256=str(s["sha256"]),
            nbytes=int(s["nbytes"]),
            global_step=int(s["global_step"]),
        )
        for s in obj["shards"]
    )
    if [r.ps_task for r in records] != list(range(num_shards)):
        raise ValueError(f"its shards do not cover ps tasks 0..{num_shards - 1} once")
    for r in records:  # names are fixed by the layout, never paths to elsewhere
        if r.file != shard_name(r.ps_task, num_shards):
            raise ValueError(f"unexpected shard file name {r.file!r}")
    return Manifest(
        url=url,
        step=step,
        num_shards=num_shards,
        shards=records,
        created=float(obj["created"]),
        format_version=int(version),
        parent=parent,
    )


def folder_name(step: int, delta: bool = False) -> str:
    return f"{'delta' if delta else 'ckpt'}-{step:012d}"


def shard_name(ps_task: int, num_shards: int) -> str:
    return f"shard-{ps_task:05d}-of-{num_shards:05d}.pt"

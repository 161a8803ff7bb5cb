"""Serving snapshots made from committed checkpoints: :func:`export_checkpoint` (a whole
snapshot) and :func:`export_delta` (the update a delta checkpoint makes); :func:`snapshot_of_shards`
for shards read already.

Reads the checkpoint chain through :mod:`psframe.checkpoint`, keeps the
parameters and the dynamic tables' rows, never optimizer state, and leaves
out the rows that the serving thresholds (a row's norm, its age) exclude.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from psframe import checkpoint
from psframe.checkpoint.dynamic import dynamic_parts_of, gather
from psframe.checkpoint.manifest import Manifest
from psframe.checkpoint.shard import ShardData
from psframe.checkpoint.slices import assemble
from psframe.errors import CheckpointError, SnapshotError
from psframe.export.diff import diff_snapshots
from psframe.export.snapshot import Snapshot, SnapshotUpdate, TableRows


def export_checkpoint(
    checkpoint_dir: str,
    step: int | None = None,
    *,
    min_row_norm: float | None = None,
    max_row_age_seconds: float | None = None,
    now: float | None = None,
) -> Snapshot:
    """The snapshot of a committed checkpoint: its parameters and dynamic tables' rows, no optimizer state.

    The thresholds evict more strictly for serving than training does: a
    row either leaves out is not in the snapshot, and stays in the
    checkpoint (they choose what serves, not what trains).

    Args:
        checkpoint_dir: the folder or fsspec URL given to the trainer.
        step: which checkpoint; None takes the latest valid one (a corrupted
            newer one is reported and skipped), as :func:`psframe.checkpoint.load` does.
        min_row_norm: leave out rows whose L2 norm is below this.
        max_row_age_seconds: leave out rows not looked up or updated for
            more than this many seconds before ``now`` (the times the
            checkpoint saved with each row).
        now: the wall-clock time (seconds since the epoch) ages count to;
            default: the current time.

    Returns:
        The snapshot, of the checkpoint's step.

    Raises:
        CheckpointError: there is no such (valid) checkpoint.
        SnapshotError: a threshold is not a number >= 0 (or ``now`` not a number), or
            ``max_row_age_seconds`` is given for a checkpoint whose tables
            have no times saved (one written before psframe timed rows).
    """
    for value, name in ((min_row_norm, "min_row_norm"), (max_row_age_seconds, "max_row_age_seconds")):
        if value is not None and not _is_number(value, minimum=0.0):
            raise SnapshotError(f"{name} ({value!r}) must be a number >= 0")
    if now is not None and not _is_number(now, minimum=-math.inf):
        raise SnapshotError(f"now ({now!r}) must be a number of seconds since the epoch")
    now = time.time() if now is None else now
    chain = checkpoint.read(checkpoint_dir, step)  # a full checkpoint and the deltas after it
    return _snapshot_of(chain.read_shards(), chain.last, min_row_norm, max_row_age_seconds, now)


def snapshot_of_shards(shards: Sequence[ShardData], manifest: Manifest) -> Snapshot:
    """The snapshot of checkpoint ``manifest`` from its shards read already (every ps task's, as
    :meth:`psframe.checkpoint.Chain.read_shards` gives them), every row kept: what
    :func:`export_checkpoint` gives without thresholds, for a reader that needs the shards too
    (``psframe serve`` keeps where each part lies, to apply deltas).

    Raises:
        CheckpointError: the parts of a variable do not fit together.
    """
    return _snapshot_of(shards, manifest, None, None, 0.0)


def _snapshot_of(
    shards: Sequence[ShardData],
    manifest: Manifest,
    min_row_norm: float | None,
    max_row_age_seconds: float | None,
    now: float,
) -> Snapshot:
    plain = [replace(s, variables=tuple(v for v in s.variables if v.dynamic is None)) for s in shards]
    tables = {}
    for name, parts in sorted(dynamic_parts_of(shards).items()):
        held = gather(parts)
        keep = torch.ones(held["ids"].numel(), dtype=torch.bool)
        if min_row_norm is not None:
            keep &= _row_norms(held["rows"]) >= min_row_norm
        if max_row_age_seconds is not None:
            if "seen" not in held:
                raise SnapshotError(
                    f"table {name!r} of checkpoint {manifest.folder} has no times its rows were last used (it was "
                    f"saved before psframe kept them): max_row_age_seconds cannot apply; export without it"
                )
            keep &= now - held["seen"] <= max_row_age_seconds
        tables[name] = TableRows(held["ids"][keep], held["rows"][keep])
    return Snapshot(manifest.step, assemble(plain), tables)


def export_delta(
    checkpoint_dir: str,
    step: int | None = None,
    *,
    min_row_norm: float | None = None,
    max_row_age_seconds: float | None = None,
    now: float | None = None,
) -> SnapshotUpdate:
    """The update a delta checkpoint makes to the serving snapshot: from the export of its
    parent to the export of its own step (:func:`export_checkpoint`, with the same thresholds).

    Its upserts are the rows the delta made or changed (and that pass the
    thresholds), its deletes the ids evicted since the parent (tombstones)
    and those the thresholds now leave out, its dense values the parameters
    that changed.

    Args:
        checkpoint_dir: the folder or fsspec URL of the checkpoints.
        step: the delta's step; None takes the last delta of the latest valid chain.

    Raises:
        CheckpointError: there is no such valid delta (``step`` names a full
            checkpoint, or the chain to it is broken).
        SnapshotError: a threshold is out of range (as for :func:`export_checkpoint`).
    """
    chain = checkpoint.read(checkpoint_dir, step)
    delta = chain.last
    if delta.parent is None:
        raise CheckpointError(
            f"checkpoint step {delta.step} in {checkpoint_dir} is a full checkpoint, not a delta: "
            f"export it whole with export_checkpoint"
        )
    now = time.time() if now is None else now
    thresholds = {"min_row_norm": min_row_norm, "max_row_age_seconds": max_row_age_seconds, "now": now}
    before = export_checkpoint(checkpoint_dir, delta.parent, **thresholds)
    return diff_snapshots(before, export_checkpoint(checkpoint_dir, delta.step, **thresholds))


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    return rows.flatten(1).to(torch.float64).norm(dim=1)


def _is_number(value: Any, minimum: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum

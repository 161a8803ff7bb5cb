"""Checkpoints, seen from the worker side.

Each ps task writes its own shard (variables, optimizer state, global step);
the chief commits the checkpoint by writing its manifest last (see
:mod:`psframe.checkpoint.files` for the format). :func:`load` reads the latest
valid checkpoint back as a plain ``state_dict``, with no cluster running::

    model.load_state_dict(psframe.checkpoint.load("ckpt/"), strict=False)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from psframe.checkpoint import files as checkpoint_io
from psframe.checkpoint.manifest import Manifest, ShardRecord
from psframe.checkpoint.slices import assemble
from psframe.errors import CheckpointError

__all__ = ["Manifest", "ShardRecord", "load", "save"]


class ShardWriter(Protocol):
    """What :func:`save` needs of a client: every ps task writes its shard (``PsClient.save``)."""

    def save(self, checkpoint_dir: str, step: int) -> Sequence[ShardRecord]: ...


def load(checkpoint_dir: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """The model parameters of a checkpoint, by parameter name.

    Args:
        checkpoint_dir: the folder or fsspec URL given to the trainer.
        step: which checkpoint; None takes the latest valid one (a corrupted
            newer one is reported and skipped).

    Returns:
        A ``state_dict`` of the trainable parameters, partitioned ones put
        back together. Buffers (e.g. BatchNorm statistics) are not on the ps
        tasks: load with ``strict=False``. A dynamic embedding table ``name``
        (:class:`psframe.DynamicEmbedding`, which has no fixed rows) comes as
        ``name.ids``, the ids it held (sorted), and ``name.rows``, their rows.

    Raises:
        CheckpointError: there is no such (valid) checkpoint.
    """
    if step is None:
        manifest = checkpoint_io.latest_valid(checkpoint_dir)
        if manifest is None:
            raise CheckpointError(f"no valid checkpoint in {checkpoint_dir}")
    else:
        found = [m for m in checkpoint_io.list_checkpoints(checkpoint_dir) if m.step == step]
        if not found:
            raise CheckpointError(f"no committed checkpoint of step {step} in {checkpoint_dir}")
        manifest = found[0]
    shards = [checkpoint_io.read_shard(manifest, k) for k in range(manifest.num_shards)]
    return assemble(shards)


def save(client: ShardWriter, checkpoint_dir: str, step: int, keep: int) -> Manifest:
    """Have every ps task write its shard of checkpoint ``step``, then commit it
    by writing the manifest and drop checkpoints beyond the newest ``keep``.

    A checkpoint of ``step`` that is already committed is returned as it is.

    Returns:
        The checkpoint's manifest.
    """
    for manifest in checkpoint_io.list_checkpoints(checkpoint_dir):
        if manifest.step == step:
            return manifest
    manifest = checkpoint_io.write_manifest(checkpoint_dir, step, client.save(checkpoint_dir, step))
    checkpoint_io.prune(checkpoint_dir, keep)
    return manifest

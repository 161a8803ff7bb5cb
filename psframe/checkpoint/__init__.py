"""Checkpoints, seen from the worker side.

Each ps task writes its own shard (variables, optimizer state, global step);
the chief commits the checkpoint by writing its manifest last (see
:mod:`psframe.checkpoint.files` for the format). Between full checkpoints,
deltas hold only what changed (:mod:`psframe.checkpoint.deltas`).
:func:`load` reads the latest valid checkpoint (a full one and the deltas
after it) back as a plain ``state_dict``, with no cluster running::

    model.load_state_dict(psframe.checkpoint.load("ckpt/"), strict=False)

The package also holds the formats beside checkpoints: the shard record
(:mod:`psframe.checkpoint.shard`), dynamic tables' rows
(:mod:`psframe.checkpoint.dynamic`), re-partitioning
(:mod:`psframe.checkpoint.slices`), atomic writes
(:mod:`psframe.checkpoint.atomic`), and whole files of named tensors in
safetensors format (:mod:`psframe.checkpoint.tensor_file`, which
:mod:`psframe.export` writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from psframe.checkpoint import files as checkpoint_io
from psframe.checkpoint.deltas import Chain, chain_at, commit_delta, latest_chain, require_parent
from psframe.checkpoint.manifest import Manifest, ShardRecord
from psframe.checkpoint.slices import assemble
from psframe.errors import CheckpointError

__all__ = ["Chain", "Manifest", "ShardRecord", "latest_chain", "load", "read", "save", "save_delta"]


class ShardWriter(Protocol):
    """What :func:`save` needs of a client: every ps task writes its shard (``PsClient.save``)."""

    @property
    def num_ps(self) -> int: ...

    def save(self, checkpoint_dir: str, step: int, parent: int | None = None) -> Sequence[ShardRecord]: ...


def load(checkpoint_dir: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """The model parameters of a checkpoint, by parameter name.

    Args:
        checkpoint_dir: the folder or fsspec URL given to the trainer.
        step: which checkpoint (full or delta: a delta is read through its
            chain, from the full checkpoint before it); where a full and a
            delta checkpoint of ``step`` are both committed (the chief saved a
            delta, then a full checkpoint, at one step), the full one, which
            holds the same values and needs no chain. None takes the latest
            valid one: the newest full checkpoint whose files verify, and the
            valid deltas after it (a corrupt checkpoint or delta is reported,
            and the one before it taken).

    Returns:
        A ``state_dict`` of the trainable parameters, partitioned ones put
        back together. Buffers (e.g. BatchNorm statistics) are not on the ps
        tasks: load with ``strict=False``. A dynamic embedding table ``name``
        (:class:`psframe.DynamicEmbedding`, which has no fixed rows) comes as
        ``name.ids``, the ids it held (sorted), and ``name.rows``, their rows.

    Raises:
        CheckpointError: there is no such (valid) checkpoint.
    """
    return assemble(read(checkpoint_dir, step).read_shards())


def read(checkpoint_dir: str, step: int | None = None) -> Chain:
    """The checkpoint of ``step`` (None: the latest valid one), as a full checkpoint and the deltas after it.

    ``step`` is taken as :func:`load` takes it: a full checkpoint of ``step`` where there is one
    (then no deltas), else the chain that ends at the delta of ``step``.

    Raises:
        CheckpointError: there is no such (valid) checkpoint.
    """
    if step is None:
        chain = latest_chain(checkpoint_dir)
        if chain is None:
            raise CheckpointError(f"no valid checkpoint in {checkpoint_dir}")
        return chain
    return chain_at(checkpoint_dir, step)


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


def save_delta(client: ShardWriter, checkpoint_dir: str, step: int, parent: int) -> Manifest:
    """Have every ps task write what changed since checkpoint ``parent`` (the last one
    committed), then commit the delta checkpoint ``step`` by writing its manifest.

    A delta of ``step`` that is already committed is returned as it is.

    Raises:
        CheckpointError: ``parent`` is no committed checkpoint, ``step`` does
            not follow it, it was written by another number of ps tasks (a
            re-layout since), or a ps task cannot write a delta from it (its
            variables were made or restored since): save a full checkpoint.
    """
    for manifest in checkpoint_io.list_checkpoints(checkpoint_dir, deltas=True):
        if manifest.step == step:
            return manifest
    require_parent(checkpoint_dir, step, parent, client.num_ps)  # before any ps task writes
    return commit_delta(checkpoint_dir, step, parent, client.save(checkpoint_dir, step, parent))

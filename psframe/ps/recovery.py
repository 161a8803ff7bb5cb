"""A ps task's part in checkpoints: writing its shard, and restoring from one.

The format itself (files, manifest, checksums) is :mod:`psframe.checkpoint.files`;
this module turns a :class:`VariableStore` into a shard and back, including
onto a different partitioning when the number of ps tasks changed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psframe.checkpoint import files as checkpoint_io
from psframe.checkpoint.slices import slice_rows
from psframe.optim import OptimizerSpec
from psframe.wire import psframe_pb2 as pb
from psframe.ps.store import VariableStore

log = logging.getLogger(__name__)

_DEF_FIELDS = ("name", "variable", "dtype", "shape", "full_shape", "row_start", "part_index", "num_parts")


@dataclass
class Restored:
    """What a ps task takes from a checkpoint."""

    step: int  # the checkpoint's id
    global_step: int
    defs: list[pb.VariableDef]
    optimizer: OptimizerSpec
    sync: pb.SyncDef | None
    values: dict[str, torch.Tensor]
    states: dict[str, dict]


def save_shard(store: VariableStore, defs: Sequence[pb.VariableDef], sync: pb.SyncDef | None,
               url: str, step: int, ps_task: int, num_shards: int) -> checkpoint_io.ShardRecord:
    """Write the store's variables, optimizer state and global step as one shard."""
    global_step, values, states = store.snapshot()  # copies, so pushes go on while it writes
    spec = store.optimizer_spec
    shard = {
        "format_version": checkpoint_io.FORMAT_VERSION,
        "global_step": global_step,
        "ps_task": ps_task,
        "num_shards": num_shards,
        "optimizer": {"name": spec.name, "kwargs": dict(spec.kwargs)},
        "sync": None if sync is None else {
            "replicas_to_aggregate": sync.replicas_to_aggregate,
            "total_num_replicas": sync.total_num_replicas,
            "timeout": sync.timeout_seconds,
        },
        "variables": [
            {**_def_to_dict(d), "value": values[d.name], "state": states[d.name]} for d in defs
        ],
    }
    return checkpoint_io.write_shard(url, step, ps_task, num_shards, shard)


def restore_own_shard(url: str, ps_task: int, num_ps: int) -> Restored | None:
    """This task's shard of the latest valid checkpoint, if it was made by as many ps tasks.

    With another number of ps tasks the shard boundaries moved, and only the
    chief knows the new ones: :func:`restore_onto` does that once it says.
    """
    manifest = checkpoint_io.latest_valid(url)
    if manifest is None or manifest.num_shards != num_ps:
        return None
    shard = checkpoint_io.read_shard(manifest, ps_task)
    sync = shard["sync"]
    return Restored(
        step=manifest.step,
        global_step=shard["global_step"],
        defs=[_def_from_dict(v) for v in shard["variables"]],
        optimizer=OptimizerSpec(shard["optimizer"]["name"], shard["optimizer"]["kwargs"]),
        sync=None if sync is None else pb.SyncDef(
            replicas_to_aggregate=sync["replicas_to_aggregate"],
            total_num_replicas=sync["total_num_replicas"],
            timeout_seconds=sync["timeout"],
        ),
        values={v["name"]: v["value"] for v in shard["variables"]},
        states={v["name"]: v["state"] for v in shard["variables"]},
    )


def restore_onto(url: str, defs: Sequence[pb.VariableDef], optimizer: OptimizerSpec
                 ) -> Restored | None:
    """The rows of the latest valid checkpoint that ``defs`` ask for, from whichever shards hold them.

    Optimizer state is kept only if the checkpoint ran the same optimizer.
    """
    manifest = checkpoint_io.latest_valid(url)
    if manifest is None:
        return None
    shards = [checkpoint_io.read_shard(manifest, k) for k in range(manifest.num_shards)]
    same_optimizer = shards[0]["optimizer"]["name"] == optimizer.name
    if not same_optimizer:
        log.warning("checkpoint %s ran %s, now %s: its optimizer state is not restored",
                    manifest.folder, shards[0]["optimizer"]["name"], optimizer.name)
    values, states = {}, {}
    for d in defs:
        value, state = slice_rows(shards, d.variable, d.row_start, d.row_start + d.shape[0])
        values[d.name] = value.reshape(tuple(d.shape))
        states[d.name] = state if same_optimizer else {}
    return Restored(
        step=manifest.step,
        global_step=min(s["global_step"] for s in shards),
        defs=list(defs),
        optimizer=optimizer,
        sync=None,
        values=values,
        states=states,
    )


def _def_to_dict(d: pb.VariableDef) -> dict:
    return {f: list(getattr(d, f)) if f in ("shape", "full_shape") else getattr(d, f) for f in _DEF_FIELDS}


def _def_from_dict(v: dict) -> pb.VariableDef:
    return pb.VariableDef(**{f: v[f] for f in _DEF_FIELDS})


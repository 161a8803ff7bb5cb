"""The Trainer's arguments: its optimizers resolved to what the ps tasks are sent,
and the keyword arguments of earlier releases turned into option groups, or refused.

Each names what it expected when it refuses: a wrong type, or two ways of
giving the same thing. (The wire dtype is resolved by the client, which
speaks the wire: :func:`psframe.worker.ps_client.resolve_wire_dtype`.)
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from typing import Any

from psframe.optim import SGD, OptimizerSpec, SyncReplicas, SyncReplicasOptimizer
from psframe.options import Checkpointing, Placement, Transport

# The Trainer's keyword arguments before the option groups: (group, its field).
DEPRECATED_ARGUMENTS: dict[str, tuple[str, str]] = {
    "placement": ("placement", "strategy"),  # a string then: "greedy" or "round_robin"
    "variable_devices": ("placement", "variable_devices"),
    "soft_placement": ("placement", "soft"),
    "min_partition_bytes": ("placement", "min_partition_bytes"),
    "max_shard_bytes": ("placement", "max_shard_bytes"),
    "table_partition": ("placement", "table_partition"),
    "log_placement": ("placement", "log"),
    "checkpoint_dir": ("checkpointing", "dir"),
    "save_checkpoint_steps": ("checkpointing", "save_steps"),
    "save_checkpoint_secs": ("checkpointing", "save_secs"),
    "keep_checkpoints": ("checkpointing", "keep"),
    "connect_timeout": ("transport", "connect_timeout"),
    "rpc_timeout": ("transport", "rpc_timeout"),
    "wire_dtype": ("transport", "wire_dtype"),
    "shared_memory": ("transport", "same_host_memory"),
}
_GROUP_CLASS = {"placement": Placement, "checkpointing": Checkpointing, "transport": Transport}


def groups_from_deprecated(
    placement: Placement | str | None,
    checkpointing: Checkpointing | None,
    transport: Transport | None,
    deprecated: MutableMapping[str, Any],
) -> tuple[Placement, Checkpointing | None, Transport]:
    """The Trainer's option groups, from the groups given or the keyword arguments they replace.

    Each deprecated argument warns once, naming its place in a group. A group
    given whole and one of its old arguments together are refused, and so is
    an argument the Trainer never took.

    Raises:
        TypeError: an unknown keyword argument, or a group and its old arguments both given.
    """
    if isinstance(placement, str):  # Trainer(placement="round_robin"), before the groups
        deprecated["placement"] = placement
        placement = None
    unknown = sorted(set(deprecated) - set(DEPRECATED_ARGUMENTS))
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument {unknown[0]!r}")
    given = {"placement": placement, "checkpointing": checkpointing, "transport": transport}
    fields: dict[str, dict[str, Any]] = {group: {} for group in given}
    for name, value in deprecated.items():
        group, field = DEPRECATED_ARGUMENTS[name]
        if value is None and name != "min_partition_bytes":  # None was the default: not given
            continue
        if given[group] is not None:
            raise TypeError(f"Trainer() got {group}= and {name}=, its old form: give {group}= only")
        warnings.warn(
            f"Trainer({name}=...) is deprecated and will be removed: give "
            f"{group}=psframe.{_GROUP_CLASS[group].__name__}({field}=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        fields[group][field] = value
    deprecated.clear()
    placement = placement or Placement(**fields["placement"])
    transport = transport or Transport(**fields["transport"])
    if checkpointing is None and fields["checkpointing"].get("dir"):
        checkpointing = Checkpointing(**fields["checkpointing"])
    for group, value in (("placement", placement), ("checkpointing", checkpointing), ("transport", transport)):
        if value is not None and not isinstance(value, _GROUP_CLASS[group]):
            raise TypeError(f"{group} must be a psframe.{_GROUP_CLASS[group].__name__}, got {type(value).__name__}")
    return placement, checkpointing, transport


def resolve_table_optimizer(
    table_optimizer: OptimizerSpec | None, optimizer: OptimizerSpec, tables: object
) -> OptimizerSpec | None:
    """The embedding tables' optimizer: the one given, or the row-by-row form of ``optimizer``; None without tables."""
    if not tables:
        return None
    if table_optimizer is None:
        return optimizer.for_tables()
    if not isinstance(table_optimizer, OptimizerSpec):
        raise TypeError(
            f"table_optimizer must be a psframe.optim spec such as psframe.optim.Adagrad(lr=0.1), "
            f"got {type(table_optimizer).__name__}"
        )
    return table_optimizer.for_tables()


def resolve_optimizer(
    optimizer: OptimizerSpec | SyncReplicasOptimizer | None, sync: SyncReplicas | None, num_workers: int
) -> tuple[OptimizerSpec, SyncReplicas | None, SyncReplicas | None]:
    """The server-side optimizer, the sync settings as given and as resolved for a cluster of
    ``num_workers`` (checked now; resolved again at connect if the ps tasks are elastic), from
    either way of giving them."""
    if isinstance(optimizer, SyncReplicasOptimizer):
        if sync is not None:
            raise ValueError("give either a SyncReplicasOptimizer or sync=SyncReplicas(...), not both")
        sync = optimizer.sync
        optimizer = optimizer.optimizer
    optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError(
            f"optimizer must be a psframe.optim spec such as psframe.optim.SGD(lr=0.1), "
            f"got {type(optimizer).__name__}; the ps tasks run the torch.optim optimizer"
        )
    return optimizer, sync, sync.resolve(num_workers) if sync is not None else None


def async_table_names(given: bool | tuple[str, ...], tables: list[str]) -> frozenset[str]:
    """The tables ``SyncReplicas(async_tables=...)`` names, as the model's table names
    (their weights' parameter names): every one for True; a module's name stands for its weight's.

    Raises:
        ValueError: a name that is no table of the model.
    """
    if given is True:
        return frozenset(tables)
    if given is False:
        return frozenset()
    found = set()
    for name in given:
        if name in tables:
            found.add(name)
        elif f"{name}.weight" in tables:
            found.add(f"{name}.weight")
        else:
            raise ValueError(
                f"SyncReplicas(async_tables=...) names {name!r}, which is no embedding table of the model; "
                f"its tables are {tables or 'none'}"
            )
    return frozenset(found)

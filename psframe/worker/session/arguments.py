"""The Trainer's arguments: its optimizers resolved to what the ps tasks are sent,
and its option groups checked.

Each names what it expected when it refuses: a wrong type, or two ways of
giving the same thing. (The wire dtype is resolved by the client, which
speaks the wire: :func:`psframe.worker.client.ps_client.resolve_wire_dtype`.)
"""

from __future__ import annotations

from psframe.config.options import Checkpointing, Placement, Transport
from psframe.optim import SGD, OptimizerSpec, SyncReplicas, SyncReplicasOptimizer

_GROUP_CLASS = {"placement": Placement, "checkpointing": Checkpointing, "transport": Transport}


def option_groups(
    placement: Placement | None, checkpointing: Checkpointing | None, transport: Transport | None
) -> tuple[Placement, Checkpointing | None, Transport]:
    """The Trainer's option groups, the defaults filled in (no checkpoints by default).

    Raises:
        TypeError: a group of another type (a string for ``placement``, say).
    """
    given = {"placement": placement, "checkpointing": checkpointing, "transport": transport}
    for group, value in given.items():
        if value is not None and not isinstance(value, _GROUP_CLASS[group]):
            expected = _GROUP_CLASS[group].__name__
            raise TypeError(f"Trainer({group}=...) must be a psframe.{expected}, got {type(value).__name__}")
    return placement or Placement(), checkpointing, transport or Transport()


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

"""The Trainer's optimizer arguments: resolved to what the ps tasks are sent, or refused.

Each names what it expected when it refuses: a wrong type, or two ways of
giving the same thing. (The wire dtype is resolved by the client, which
speaks the wire: :func:`psframe.worker.client.resolve_wire_dtype`.)
"""

from __future__ import annotations

from psframe.optim import SGD, OptimizerSpec, SyncReplicas, SyncReplicasOptimizer


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
) -> tuple[OptimizerSpec, SyncReplicas | None]:
    """The server-side optimizer and the resolved sync settings, from either way of giving them."""
    if isinstance(optimizer, SyncReplicasOptimizer):
        if sync is not None:
            raise ValueError("give either a SyncReplicasOptimizer or sync=SyncReplicas(...), not both")
        optimizer, sync = optimizer.optimizer, optimizer.sync
    optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
    if not isinstance(optimizer, OptimizerSpec):
        raise TypeError(
            f"optimizer must be a psframe.optim spec such as psframe.optim.SGD(lr=0.1), "
            f"got {type(optimizer).__name__}; the ps tasks run the torch.optim optimizer"
        )
    return optimizer, sync.resolve(num_workers) if sync is not None else None

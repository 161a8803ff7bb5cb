"""The Trainer's arguments: its optimizers resolved to what the ps tasks are sent,
and its option groups checked.

Each names what it expected when it refuses: a wrong type, or two ways of
giving the same thing. (The wire dtype is resolved by the client, which
speaks the wire: :func:`psframe.worker.client.ps_client.resolve_wire_dtype`.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from psframe.cluster import ClusterSpec
from psframe.config.options import BoundedStaleness, Checkpointing, Placement, Transport
from psframe.errors import ClusterSpecError
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


def resolve_cluster(cluster: ClusterSpec | Mapping[str, Sequence[str]], task_index: int) -> ClusterSpec:
    """The cluster a worker is given, checked: its task index, and ps tasks at ports of their own.

    Raises:
        ClusterSpecError: the cluster or task index is invalid, or a ps task's address has port 0.
    """
    cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
    cluster.validate_task("worker", task_index)
    if unbound := cluster.tasks_on_any_port("ps"):
        k = unbound[0]
        raise ClusterSpecError(
            f"{ClusterSpec.task_name('ps', k)} has address {cluster.task_address('ps', k)!r}: port 0 asks "
            f"its server to pick a free port, and a worker must be given the port it picked (the cluster of "
            f"the running server, psframe.Server(...).cluster, or psframe.local_cluster(...).cluster)"
        )
    return cluster


def resolve_rpc_timeout(rpc_timeout: float, sync: SyncReplicas | None, staleness: BoundedStaleness | None) -> float:
    """The deadline of each call: ``rpc_timeout``, raised to outlast a sync round's timeout, or
    the staleness bound's (a step may wait that long).

    Raises:
        TypeError: ``staleness`` of another type.
        ValueError: a staleness bound with ``sync``.
    """
    if sync is not None:
        # A call may wait at the barrier for as long as the sync timeout.
        rpc_timeout = max(rpc_timeout, sync.timeout + 30.0)
    if staleness is not None:
        if not isinstance(staleness, BoundedStaleness):
            raise TypeError(f"staleness must be a psframe.BoundedStaleness or None, got {type(staleness).__name__}")
        if sync is not None:
            raise ValueError(
                "staleness bounds asynchronous training; with sync every step waits for its round already "
                "(give one or the other)"
            )
        rpc_timeout = max(rpc_timeout, staleness.timeout + 30.0)  # a step may wait as long as the bound's timeout
    return rpc_timeout


def resolve_replica_devices(
    device: str | torch.device | None, replica_devices: Sequence[str | torch.device] | None
) -> tuple[str | torch.device | None, list[torch.device] | None]:
    """The device of the model and those of in-graph replication's replicas (the model's first).

    Raises:
        ValueError: ``device`` is not the first of ``replica_devices``.
    """
    if replica_devices is None:
        return device, None
    devices = [torch.device(d) for d in replica_devices]
    if device is not None and torch.device(device) != devices[0]:
        raise ValueError(f"device ({device}) must be the first of replica_devices ({devices}), or None")
    return (devices[0] if devices else None), devices


def resolve_async_tables(
    sync_given: SyncReplicas | None, sync: SyncReplicas | None, tables: list[str], num_workers: int
) -> tuple[frozenset[str], SyncReplicas | None, SyncReplicas | None]:
    """The tables synchronous training applies at once (variable names), and the sync settings
    as given and as resolved, naming them so.

    Raises:
        ValueError: ``async_tables`` names no table of the model.
    """
    if sync_given is None or not sync_given.async_tables:
        return frozenset(), sync_given, sync
    names = async_table_names(sync_given.async_tables, tables)
    sync_given = dataclasses.replace(sync_given, async_tables=tuple(sorted(names)))
    return names, sync_given, sync_given.resolve(num_workers)

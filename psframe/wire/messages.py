"""psframe's settings as wire messages, and the checks that two tasks agree on them.

The optimizer, the sync settings and the variables' definitions travel in
``InitHeader`` and come back in ``TaskInfo`` (read as a plain
:class:`~psframe.status.TaskStatus`); this module converts them, and
holds the one check that a worker's model (or a chief's request) matches
what a ps task holds, used by both sides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from psframe.cluster import ClusterSpec
from psframe.cluster.placement import Shard
from psframe.errors import ClusterMismatchError, WireFormatError
from psframe.optim import KwargValue, OptimizerSpec, SyncReplicas
from psframe.status import TaskStatus
from psframe.tables.spec import Admission, DynamicTableSpec, Eviction, RowInitializer
from psframe.wire import psframe_pb2 as pb
from psframe.wire import schedule_defs
from psframe.wire.dtypes import check_shape, dtype_from_name, dtype_name
from psframe.wire.task_info import status_without_settings

# The most elements a variable a chief defines may declare: far beyond any ps
# task's memory, and far from where torch's size arithmetic overflows. (Tensors
# on the wire are capped lower, by their message: dtypes.MAX_ELEMENTS.)
MAX_VARIABLE_ELEMENTS = 2**40


def optimizer_to_proto(spec: OptimizerSpec) -> pb.OptimizerDef:
    """The wire form of an optimizer spec."""
    message = pb.OptimizerDef(name=spec.name)
    schedule_defs.put_values(message.kwargs, spec.kwargs)
    if spec.schedule is not None:
        message.schedule.CopyFrom(schedule_defs.schedule_to_proto(spec.schedule))
    return message


def optimizer_from_proto(message: pb.OptimizerDef) -> OptimizerSpec:
    """The optimizer spec of a wire message (validated again on arrival).

    Raises:
        OptimizerConfigError: the name or arguments are not acceptable.
    """
    kwargs: dict[str, KwargValue] = {
        key: held for key, value in message.kwargs.items() if (held := schedule_defs.value_of(value)) is not None
    }
    schedule = schedule_defs.schedule_from_proto(message.schedule) if message.HasField("schedule") else None
    return OptimizerSpec(message.name, kwargs, schedule)


def sync_def(sync: SyncReplicas | None) -> pb.SyncDef | None:
    """The wire form of (resolved) sync settings; None for asynchronous training."""
    if sync is None:
        return None
    return pb.SyncDef(
        replicas_to_aggregate=sync.replicas_to_aggregate or 0,
        total_num_replicas=sync.total_num_replicas or 0,
        timeout_seconds=sync.timeout,
        fraction_to_aggregate=sync.fraction_to_aggregate or 0.0,
        async_tables=sorted(sync.async_tables) if isinstance(sync.async_tables, tuple) else [],
    )


def sync_from_def(sync: pb.SyncDef) -> SyncReplicas:
    """The settings a ``SyncDef`` carries (an elastic cluster's: a fraction or a cap, no total)."""
    return SyncReplicas(
        sync.replicas_to_aggregate or None,
        sync.total_num_replicas or None,
        sync.timeout_seconds,
        sync.fraction_to_aggregate or None,
        tuple(sync.async_tables) or False,
    )


def describe_sync(sync: pb.SyncDef | None) -> str:
    if sync is None:
        return "asynchronous updates"
    tables = f", tables applied at once: {list(sync.async_tables)}" if sync.async_tables else ""
    return _describe_counts(sync).replace(")", f"{tables})", 1)


def _describe_counts(sync: pb.SyncDef) -> str:
    if not sync.total_num_replicas:
        count = (
            f"fraction_to_aggregate={sync.fraction_to_aggregate:g}"
            if sync.fraction_to_aggregate
            else f"replicas_to_aggregate={sync.replicas_to_aggregate}"
        )
        return f"SyncReplicas({count} of the live workers, timeout={sync.timeout_seconds:g}s)"
    return (
        f"SyncReplicas(replicas_to_aggregate={sync.replicas_to_aggregate}, "
        f"total_num_replicas={sync.total_num_replicas}, timeout={sync.timeout_seconds:g}s)"
    )


def variable_def(shard: Shard, dtype: torch.dtype, full_shape: Sequence[int]) -> pb.VariableDef:
    """The definition of a stored shard of a parameter of ``dtype`` and ``full_shape``."""
    return pb.VariableDef(
        name=shard.name,
        variable=shard.variable,
        dtype=dtype_name(dtype),
        shape=shard.shape,
        full_shape=tuple(full_shape),
        row_start=shard.row_start,
        part_index=shard.part_index,
        num_parts=shard.num_parts,
        row_stride=shard.row_stride if shard.row_stride > 1 else 0,  # 0: contiguous, as before strides
        table=shard.table,
        dynamic=None if shard.dynamic is None else dynamic_def(shard.dynamic),
    )


def dynamic_def(spec: DynamicTableSpec) -> pb.DynamicTableDef:
    """The wire form of a dynamic table's initializer, eviction and admission."""
    init, eviction, admission = spec.initializer, spec.eviction, spec.admission
    return pb.DynamicTableDef(
        distribution=init.distribution,
        mean=init.mean,
        std=init.std,
        low=init.low,
        high=init.high,
        value=init.value,
        seed=init.seed,
        max_rows=eviction.max_rows or 0,
        policy=eviction.policy,
        max_age=eviction.max_age or 0,
        ttl_seconds=eviction.ttl_seconds or 0.0,
        min_norm=eviction.min_norm or 0.0,
        admit_after=admission.min_count,
        admit_probability=admission.probability,
        admission_counters=admission.counters,
        row_storage=spec.storage or "",
        ram_budget=spec.ram_budget or 0,
    )


def dynamic_spec(definition: pb.DynamicTableDef) -> DynamicTableSpec:
    """A dynamic table's initializer, eviction, admission and row storage from their wire form (0, "": the default).

    Raises:
        PlacementError: a distribution or policy psframe does not know, or a bad value.
    """
    d = definition
    return DynamicTableSpec(
        RowInitializer(d.distribution, mean=d.mean, std=d.std, low=d.low, high=d.high, value=d.value, seed=d.seed),
        Eviction(
            max_rows=d.max_rows or None,
            policy=d.policy,
            max_age=d.max_age or None,
            ttl_seconds=d.ttl_seconds or None,
            min_norm=d.min_norm or None,
        ),
        Admission(
            min_count=d.admit_after or 1,
            probability=d.admit_probability or 1.0,
            counters=d.admission_counters or Admission.counters,
        ),
        storage=d.row_storage or None,
        ram_budget=d.ram_budget or None,
    )


def variable_defs(slots: Iterable[Any]) -> list[pb.VariableDef]:
    """The definitions of shards bound to local parameters (anything with ``.shard`` and ``.param``)."""
    return [variable_def(s.shard, s.param.dtype, s.param.shape) for s in slots]


VariableKey = tuple[str, str, tuple[int, ...]]  # name, dtype name, shape


def keys_of_defs(defs: Iterable[pb.VariableDef]) -> list[VariableKey]:
    return [(d.name, d.dtype, tuple(d.shape)) for d in defs]


def check_same_variables(where: str, expected: Sequence[VariableKey], found: Sequence[VariableKey]) -> None:
    """The check that a worker and a ps task hold the same model: the same variables, by name, dtype and shape.

    Used by a worker against each ps task (:func:`~psframe.worker.client.control_calls.check_model`); a ps
    task checks a chief's request to create what it holds already in its store
    (:meth:`psframe.ps.store.store_model.StoreModel.check_same`).

    Raises:
        ClusterMismatchError: ``where`` (e.g. "A does not match B") and the first differences.
    """
    if sorted(expected) == sorted(found):
        return
    diff = sorted(set(expected) ^ set(found))[:4]
    raise ClusterMismatchError(
        f"{where}: {len(expected)} variables expected, {len(found)} found; "
        f"differences (name, dtype, shape): {diff} (every worker must build the same model "
        f"with the same placement options)"
    )


def check_same_sync(where: str, expected: pb.SyncDef | None, found: pb.SyncDef | None) -> None:
    """Check two tasks train with the same sync settings.

    Raises:
        ClusterMismatchError: naming both settings.
    """
    if expected != found:
        raise ClusterMismatchError(
            f"{where}: {describe_sync(expected)} expected, {describe_sync(found)} found "
            f"(every worker must pass the same sync settings)"
        )


def task_status(info: pb.TaskInfo) -> TaskStatus:
    """A task's ``TaskInfo`` as the plain :class:`~psframe.status.TaskStatus` its callers read,
    settings included (:func:`psframe.wire.task_info.status_without_settings` reads the rest)."""
    return dataclasses.replace(
        status_without_settings(info),
        optimizer=optimizer_from_proto(info.optimizer) if info.HasField("optimizer") else None,
        table_optimizer=optimizer_from_proto(info.table_optimizer) if info.HasField("table_optimizer") else None,
        sync=sync_from_def(info.sync) if info.HasField("sync") else None,
    )


SAME_CLUSTER = (
    "give every task the same cluster (the same --ps_hosts and --worker_hosts, or --cluster_spec, in the same order)"
)
"""What to do about tasks given different clusters, for the errors that find them."""


def check_identity(info: TaskStatus, cluster: ClusterSpec, job_name: str, task_index: int, address: str) -> None:
    """Check that the task answering at ``address`` is the one ``cluster`` puts there.

    An elastic ps task (``max_workers``) is of the same cluster as one with the
    same ps tasks and more workers, up to its ``max_workers``.

    Raises:
        ClusterMismatchError: it is another task, or of another cluster.
    """
    same = info.cluster_spec == cluster.to_string() or (
        info.max_workers is not None
        and cluster.num_workers <= info.max_workers
        and ClusterSpec.from_string(info.cluster_spec).ps_fingerprint == cluster.ps_fingerprint
    )
    if (info.job_name, info.task_index) != (job_name, task_index) or not same:
        hint = ""
        if info.cluster_spec and ClusterSpec.from_string(info.cluster_spec).ps_fingerprint == cluster.ps_fingerprint:
            slots = f"only {info.max_workers} worker slots" if info.max_workers else "no slots for joining workers"
            hint = (
                f" (the same ps tasks, but {ClusterSpec.task_name(info.job_name, info.task_index)} has {slots}: "
                f"for workers to join a running job, start the ps tasks with max_workers / --max_workers)"
            )
        raise ClusterMismatchError(
            f"{address} should be {ClusterSpec.task_name(job_name, task_index)} of cluster "
            f"{cluster.to_string()!r}, but it is {ClusterSpec.task_name(info.job_name, info.task_index)} "
            f"of cluster {info.cluster_spec!r}; {SAME_CLUSTER}{hint}"
        )


def check_initial_value(owner: str, definition: pb.VariableDef | None, name: str, value: torch.Tensor) -> None:
    """Check an initial value the chief sent against the variable's definition.

    Raises:
        WireFormatError: no such variable was defined, or the value's dtype or shape differs.
    """
    if definition is None:
        raise WireFormatError(f"initial value for {name!r} sent to {owner}, which was not told of that variable")
    if dtype_name(value.dtype) != definition.dtype or tuple(value.shape) != tuple(definition.shape):
        raise WireFormatError(
            f"initial value for {name!r} is {dtype_name(value.dtype)}{tuple(value.shape)}, "
            f"expected {definition.dtype}{tuple(definition.shape)}"
        )


def check_definitions(
    owner: str, defs: Sequence[pb.VariableDef], sync: pb.SyncDef | None, num_workers: int, *, elastic: bool = False
) -> None:
    """Check the variables and sync settings a chief's request declares, before anything is made of them.

    ``elastic``: the ps task takes workers joining and leaving, whose sync settings count the live workers.

    Raises:
        WireFormatError: a dtype that cannot travel, an absurd shape (see
            :func:`psframe.wire.dtypes.check_shape`), or sync settings no
            :class:`~psframe.optim.SyncReplicas` of this cluster has.
    """
    for d in defs:
        dtype_from_name(d.dtype)
        check_shape(f"variable {d.name!r} sent to {owner}", d.shape, MAX_VARIABLE_ELEMENTS)
        check_shape(f"the full shape of variable {d.name!r} sent to {owner}", d.full_shape, MAX_VARIABLE_ELEMENTS)
    if sync is None:
        return
    r, n, timeout = sync.replicas_to_aggregate, sync.total_num_replicas, sync.timeout_seconds
    fraction = sync.fraction_to_aggregate
    if elastic:
        if n == 0 and 0 < timeout < math.inf and ((0 < fraction <= 1 and r == 0) or (fraction == 0 and r >= 1)):
            return
        raise WireFormatError(
            f"sync settings sent to {owner} are replicas_to_aggregate={r}, total_num_replicas={n}, "
            f"fraction_to_aggregate={fraction}, timeout={timeout}s; {owner} takes workers joining and "
            f"leaving (max_workers), so expected total_num_replicas 0 (the live workers), "
            f"fraction_to_aggregate in (0, 1] or replicas_to_aggregate >= 1 (one of them), and a finite timeout > 0"
        )
    if not (1 <= r <= n == num_workers and fraction == 0 and 0 < timeout < math.inf):
        raise WireFormatError(
            f"sync settings sent to {owner} are replicas_to_aggregate={r}, total_num_replicas={n}, "
            f"timeout={timeout}s; expected 1 <= replicas_to_aggregate <= total_num_replicas = {num_workers} "
            f"(the cluster's workers) and a finite timeout > 0"
        )

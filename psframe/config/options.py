"""A worker's option groups: where variables go, checkpoints, and the transport.

Each group is a frozen dataclass checked when it is made, so a bad value
fails where it was written, with the value and what was expected::

    trainer = psframe.Trainer(
        model, cluster, task_index,
        placement=psframe.Placement(max_shard_bytes=8 << 20),
        checkpointing=psframe.Checkpointing("s3://bucket/run", save_steps=1000),
        transport=psframe.Transport(wire_dtype="bfloat16"),
    )

``psframe.Security`` and ``psframe.Liveness`` are groups of the same kind,
accepted whole by ``Trainer`` and ``Server``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from psframe.cluster.placement import DEFAULT_MAX_SHARD_BYTES, DEFAULT_MIN_PARTITION_BYTES

STRATEGIES = ("greedy", "round_robin")
DEFAULT_KEEP_CHECKPOINTS = 5
TABLE_PARTITIONS = ("mod", "range")
WIRE_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class Placement:
    """Which ps task holds each variable (TF's ``replica_device_setter``).

    Args:
        strategy: ``"greedy"`` (balance the bytes per ps task, the default) or
            ``"round_robin"``.
        variable_devices: explicit TF device strings for some parameters,
            e.g. ``{"embedding.weight": "/job:ps/task:1"}``; they win.
        soft: fall back to automatic placement, with a warning, when an
            explicit device names a ps task that does not exist (TF's
            ``allow_soft_placement``).
        min_partition_bytes: parameters larger than this are partitioned along
            dim 0 across the ps tasks; None never partitions for balance.
        dense_parts: cut every parameter so partitioned into this many parts
            whatever the number of ps tasks (TF's ``fixed_size_partitioner``
            with a fixed ``num_shards``), dealt among them as ``table_parts``
            are; None (the default): one part per ps task. With a fixed number,
            adding or draining ps tasks while training moves parts whole, a few
            a stage, none cut anew: the pause of a stage is that of its parts'
            bytes alone (:mod:`psframe.cluster.moves`).
        max_shard_bytes: no stored part is larger than this (one message).
        table_partition: how an embedding table's rows are shared out among
            the ps tasks: ``"mod"`` (row ``i`` on ps task ``i % P``, the default:
            frequent ids spread whatever their numbering) or ``"range"``.
        table_parts: cut every embedding table (fixed or dynamic) into this many
            parts whatever the number of ps tasks, dealt among them so that a ps
            task added takes only its share from the others
            (:func:`psframe.tables.spec.part_owners`); None (the
            default): one part per ps task. With a fixed number, adding
            or draining ps tasks while training moves a table part by part, a few
            parts a stage, instead of cutting it anew in one stage
            (:mod:`psframe.cluster.moves`). A multiple of the ps task counts the
            job will run on keeps the tables balanced (12: 2, 3, 4 or 6 tasks).
        log: log where each parameter went and the bytes per ps task.

    Raises:
        ValueError: a name or size out of range.
    """

    strategy: str = "greedy"
    variable_devices: Mapping[str, str] = field(default_factory=dict)
    soft: bool = False
    min_partition_bytes: int | None = DEFAULT_MIN_PARTITION_BYTES
    dense_parts: int | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    table_partition: str = "mod"
    table_parts: int | None = None
    log: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.table_partition not in TABLE_PARTITIONS:
            raise ValueError(f"table_partition must be one of {TABLE_PARTITIONS}, got {self.table_partition!r}")
        _check_int("max_shard_bytes", self.max_shard_bytes, minimum=1)
        if self.table_parts is not None:
            _check_int("table_parts", self.table_parts, minimum=1)
        if self.dense_parts is not None:
            _check_int("dense_parts", self.dense_parts, minimum=1)
        if self.min_partition_bytes is not None:
            _check_int("min_partition_bytes", self.min_partition_bytes, minimum=0)
        devices = dict(self.variable_devices or {})
        for name, device in devices.items():
            if not isinstance(name, str) or not isinstance(device, str):
                raise ValueError(
                    f"variable_devices maps parameter names to TF device strings, got {name!r}: {device!r}"
                )
        object.__setattr__(self, "variable_devices", devices)


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often the chief saves checkpoints (TF's ``CheckpointSaverHook``).

    Args:
        dir: a folder or any fsspec URL (``memory://``, ``s3://``,
            ``hdfs://`` where installed). A ps task that restarts restores its
            shard from the latest valid checkpoint there.
        save_steps: save every this many global steps;
        save_secs: or every this many seconds (600 when neither is given).
            The chief also saves at the end.
        keep: how many of the newest checkpoints are kept (the deltas after
            the oldest one kept are kept with it).
        delta_steps: between full checkpoints, commit a delta checkpoint
            every this many global steps: only the variables, table rows
            and optimizer state that changed since the last checkpoint,
            and the ids evicted (:mod:`psframe.checkpoint.deltas`);
        delta_secs: or every this many seconds (None for both: no deltas).
            A restore reads the full checkpoint and the deltas after it.

    Raises:
        ValueError: an empty ``dir``, both intervals of a kind, or a count out of range.
    """

    dir: str
    save_steps: int | None = None
    save_secs: float | None = None
    keep: int = DEFAULT_KEEP_CHECKPOINTS
    delta_steps: int | None = None
    delta_secs: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError(f"Checkpointing needs a folder or URL, got {self.dir!r}")
        if self.save_steps is not None and self.save_secs is not None:
            raise ValueError(f"give save_steps or save_secs, not both (got {self.save_steps} and {self.save_secs})")
        if self.save_steps is not None:
            _check_int("save_steps", self.save_steps, minimum=1)
        if self.save_secs is not None and not 0 < self.save_secs < math.inf:
            raise ValueError(f"save_secs must be a finite number of seconds > 0, got {self.save_secs!r}")
        _check_int("keep", self.keep, minimum=1)
        if self.delta_steps is not None and self.delta_secs is not None:
            raise ValueError(f"give delta_steps or delta_secs, not both (got {self.delta_steps} and {self.delta_secs})")
        if self.delta_steps is not None:
            _check_int("delta_steps", self.delta_steps, minimum=1)
        if self.delta_secs is not None and not 0 < self.delta_secs < math.inf:
            raise ValueError(f"delta_secs must be a finite number of seconds > 0, got {self.delta_secs!r}")

    @property
    def interval(self) -> tuple[int | None, float | None]:
        """``(save_steps, save_secs)``, with the 600 s default filled in."""
        if self.save_steps is None and self.save_secs is None:
            return None, 600.0
        return self.save_steps, self.save_secs


@dataclass(frozen=True)
class Transport:
    """How a worker talks to the ps tasks.

    Args:
        connect_timeout: seconds to wait for the ps tasks (and for the chief to
            create the model) before giving up with an error naming them.
        rpc_timeout: seconds each call may take once connected (in sync
            training at least the barrier's timeout plus 30 s).
        wire_dtype: optional compression of what travels each step:
            ``"bfloat16"`` (or ``torch.bfloat16``) or ``"float16"``. Float32
            gradients are sent, and parameters received, in that dtype: half
            the bytes. The ps keeps and updates its variables in their own
            dtype, and the local model keeps its dtype too; only the values
            exchanged are rounded. bfloat16 keeps float32's range; float16
            keeps more mantissa but gradients below ~6e-8 become zero. None
            (the default, or ``"float32"``) sends everything exactly as stored.
        same_host_memory: the tensors of every step exchanged with a ps task
            on this worker's host travel through shared memory (``/dev/shm``)
            and gRPC carries the headers: one copy each way instead of about
            five (on by default; ps tasks on other hosts, and hosts without
            ``/dev/shm``, use messages).

    Raises:
        ValueError: a timeout that is not a finite number > 0, or another wire dtype.
    """

    connect_timeout: float = 120.0
    rpc_timeout: float = 300.0
    wire_dtype: str | None = None
    same_host_memory: bool = True

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "rpc_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        object.__setattr__(self, "wire_dtype", _wire_dtype_name(self.wire_dtype))


@dataclass(frozen=True)
class BoundedStaleness:
    """Asynchronous training with a bound on how far a worker may run ahead (SSP, stale synchronous parallel).

    A worker may be at most ``steps`` steps ahead of the slowest live worker:
    each ps task answers the push that ends a worker's step once that holds
    on it (the push itself is applied at once, as in asynchronous training).
    ``steps=0`` steps every worker in lockstep, each update still a worker's
    own (synchronous training without averaging); a large bound is
    asynchronous training. A worker that finished, or has been silent past
    the ps task's ``worker_timeout`` (lost), is no longer waited for. Each
    ps task counts how many steps ahead every push found its worker
    (``psframe status``); ``psframe.Trainer.stats.steps_ahead`` and
    ``TensorBoardHook`` give a worker's own.

    Args:
        steps: the most steps a worker may be ahead of the slowest.
        timeout: the longest one step waits; past it the step fails with
            ``BarrierTimeoutError``, naming the workers it waited for (its
            gradients were applied: a step sent again is not applied twice).

    Raises:
        ValueError: a negative bound, or a timeout that is not a positive number of seconds.
    """

    steps: int
    timeout: float = 300.0

    def __post_init__(self) -> None:
        _check_int("steps", self.steps, minimum=0)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < 1e9:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")


@dataclass(frozen=True)
class DataRanges:
    """A data set every worker reads in ranges handed out by a ps task, so that each example
    of each epoch is trained on once, whoever joins, leaves or dies (:meth:`psframe.Trainer.read`).

    The examples are numbered ``0..num_examples-1``; each epoch takes them in an order
    drawn from ``seed`` (the same on every worker), cut into ranges of ``range_size``.
    A worker asks the ps task that keeps the queue for a range, trains on its batches
    of ``batch_size`` in order, and each step's push says how far it got: an example
    counts as consumed exactly when the update that trained on it is applied (and a
    checkpoint keeps that, with the values). A range of a worker that finished early
    or was presumed dead goes back to the queue, from where it got to; a worker that
    starts again under its index goes on with its own. The data set ends once every
    example of every epoch was consumed: a worker asking while the last ranges are out
    with live workers waits (they may die), for ``timeout`` seconds at most.

    Args:
        name: the data set's name (several may be read, one after the other or at once).
        num_examples: examples in one epoch.
        batch_size: examples a step.
        range_size: examples a range (default: 16 batches); smaller ranges spread the
            last examples over more workers, larger ones ask the ps task less often.
        epochs: passes over the data.
        shuffle: draw each epoch's order from ``seed`` (else 0, 1, 2...).
        seed: the order's seed.
        timeout: the longest a worker waits for others' ranges to be consumed.

    Raises:
        ValueError: a count that is not a positive int, an empty name, or a bad timeout.
    """

    name: str
    num_examples: int
    batch_size: int
    range_size: int | None = None
    epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    timeout: float = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for name in ("num_examples", "batch_size", "epochs"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.range_size is not None:
            _check_int("range_size", self.range_size, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < 1e9:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")

    @property
    def examples_per_range(self) -> int:
        """``range_size``, or 16 batches by default."""
        return self.range_size if self.range_size is not None else 16 * self.batch_size


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _wire_dtype_name(dtype: Any) -> str | None:
    """``"bfloat16"``, ``"float16"`` or None, from a name or a torch dtype (read by its name:
    this layer does not import torch)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    if name == "float32":  # as stored: no compression
        return None
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES} or None, got {dtype!r}")
    return name


__all__ = ["BoundedStaleness", "Checkpointing", "DataRanges", "Placement", "Transport"]

"""Where each model parameter lives among the ps tasks.

The chief worker calls :func:`place` once with the size of every parameter and
the number of ps tasks. A parameter larger than ``min_partition_bytes`` is
partitioned along dim 0 into one part per ps task (TF's
``fixed_size_partitioner`` rule: with R rows and P parts the first ``R % P``
parts get one extra row), and any parameter is cut into more parts when needed
so that no part is larger than ``max_shard_bytes`` (TF's
``variable_axis_size_partitioner``): a part has to fit in one gRPC message.

Parts are then assigned to ps tasks: an explicit TF device string
(``"/job:ps/task:1"``) wins; the rest go greedily by bytes (the default) or
round robin. Placement works on sizes only and never imports torch::

    infos = [VariableInfo(n, tuple(p.shape), p.element_size())
             for n, p in model.named_parameters()]
    placement = place(infos, num_ps=2)
    print(placement.describe())
"""

from __future__ import annotations

import heapq
import logging
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from psframe.cluster.spec import ClusterSpec
from psframe.errors import PlacementError

MiB = 1 << 20
DEFAULT_MIN_PARTITION_BYTES = 16 * MiB  # above this a variable is split across the ps tasks
# No part larger than this (unless a single row is larger). Parts travel as
# messages of about this size: gRPC in Python moves 4 MiB messages several
# times faster than 64 MiB ones, and the ps never buffers more than a few.
DEFAULT_MAX_SHARD_BYTES = 4 * MiB
HARD_MAX_SHARD_BYTES = 2**31 - 64 * MiB  # one gRPC message: a larger single row cannot be sent

STRATEGIES = ("greedy", "round_robin")

logger = logging.getLogger(__name__)


def _ps_device(task: int) -> str:
    return ClusterSpec.task_name("ps", task)


@dataclass(frozen=True)
class VariableInfo:
    """The size of one model parameter, as placement needs it.

    Args:
        name: The parameter's name (e.g. from ``model.named_parameters()``).
        shape: Its shape; any sequence of non-negative ints (``torch.Size`` works).
        itemsize: Bytes per element (``tensor.element_size()``).
        device: An explicit TF device string such as ``"/job:ps/task:1"``, or
            None to let :func:`place` choose.

    Raises:
        PlacementError: The name is empty, a dimension is negative or not an
            int, or itemsize is not a positive int.
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    device: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlacementError(f"variable name must be a non-empty string, got {self.name!r}")
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError as e:
            raise PlacementError(f"variable {self.name!r}: shape must be a sequence of ints, got {self.shape!r}") from e
        if any(d < 0 for d in shape):
            raise PlacementError(f"variable {self.name!r}: dimensions must be >= 0, got shape {shape}")
        object.__setattr__(self, "shape", shape)
        if isinstance(self.itemsize, bool) or not isinstance(self.itemsize, int) or self.itemsize <= 0:
            raise PlacementError(f"variable {self.name!r}: itemsize must be a positive int, got {self.itemsize!r}")
        if self.device is not None and not isinstance(self.device, str):
            raise PlacementError(f"variable {self.name!r}: device must be a string or None, got {self.device!r}")

    @property
    def nbytes(self) -> int:
        """Total size in bytes."""
        return math.prod(self.shape) * self.itemsize

    @property
    def rows(self) -> int:
        """Length of dim 0 (1 for a 0-d tensor): the axis that is partitioned."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """Bytes in one row along dim 0 (the whole tensor for a 0-d one)."""
        return math.prod(self.shape[1:]) * self.itemsize


@dataclass(frozen=True)
class Shard:
    """One stored piece of a variable on one ps task.

    ``name`` is the variable's name, or ``f"{variable}/part_{i}"`` when the
    variable is partitioned. The shard holds rows ``[row_start, row_end)`` of
    dim 0 of the variable (``0, 1`` for a 0-d tensor), every ``row_stride``-th
    one: an embedding table shared out by id modulo its number of parts
    (:func:`psframe.tables.spec.place_tables`) has ``row_stride``
    = ``num_parts``; every other shard holds contiguous rows. ``table``
    marks an embedding table's part, which travels row by row.
    """

    name: str
    variable: str
    ps_task: int
    row_start: int
    row_end: int
    shape: tuple[int, ...]
    nbytes: int
    part_index: int = 0
    num_parts: int = 1
    row_stride: int = 1
    table: bool = False
    dynamic: Any = None  # a dynamic table part: its DynamicTableSpec (psframe.tables.spec)

    @property
    def partitioned(self) -> bool:
        """True when the variable is split into more than one part."""
        return self.num_parts > 1

    @property
    def device(self) -> str:
        """The TF device string of the ps task holding this shard."""
        return _ps_device(self.ps_task)


@dataclass(frozen=True)
class ShardPlacement:
    """The result of :func:`place`: every shard and the ps task holding it.

    ``shards`` are in variable order, then part order.
    """

    num_ps: int
    shards: tuple[Shard, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.num_ps < 1:
            raise PlacementError(f"num_ps must be >= 1, got {self.num_ps}")
        for s in self.shards:
            if not 0 <= s.ps_task < self.num_ps:
                raise PlacementError(f"shard {s.name!r} is on ps task {s.ps_task}, expected 0..{self.num_ps - 1}")

    def shards_on(self, ps_task: int) -> list[Shard]:
        """The shards held by one ps task, in placement order.

        Args:
            ps_task: Index of the ps task.

        Returns:
            Its shards (possibly none).

        Raises:
            PlacementError: ``ps_task`` is not in ``0..num_ps-1``.
        """
        if not 0 <= ps_task < self.num_ps:
            raise PlacementError(f"ps_task must be in 0..{self.num_ps - 1}, got {ps_task}")
        return [s for s in self.shards if s.ps_task == ps_task]

    def shards_of(self, variable: str) -> list[Shard]:
        """The shards of one variable in part order; empty if it was not placed.

        Args:
            variable: The variable's name.

        Returns:
            Its shards, ``part_index`` 0, 1, ...
        """
        return [s for s in self.shards if s.variable == variable]

    def bytes_per_ps(self) -> list[int]:
        """Returns the bytes held by each ps task, indexed by task."""
        load = [0] * self.num_ps
        for s in self.shards:
            load[s.ps_task] += s.nbytes
        return load

    def describe(self) -> str:
        """A human-readable table of the placement (for ``--log_placement``).

        Returns:
            One line per shard (``name -> /job:ps/task:i  (shape, bytes)``),
            then the bytes and shard count of each ps task and the imbalance
            (largest load over mean load; 1.00 is perfectly balanced).
        """
        lines = [f"placement of {len(self.shards)} shards on {self.num_ps} ps tasks:"]
        width = max((len(s.name) for s in self.shards), default=0)
        for s in self.shards:
            lines.append(f"  {s.name:<{width}} -> {s.device}  (shape={s.shape}, {s.nbytes} bytes)")
        load = self.bytes_per_ps()
        for task, nbytes in enumerate(load):
            count = sum(1 for s in self.shards if s.ps_task == task)
            lines.append(f"  {_ps_device(task)}: {nbytes} bytes ({nbytes / MiB:.2f} MiB), {count} shards")
        total = sum(load)
        imbalance = max(load) / (total / self.num_ps) if total else 1.0
        lines.append(f"  total {total} bytes, imbalance (max/mean) {imbalance:.2f}")
        return "\n".join(lines)


def _partitioned(var: VariableInfo, min_partition_bytes: int | None) -> bool:
    """Whether ``var`` is partitioned for balance (spread over the ps tasks), not only for size."""
    return min_partition_bytes is not None and var.nbytes > min_partition_bytes and var.rows > 1


def _num_parts(
    var: VariableInfo, num_ps: int, min_partition_bytes: int | None, max_shard_bytes: int, dense_parts: int | None
) -> int:
    """How many parts ``var`` is cut into along dim 0: one per ps task (or ``dense_parts``) when
    partitioned for balance, and as many as ``max_shard_bytes`` needs."""
    if var.row_bytes > HARD_MAX_SHARD_BYTES:
        raise PlacementError(
            f"variable {var.name!r}: one row along dim 0 is {var.row_bytes} bytes "
            f"(shape {var.shape}, itemsize {var.itemsize}), but a shard must fit in one "
            f"gRPC message of at most {HARD_MAX_SHARD_BYTES} bytes; reshape it so that "
            f"dim 0 is longer"
        )
    if not var.shape or var.rows <= 1 or var.nbytes == 0:
        return 1
    parts = 1
    if _partitioned(var, min_partition_bytes):
        parts = dense_parts or num_ps
    # Whole rows per part that fit in max_shard_bytes (at least one, even when a
    # row alone is larger). This is >= ceil(nbytes / max_shard_bytes) and, unlike
    # it, guarantees the largest part (ceil(rows / parts) rows) fits.
    rows_per_part = max(1, max_shard_bytes // var.row_bytes)
    parts = max(parts, -(-var.rows // rows_per_part))
    return min(parts, var.rows)


def _split(var: VariableInfo, parts: int) -> list[Shard]:
    """Cuts ``var`` into ``parts`` shards along dim 0; ps_task is set to -1."""
    if parts == 1:
        return [Shard(var.name, var.name, -1, 0, var.rows, var.shape, var.nbytes)]
    base, extra = divmod(var.rows, parts)
    shards = []
    start = 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)  # TF's rule: the first rows % parts get one more
        shape = (n, *var.shape[1:])
        shards.append(
            Shard(
                f"{var.name}/part_{i}",
                var.name,
                -1,
                start,
                start + n,
                shape,
                n * var.row_bytes,
                part_index=i,
                num_parts=parts,
            )
        )
        start += n
    return shards


def part_owners(num_parts: int, num_ps: int) -> tuple[int, ...]:
    """The ps task of each of a variable's ``num_parts`` parts on ``num_ps`` tasks (a number of
    parts given whatever the tasks: ``Placement(table_parts=...)`` or ``Placement(dense_parts=...)``).

    The parts are dealt as the tasks come, one at a time: all on task 0; then each task ``p`` added takes its share
    (``num_parts // (p + 1)``) from the others, one part at a time, the last part of the
    task that holds the most (the lowest such task on a tie). So every task holds as many
    parts as another, give or take one, and a live re-layout that adds a ps task at the end
    moves only the parts the new task takes (draining it, only the parts it gives back): a
    third of them from 2 tasks to 3, where dealing ``k % num_ps`` moved two thirds.
    """
    owners = [0] * num_parts
    counts = [num_parts] + [0] * max(0, num_ps - 1)
    for p in range(1, num_ps):
        for _ in range(num_parts // (p + 1)):
            fullest = max(range(p), key=lambda t: (counts[t], -t))
            k = max(i for i in range(num_parts) if owners[i] == fullest)
            owners[k] = p
            counts[fullest] -= 1
            counts[p] += 1
    return tuple(owners)


def explicit_task(var: VariableInfo, num_ps: int, soft_placement: bool) -> int | None:
    """The ps task named by ``var.device``, or None to place it automatically."""
    if var.device is None:
        return None
    from psframe.cluster.device_spec import DeviceSpec  # lazy: device_spec is a sibling core module
    from psframe.errors import ClusterSpecError

    try:
        spec = DeviceSpec.parse(var.device)
    except ClusterSpecError as e:
        raise PlacementError(
            f"variable {var.name!r}: device {var.device!r} is not a valid device string, "
            f"expected e.g. '/job:ps/task:0': {e}"
        ) from e
    problem = None
    if spec.job not in (None, "ps"):
        problem = f"job {spec.job!r} is not 'ps'"
    elif spec.task is None:
        problem = "no task is given"
    elif not 0 <= spec.task < num_ps:
        problem = f"task {spec.task} does not exist"
    if problem is None:
        return spec.task
    msg = (
        f"variable {var.name!r}: device {var.device!r} cannot be used ({problem}); "
        f"expected /job:ps/task:N with N in 0..{num_ps - 1}"
    )
    if not soft_placement:
        raise PlacementError(msg)
    msg += "; soft_placement is on, so it is placed automatically"
    warnings.warn(msg, UserWarning, stacklevel=3)
    logger.warning("%s", msg)
    return None


def place(
    variables: Sequence[VariableInfo],
    num_ps: int,
    *,
    strategy: str = "greedy",
    min_partition_bytes: int | None = DEFAULT_MIN_PARTITION_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    soft_placement: bool = False,
    dense_parts: int | None = None,
) -> ShardPlacement:
    """Decides which ps task holds each variable, partitioning large ones.

    A variable of more than ``min_partition_bytes`` (and more than one row) is
    cut along dim 0 into ``num_ps`` parts (``dense_parts`` parts whatever the
    number of ps tasks, if given), and any variable into as many parts
    as needed for every part to hold at most ``max_shard_bytes``, capped at one
    row per part. Variables with an explicit device go (all parts) to that ps
    task, and their bytes count towards its load; the parts of a variable cut
    into ``dense_parts`` are dealt among the tasks by
    :func:`part_owners` (a task added takes only
    its share: a live re-layout moves those parts whole, none is cut anew), and
    count towards their loads too; the other shards are placed
    by ``strategy``:

    * ``"greedy"``: largest shard first (ties in input order), each on the ps
      task holding the fewest bytes so far (ties: lowest index).
    * ``"round_robin"``: in input order (variable, then part), tasks 0, 1, ...

    Args:
        variables: The model's parameters, in model order.
        num_ps: Number of ps tasks (>= 1).
        strategy: ``"greedy"`` or ``"round_robin"``.
        min_partition_bytes: Variables larger than this are spread over all ps
            tasks; None never partitions for balance (only for size).
        max_shard_bytes: Largest part, in bytes, unless a single row is larger.
            At most :data:`HARD_MAX_SHARD_BYTES`.
        soft_placement: When an explicit device names no existing ps task,
            warn and place the variable automatically instead of raising.
        dense_parts: The parts of a variable partitioned for balance, whatever
            ``num_ps`` (TF's ``fixed_size_partitioner`` with a fixed number of
            shards); None: one per ps task.

    Returns:
        The placement; its shards are in variable order, then part order.

    Raises:
        PlacementError: An argument is out of range, two variables share a
            name, a device string is malformed or (without soft placement)
            names no ps task, or one row of a variable exceeds
            :data:`HARD_MAX_SHARD_BYTES`.
    """
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
        raise PlacementError(f"num_ps must be an int >= 1, got {num_ps!r}")
    if strategy not in STRATEGIES:
        raise PlacementError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if min_partition_bytes is not None and min_partition_bytes < 0:
        raise PlacementError(f"min_partition_bytes must be >= 0 or None, got {min_partition_bytes}")
    if not 0 < max_shard_bytes <= HARD_MAX_SHARD_BYTES:
        raise PlacementError(f"max_shard_bytes must be in 1..{HARD_MAX_SHARD_BYTES}, got {max_shard_bytes}")
    if dense_parts is not None and (
        isinstance(dense_parts, bool) or not isinstance(dense_parts, int) or dense_parts < 1
    ):
        raise PlacementError(f"dense_parts must be an int >= 1 or None, got {dense_parts!r}")
    seen: set[str] = set()
    for var in variables:
        if not isinstance(var, VariableInfo):
            raise PlacementError(f"expected VariableInfo, got {type(var).__name__}: {var!r}")
        if var.name in seen:
            raise PlacementError(f"variable name {var.name!r} appears more than once")
        seen.add(var.name)

    shards: list[Shard] = []
    fixed: list[int | None] = []  # explicit ps task per shard, None = automatic
    for var in variables:
        task = explicit_task(var, num_ps, soft_placement)
        parts = _split(var, _num_parts(var, num_ps, min_partition_bytes, max_shard_bytes, dense_parts))
        shards.extend(parts)
        if task is None and dense_parts is not None and _partitioned(var, min_partition_bytes):
            fixed.extend(part_owners(len(parts), num_ps))  # dealt: a task added takes only its share
        else:
            fixed.extend([task] * len(parts))

    names = [s.name for s in shards]
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise PlacementError(
            f"shard names {clash} are used twice: a variable is named like a part "
            f"('<variable>/part_<i>') of a partitioned one; rename it"
        )

    tasks = list(fixed)
    auto = [i for i, t in enumerate(fixed) if t is None]
    if strategy == "round_robin":
        for k, i in enumerate(auto):
            tasks[i] = k % num_ps
    else:
        load = [0] * num_ps
        for i, t in enumerate(fixed):
            if t is not None:
                load[t] += shards[i].nbytes
        heap = [(nbytes, task) for task, nbytes in enumerate(load)]
        heapq.heapify(heap)  # (bytes so far, task): ties pop the lowest index
        for i in sorted(auto, key=lambda i: (-shards[i].nbytes, i)):
            nbytes, task = heapq.heappop(heap)
            tasks[i] = task
            heapq.heappush(heap, (nbytes + shards[i].nbytes, task))

    placed: list[int] = [t for t in tasks if t is not None]
    if len(placed) != len(shards):
        raise PlacementError(f"{len(shards) - len(placed)} of {len(shards)} shards were left without a ps task")
    return ShardPlacement(num_ps, tuple(replace(s, ps_task=t) for s, t in zip(shards, placed)))


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_MIN_PARTITION_BYTES",
    "HARD_MAX_SHARD_BYTES",
    "MiB",
    "Shard",
    "ShardPlacement",
    "VariableInfo",
    "part_owners",
    "place",
]

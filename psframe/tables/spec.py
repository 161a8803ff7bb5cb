"""What an embedding table is, and where its rows live among the ps tasks.

An embedding table (an ``nn.Embedding`` or ``nn.EmbeddingBag`` with
``sparse=True``) is never moved whole: workers pull the rows a batch looks
up and push the rows it touched. So a table is cut into one part per ps
task, whatever its size, and a part may be far larger than a message.

Two ways to cut, as in TF (``embedding_lookup``'s ``partition_strategy``):

- ``"mod"`` (the default): row ``i`` lives in part ``i % P``, as row
  ``i // P`` there. Frequent ids are spread over every part even when
  they are numbered together (a vocabulary sorted by frequency puts the
  hottest ids first): the balance holds for any id order.
- ``"range"``: part ``k`` holds a contiguous run of rows (TF's
  ``fixed_size_partitioner`` rule: the first ``rows % P`` parts get one
  more). The hottest ids of a frequency-sorted vocabulary then all land on
  the first part.

Like :mod:`psframe.cluster.placement`, this works on sizes only. A dynamic
table (any int64 id) is cut by a hash of the id (:func:`place_dynamic`), and
its spec says how its rows are made, admitted and evicted
(:class:`DynamicTableSpec`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from psframe.cluster.placement import Shard, VariableInfo, explicit_task, part_owners
from psframe.errors import PlacementError
from psframe.tables.compact import STORAGE_DTYPES

PARTITIONS = ("mod", "range")


def place_tables(
    tables: Sequence[VariableInfo],
    num_ps: int,
    *,
    partition: str = "mod",
    soft_placement: bool = False,
    num_parts: int | None = None,
) -> list[Shard]:
    """One part of each table per ps task (part ``k`` on ps task ``k``), or ``num_parts`` parts
    (fewer for a table of fewer rows) dealt among them by :func:`part_owners`.

    A table with an explicit device goes whole to that ps task.

    Args:
        tables: the tables, in model order (each at least 1-d).
        num_ps: the number of ps tasks.
        partition: ``"mod"`` or ``"range"`` (see the module's docstring).
        soft_placement: an explicit device naming no ps task is warned
            about and ignored, instead of refused.
        num_parts: the parts of every table whatever ``num_ps`` (a live
            re-layout then moves whole parts); None: ``num_ps``.

    Returns:
        The tables' shards (``table=True``), table by table, part by part.

    Raises:
        PlacementError: an unknown partition, a 0-d table, or a device
            string that names no ps task.
    """
    if partition not in PARTITIONS:
        raise PlacementError(f"table partition must be one of {PARTITIONS}, got {partition!r}")
    shards: list[Shard] = []
    for var in tables:
        if not var.shape:
            raise PlacementError(f"embedding table {var.name!r} has no rows (a 0-d tensor)")
        task = explicit_task(var, num_ps, soft_placement)
        parts = 1 if task is not None else max(1, min(num_parts or num_ps, var.rows))
        if parts == 1:
            shards.append(Shard(var.name, var.name, task or 0, 0, var.rows, var.shape, var.nbytes, table=True))
            continue
        base, extra = divmod(var.rows, parts)
        start = 0
        owners = tuple(range(parts)) if num_parts is None else part_owners(parts, num_ps)
        for k in range(parts):
            rows = base + (1 if k < extra else 0)  # the same counts either way
            if partition == "mod":
                first, end, stride = k, k + (rows - 1) * parts + 1, parts
            else:
                first, end, stride = start, start + rows, 1
                start += rows
            shards.append(
                Shard(
                    f"{var.name}/part_{k}",
                    var.name,
                    owners[k],
                    first,
                    end,
                    (rows, *var.shape[1:]),
                    rows * var.row_bytes,
                    part_index=k,
                    num_parts=parts,
                    row_stride=stride,
                    table=True,
                )
            )
    return shards


# ---- dynamic tables

INITIALIZERS = ("normal", "uniform", "constant")
EVICTION_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class RowInitializer:
    """How a dynamic table makes the row of an id it has not seen.

    The row of an id depends on ``seed`` and the id only: the same id gets
    the same row on every ps task, in every process, in any batch, and after
    it was evicted (so one process and a cluster start every row alike).

    Args:
        distribution: ``"normal"`` (``mean``, ``std``; ``nn.Embedding``'s own
            is N(0, 1)), ``"uniform"`` (on ``[low, high)``) or ``"constant"`` (``value``).
        seed: mixed with each id into the seed of that id's row.
    """

    distribution: str = "normal"
    mean: float = 0.0
    std: float = 1.0
    low: float = 0.0
    high: float = 1.0
    value: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in INITIALIZERS:
            raise PlacementError(
                f"row initializer distribution must be one of {INITIALIZERS}, got {self.distribution!r}"
            )
        if self.distribution == "normal" and not self.std >= 0:
            raise PlacementError(f"a normal row initializer needs std >= 0, got {self.std}")
        if self.distribution == "uniform" and not self.low < self.high:
            raise PlacementError(f"a uniform row initializer needs low < high, got [{self.low}, {self.high})")


@dataclass(frozen=True)
class Eviction:
    """When a dynamic table's part forgets rows.

    Args:
        max_rows: the most rows a ps task keeps of the table (None: no cap).
            A part that would go past it first evicts the rows the policy
            ranks lowest, never one the request at hand uses.
        policy: ``"lru"`` evicts the rows updated longest ago; ``"lfu"``
            those updated the fewest times (the oldest among equals).
        max_age: rows not updated in this many of the part's updates are
            evicted (None: rows never age out).
        ttl_seconds: rows not seen — looked up for training or updated — for
            this many seconds of wall-clock time are evicted (None: no such
            limit). Evaluation's lookups, which make no rows, do not count.
            The part sweeps every eighth of it, on its next lookup or update:
            a row lives ``ttl_seconds`` to 1.125 times that since last seen.
        min_norm: a row that an update leaves with an L2 norm below this is
            evicted at once (None: rows are never evicted for their norm).
            Rows whose weights have decayed towards zero carry little, and an
            id that comes back starts again from the initializer.
    """

    max_rows: int | None = None
    policy: str = "lru"
    max_age: int | None = None
    ttl_seconds: float | None = None
    min_norm: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise PlacementError(f"eviction policy must be one of {EVICTION_POLICIES}, got {self.policy!r}")
        for name in ("max_rows", "max_age"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlacementError(f"eviction {name} must be a positive int or None, got {value!r}")
        ttl = self.ttl_seconds
        if ttl is not None and not _positive_number(ttl):
            raise PlacementError(f"eviction ttl_seconds must be a finite number of seconds > 0 or None, got {ttl!r}")
        if self.min_norm is not None and not _positive_number(self.min_norm):
            raise PlacementError(f"eviction min_norm must be a finite number > 0 or None, got {self.min_norm!r}")


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


@dataclass(frozen=True)
class Admission:
    """When a dynamic table gives a new id a row.

    Most ids of a click log are seen once or twice and never again; a row
    for each would take memory and train on almost nothing. A table that
    admits by count or by chance makes rows only for ids that pass; until
    then a lookup of the id reads the initializer's row, its gradients are
    dropped, and it takes no memory beyond its share of the counters.

    Args:
        min_count: an id gets a row once it was looked up for training this
            many times (1: at once, the default). The counts live in a
            counting Bloom filter of ``counters`` one-byte counters per ps
            task (three per id, saturating at 255), so an id's count may be
            overestimated when many ids share its counters, never
            underestimated; its counters are not cleared when the row is
            evicted, so an evicted id that comes back is admitted again at once.
        probability: each training lookup of an id not held admits it with
            this probability (1.0: always). Not with ``min_count`` above 1.
        counters: the counting filter's size, a power of two (memory: this
            many bytes per ps task; used only with ``min_count`` above 1).
    """

    min_count: int = 1
    probability: float = 1.0
    counters: int = 1 << 20

    def __post_init__(self) -> None:
        if isinstance(self.min_count, bool) or not isinstance(self.min_count, int) or not 1 <= self.min_count <= 255:
            raise PlacementError(f"admission min_count must be an int from 1 to 255, got {self.min_count!r}")
        if not _positive_number(self.probability) or self.probability > 1:
            raise PlacementError(f"admission probability must be a number in (0, 1], got {self.probability!r}")
        if self.min_count > 1 and self.probability < 1:
            raise PlacementError(
                f"a table admits new ids by count or by probability, not both: got min_count={self.min_count} "
                f"and probability={self.probability}"
            )
        c = self.counters
        if isinstance(c, bool) or not isinstance(c, int) or c < 64 or c & (c - 1):
            raise PlacementError(f"admission counters must be a power of two >= 64, got {c!r}")

    @property
    def filters(self) -> bool:
        """Whether some new ids are refused (a count above 1 or a probability below 1)."""
        return self.min_count > 1 or self.probability < 1


@dataclass(frozen=True)
class DynamicTableSpec:
    """What defines a dynamic table besides its row width and dtype: its rows' initializer, eviction and
    admission, the dtype its ps tasks store rows in (``storage``: a name of
    :data:`psframe.tables.compact.STORAGE_DTYPES`; None: the table's dtype), and the bytes of RAM
    each part's rows may take before the rest go to disk (``ram_budget``: :mod:`psframe.tables.disk_tier`;
    None: all in RAM)."""

    initializer: RowInitializer = RowInitializer()
    eviction: Eviction = Eviction()
    admission: Admission = Admission()
    storage: str | None = None
    ram_budget: int | None = None

    def __post_init__(self) -> None:
        if self.storage is not None and self.storage not in STORAGE_DTYPES:
            raise PlacementError(f"row storage must be None or one of {sorted(STORAGE_DTYPES)}, got {self.storage!r}")
        budget = self.ram_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise PlacementError(f"ram_budget must be a positive number of bytes or None, got {budget!r}")
        ruled = [k for k in ("max_rows", "max_age", "ttl_seconds") if getattr(self.eviction, k) is not None]
        if budget is not None and ruled:
            raise PlacementError(
                f"a table with a ram_budget (rows beyond it on disk) takes no {', '.join(ruled)} yet: its rows on "
                f"disk are not swept; bound it with min_norm, or keep it in RAM"
            )


# A 64-bit odd multiplier (the golden ratio's): multiplying by it mixes an id's bits into its top bits.
ID_MIX = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=256)
def dynamic_part(table_id: int, num_parts: int) -> int:
    """The part of a dynamic table that holds id ``table_id`` (see :func:`place_dynamic`)."""
    return (((table_id * ID_MIX) & 0xFFFFFFFFFFFFFFFF) >> 32) % num_parts


def place_dynamic(
    name: str,
    row_shape: Sequence[int],
    itemsize: int,
    spec: DynamicTableSpec,
    num_ps: int,
    num_parts: int | None = None,
) -> list[Shard]:
    """One part of dynamic table ``name`` per ps task, or ``num_parts`` parts dealt by
    :func:`part_owners`.

    A dynamic table takes any int64 id. Part ``k`` holds the ids whose
    mixed bits (the id times a 64-bit odd constant, its top 32 bits) are
    ``k`` modulo the number of parts: ids numbered in a pattern (all even,
    multiples of 1000) still spread evenly. A part starts empty
    (``shape == (0, *row_shape)``) and grows with the ids it sees.
    """
    parts = num_parts or num_ps
    owners = tuple(range(parts)) if num_parts is None else part_owners(parts, num_ps)
    return [
        Shard(
            f"{name}/part_{k}",
            name,
            owners[k],
            0,
            0,
            (0, *row_shape),
            0,
            part_index=k,
            num_parts=parts,
            table=True,
            dynamic=spec,
        )
        for k in range(parts)
    ]

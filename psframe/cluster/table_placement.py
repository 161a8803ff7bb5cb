"""Where the rows of each embedding table live among the ps tasks.

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

Like :mod:`psframe.cluster.placement`, this works on sizes only.
"""

from __future__ import annotations

from collections.abc import Sequence

from psframe.cluster.placement import Shard, VariableInfo, explicit_task
from psframe.errors import PlacementError

PARTITIONS = ("mod", "range")


def place_tables(tables: Sequence[VariableInfo], num_ps: int, *, partition: str = "mod",
                 soft_placement: bool = False) -> list[Shard]:
    """One part of each table per ps task (fewer for a table of fewer rows).

    A table with an explicit device goes whole to that ps task.

    Args:
        tables: the tables, in model order (each at least 1-d).
        num_ps: the number of ps tasks.
        partition: ``"mod"`` or ``"range"`` (see the module's docstring).
        soft_placement: an explicit device naming no ps task is warned
            about and ignored, instead of refused.

    Returns:
        The tables' shards (``table=True``), table by table, part by part;
        part ``k`` is on ps task ``k``.

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
        parts = 1 if task is not None else max(1, min(num_ps, var.rows))
        if parts == 1:
            shards.append(Shard(var.name, var.name, task or 0, 0, var.rows, var.shape, var.nbytes, table=True))
            continue
        base, extra = divmod(var.rows, parts)
        start = 0
        for k in range(parts):
            rows = base + (1 if k < extra else 0)  # the same counts either way
            if partition == "mod":
                first, end, stride = k, k + (rows - 1) * parts + 1, parts
            else:
                first, end, stride = start, start + rows, 1
                start += rows
            shards.append(Shard(f"{var.name}/part_{k}", var.name, k, first, end, (rows, *var.shape[1:]),
                                rows * var.row_bytes, part_index=k, num_parts=parts, row_stride=stride,
                                table=True))
    return shards

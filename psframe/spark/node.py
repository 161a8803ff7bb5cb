"""The task side of :func:`psframe.spark.run`: one psframe task per Spark barrier task.

Each task of the barrier stage (partition ``p`` of ``num_ps + num_workers``)
becomes ``ps p`` for ``p < num_ps`` and ``worker p - num_ps`` after that. It
reserves a free port on its host, exchanges ``host:port`` with every other
task through ``BarrierTaskContext.allGather``, builds the
:class:`~psframe.ClusterSpec` and calls ``main_fun(args, ctx)`` with a
:class:`NodeContext`. Only the chief's return value leaves the task.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from psframe.cluster import ClusterSpec, parse_address
from psframe.memory import malloc

log = logging.getLogger(__name__)
T = TypeVar("T")

# The key every task's output goes under; the driver collects it from one partition.
RESULT_KEY = 0


@dataclass(frozen=True)
class NodeContext:
    """What ``main_fun(args, ctx)`` learns about its task (TensorFlowOnSpark's ``ctx``).

    Attributes:
        cluster: the whole cluster, ps tasks first, as every task sees it.
        job_name: ``"ps"`` or ``"worker"``.
        task_index: this task's index in its job; worker 0 is the chief.
        address: this task's ``host:port`` in ``cluster`` (a ps task serves there).
        partition_id: the Spark partition (barrier task) running this task.
        input: (workers, with ``input_data``) an iterator over the records of
            the input assigned to this worker, read once; None otherwise.
    """

    cluster: ClusterSpec
    job_name: str
    task_index: int
    address: str
    partition_id: int
    input: Iterator[Any] | None = None

    @property
    def num_ps(self) -> int:
        return self.cluster.num_ps

    @property
    def num_workers(self) -> int:
        return self.cluster.num_workers

    @property
    def is_chief(self) -> bool:
        """True for worker 0, whose return value :func:`psframe.spark.run` returns."""
        return self.job_name == "worker" and self.task_index == 0

    def shard(self, items: Sequence[T] | Iterable[T]) -> list[T]:
        """This worker's share of ``items`` for file-based input: every
        ``num_workers``-th item from ``task_index`` on (a ps task gets none).

        Example::

            paths = ctx.shard(sorted(fsspec.open_files("s3://bucket/train-*.npz")))
        """
        if self.job_name != "worker":
            return []
        return list(items)[self.task_index :: self.num_workers]


def task_of_partition(partition_id: int, num_ps: int) -> tuple[str, int]:
    """The psframe task a barrier task runs: ps tasks take the first partitions."""
    return ("ps", partition_id) if partition_id < num_ps else ("worker", partition_id - num_ps)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def executor_host(address: str) -> str:
    """The host of a ``host:port`` Spark gives for an executor (``[v6]:port`` too)."""
    host, _ = parse_address(address)
    return host


def reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port of ``host``; the caller closes it once
    every task has announced its port, so that tasks on one host differ."""
    infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def cluster_of(addresses: Sequence[str], num_ps: int) -> ClusterSpec:
    return ClusterSpec({"ps": list(addresses[:num_ps]), "worker": list(addresses[num_ps:])})


def run_node(
    main_fun: Callable[[Any, NodeContext], Any],
    args: Any,
    num_ps: int,
    host: str | None,
    with_input: bool,
    records: Iterator[Any],
) -> Iterator[tuple[int, Any]]:
    """The body of one barrier task (``mapPartitions``); yields the chief's ``(RESULT_KEY, result)``."""
    from pyspark import BarrierTaskContext

    barrier = BarrierTaskContext.get()
    partition = barrier.partitionId()
    job_name, task_index = task_of_partition(partition, num_ps)
    if host is None:
        host = executor_host(barrier.getTaskInfos()[partition].address)
    sock = reserve_port(host)
    try:
        address = format_address(host, sock.getsockname()[1])
        # Bounded by spark.barrier.sync.timeout; a task that dies first fails the stage.
        addresses = barrier.allGather(address)
    finally:
        sock.close()
    cluster = cluster_of(addresses, num_ps)
    ctx = NodeContext(
        cluster=cluster,
        job_name=job_name,
        task_index=task_index,
        address=address,
        partition_id=partition,
        input=records if with_input and job_name == "worker" else None,
    )
    log.info(
        "Spark partition %d runs %s at %s in cluster %s",
        partition,
        ClusterSpec.task_name(job_name, task_index),
        address,
        cluster.to_string(),
    )
    # The Python worker runs this task for the whole job: tuned as `psframe server` tunes its own.
    malloc.tune_malloc()
    result = main_fun(args, ctx)
    if ctx.is_chief:
        yield RESULT_KEY, result

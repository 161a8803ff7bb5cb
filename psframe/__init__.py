"""psframe: parameter-server training for PyTorch over gRPC.

The front door: the names most programs need. Everything else is imported
from its module (``psframe.flags`` for scripts' command-line flags,
``psframe.hooks``, ``psframe.checkpoint``, ``psframe.export`` for serving
snapshots, ``psframe.cluster.placement``...).

The tree shows the layers (imports point down only): ``psframe.cluster``,
``psframe.errors``, ``psframe.optim``, ``psframe.sparse_optim``,
``psframe.security``, ``psframe.flags`` and ``psframe.dynamic_rows``
(core); ``psframe.wire`` (the ``.proto``, the codec, gRPC);
``psframe.checkpoint`` and ``psframe.export`` (the formats on disk); ``psframe.ps`` (the ps side)
and ``psframe.worker`` (the worker side), which never import each other;
``psframe.cli``, ``psframe.launch``, ``psframe.local`` (a cluster's ps
tasks in this process) and the engines that start a cluster,
``psframe.spark``, ``psframe.ray`` and ``psframe.k8s`` (the edges).

``Server`` and ``local_cluster`` are loaded on first use, so that
``import psframe`` in a worker process loads nothing of the ps side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psframe import optim
from psframe.cluster import ClusterSpec
from psframe.cluster.table_placement import RowInitializer
from psframe.errors import (
    BarrierTimeoutError,
    ClusterSpecError,
    ConnectTimeoutError,
    PsframeError,
    ShapeMismatchError,
)
from psframe.liveness import Liveness
from psframe.optim import SyncReplicas
from psframe.options import BoundedStaleness, Checkpointing, DataRanges, Placement, RowCaching, Transport
from psframe.security import Security
from psframe.version import __version__
from psframe.worker.dynamic import DynamicEmbedding, DynamicTables
from psframe.worker.evaluator import Evaluator, checkpoints_iterator
from psframe.worker.trainer import Trainer

if TYPE_CHECKING:
    from psframe.local import local_cluster
    from psframe.ps.server import Server

__all__ = [
    "BarrierTimeoutError",
    "BoundedStaleness",
    "Checkpointing",
    "ClusterSpec",
    "ClusterSpecError",
    "ConnectTimeoutError",
    "DataRanges",
    "DynamicEmbedding",
    "DynamicTables",
    "Evaluator",
    "Liveness",
    "Placement",
    "PsframeError",
    "RowCaching",
    "RowInitializer",
    "Security",
    "Server",
    "ShapeMismatchError",
    "SyncReplicas",
    "Trainer",
    "Transport",
    "__version__",
    "checkpoints_iterator",
    "local_cluster",
    "optim",
    "tune_process",
]


def tune_process() -> bool:
    """Set this process's memory allocator for moving tensors every step; call it first thing.

    Keeps large freed buffers for reuse instead of mapping them afresh every
    step (glibc malloc: one arena, buffers up to 256 MiB from the heap; see
    :mod:`psframe.allocator`). It sets the whole process, so no constructor
    does it: ``psframe server`` does, and a script that runs a ps task or a
    worker calls it before creating them (before any gRPC thread starts). It
    changes nothing where the user chose the allocator (``MALLOC_*``,
    ``GLIBC_TUNABLES``, ``LD_PRELOAD``, ``PSFRAME_TUNE_MALLOC=0``) or the C
    library is not glibc.

    Returns:
        True if the allocator's settings were changed, False if they were left alone.
    """
    from psframe import allocator

    return allocator.tune_malloc()


def __getattr__(name: str) -> Any:
    if name == "Server":
        from psframe.ps.server import Server

        return Server
    if name == "local_cluster":
        from psframe.local import local_cluster

        return local_cluster
    raise AttributeError(f"module 'psframe' has no attribute {name!r}")

"""psframe: parameter-server training for PyTorch over gRPC.

The front door: the names most programs need. Everything else is imported
from its module (``psframe.hooks``, ``psframe.checkpoint``, ``psframe.cluster.placement``...).

The tree shows the layers (imports point down only): ``psframe.cluster``,
``psframe.errors``, ``psframe.optim``, ``psframe.sparse_optim`` and
``psframe.dynamic_rows`` (core); ``psframe.wire`` (the ``.proto``, the codec,
gRPC); ``psframe.checkpoint`` (the format on disk); ``psframe.ps`` (the ps
side) and ``psframe.worker`` (the worker side), which never import each
other; ``psframe.cli``, ``psframe.launch`` and the engines that start a
cluster, ``psframe.spark``, ``psframe.ray`` and ``psframe.k8s`` (the edges).

``Server`` is loaded on first use, so that ``import psframe`` in a worker
process loads nothing of the ps side.
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
from psframe.optim import SyncReplicas
from psframe.version import __version__
from psframe.worker.dynamic import DynamicEmbedding, DynamicTables
from psframe.worker.trainer import Trainer

if TYPE_CHECKING:
    from psframe.ps.server import Server

__all__ = [
    "BarrierTimeoutError",
    "ClusterSpec",
    "ClusterSpecError",
    "ConnectTimeoutError",
    "DynamicEmbedding",
    "DynamicTables",
    "PsframeError",
    "RowInitializer",
    "Server",
    "ShapeMismatchError",
    "SyncReplicas",
    "Trainer",
    "__version__",
    "optim",
]


def __getattr__(name: str) -> Any:
    if name == "Server":
        from psframe.ps.server import Server

        return Server
    raise AttributeError(f"module 'psframe' has no attribute {name!r}")

"""psframe: parameter-server training for PyTorch over gRPC.

The front door: the names most programs need. Everything else is imported
from its module (``psframe.placement``, ``psframe.hooks``, ``psframe.codec``...).
"""

from psframe.version import __version__  # noqa: E402,F401

from psframe import optim  # noqa: E402
from psframe.cluster import ClusterSpec  # noqa: E402
from psframe.errors import (  # noqa: E402
    BarrierTimeoutError,
    ClusterSpecError,
    ConnectTimeoutError,
    PsframeError,
    ShapeMismatchError,
)
from psframe.optim import SyncReplicas  # noqa: E402
from psframe.ps.server import Server  # noqa: E402
from psframe.trainer import Trainer  # noqa: E402

__all__ = [
    "ClusterSpec",
    "Server",
    "Trainer",
    "SyncReplicas",
    "optim",
    "PsframeError",
    "ClusterSpecError",
    "ConnectTimeoutError",
    "BarrierTimeoutError",
    "ShapeMismatchError",
]

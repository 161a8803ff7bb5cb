"""psframe: parameter-server training for PyTorch over gRPC.

The front door: the names most programs need. Everything else is imported
from its module.

The top level holds only what users import or run: this module,
``psframe.errors``, ``psframe.version``; the public helper modules
``psframe.flags`` (scripts' command-line flags), ``psframe.hooks``,
``psframe.status`` and ``psframe.export`` (serving snapshots); and the
edges that start a cluster, ``psframe.cli``, ``psframe.launch``,
``psframe.local`` (a cluster's ps tasks in this process), ``psframe.k8s``,
``psframe.ray`` and ``psframe.spark``.

The packages are the layers, bottom to top (imports point down only; see
tests/unit/test_layers.py): ``psframe.optim`` (optimizers and their kernels) and
``psframe.memory`` (where tensors live); ``psframe.cluster`` (tasks and
placement); ``psframe.config`` (option groups, security, liveness);
``psframe.tables`` (embedding tables, both sides' part); ``psframe.wire``
(the ``.proto``, the codec, gRPC); ``psframe.checkpoint`` (the formats on
disk); ``psframe.ps`` (the ps side) and ``psframe.worker`` (the worker side),
which never import each other.

Every name here but ``__version__`` is loaded on first use (PEP 562), so
that ``import psframe`` loads neither torch nor gRPC (``psframe --version``
and ``--help`` start without either, ``psframe status`` and ``ping`` without
torch), and a worker process loads nothing of the ps side (``Server``,
``local_cluster``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from psframe.version import __version__

if TYPE_CHECKING:
    from psframe import optim
    from psframe.cluster import ClusterSpec
    from psframe.config.liveness import Liveness
    from psframe.config.options import BoundedStaleness, Checkpointing, DataRanges, Placement, Transport
    from psframe.config.security import Security
    from psframe.errors import (
        BarrierTimeoutError,
        ClusterSpecError,
        ConnectTimeoutError,
        PsframeError,
        ShapeMismatchError,
    )
    from psframe.local import local_cluster
    from psframe.optim import SyncReplicas
    from psframe.ps.serving.server import Server
    from psframe.tables.spec import RowInitializer
    from psframe.worker.evaluator import Evaluator, checkpoints_iterator
    from psframe.worker.model.dynamic import DynamicEmbedding, DynamicTables
    from psframe.worker.trainer import Trainer

# Where each public name is defined: loaded from there on first use (see __getattr__).
_LAZY = {
    "ClusterSpec": "psframe.cluster",
    "Liveness": "psframe.config.liveness",
    "BoundedStaleness": "psframe.config.options",
    "Checkpointing": "psframe.config.options",
    "DataRanges": "psframe.config.options",
    "Placement": "psframe.config.options",
    "Transport": "psframe.config.options",
    "Security": "psframe.config.security",
    "BarrierTimeoutError": "psframe.errors",
    "ClusterSpecError": "psframe.errors",
    "ConnectTimeoutError": "psframe.errors",
    "PsframeError": "psframe.errors",
    "ShapeMismatchError": "psframe.errors",
    "local_cluster": "psframe.local",
    "SyncReplicas": "psframe.optim",
    "Server": "psframe.ps.serving.server",
    "RowInitializer": "psframe.tables.spec",
    "Evaluator": "psframe.worker.evaluator",
    "checkpoints_iterator": "psframe.worker.evaluator",
    "DynamicEmbedding": "psframe.worker.model.dynamic",
    "DynamicTables": "psframe.worker.model.dynamic",
    "Trainer": "psframe.worker.trainer",
}

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
    :mod:`psframe.memory.malloc`). It sets the whole process, so no constructor
    does it: ``psframe server`` does, and a script that runs a ps task or a
    worker calls it before creating them (before any gRPC thread starts). It
    changes nothing where the user chose the allocator (``MALLOC_*``,
    ``GLIBC_TUNABLES``, ``LD_PRELOAD``, ``PSFRAME_TUNE_MALLOC=0``) or the C
    library is not glibc.

    Returns:
        True if the allocator's settings were changed, False if they were left alone.
    """
    from psframe.memory import malloc

    return malloc.tune_malloc()


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for (then kept here);
    or a module of psframe (``psframe.optim``, ``psframe.checkpoint``...), imported as ``import psframe.NAME`` does."""
    where = _LAZY.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'psframe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

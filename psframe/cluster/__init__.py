"""Who the tasks are and where things live (standard library only).

- :mod:`psframe.cluster.spec`: :class:`ClusterSpec` and task names;
- :mod:`psframe.cluster.address`: ``host:port`` task addresses;
- :mod:`psframe.cluster.tf_config`: the cluster from flags, ``--cluster_spec`` or ``TF_CONFIG``;
- :mod:`psframe.cluster.device_spec`: TF device strings (``/job:ps/task:1``);
- :mod:`psframe.cluster.placement`: which ps task holds which variable, and its partitions;
- :mod:`psframe.cluster.moves`: a live re-layout in stages, the parts that move.

Where an embedding table's rows live is :mod:`psframe.tables.spec`.
"""

from psframe.cluster.address import parse_address
from psframe.cluster.spec import JOBS, ClusterSpec

__all__ = ["JOBS", "ClusterSpec", "parse_address"]

"""The running cluster a tool command (``status``, ``shutdown``, ``reshard``) talks to, from its flags.

Such a command is no task of the cluster, so it needs the cluster's
addresses only: ``--ps_hosts``/``--worker_hosts``, ``--cluster_spec`` or
``TF_CONFIG``, and no ``--job_name`` or ``--task_index``.
"""

from __future__ import annotations

import argparse

from psframe.cluster import ClusterSpec


def cluster_named(args: argparse.Namespace) -> ClusterSpec:
    """The cluster named by the flags or TF_CONFIG (no task needed)."""
    from psframe.cluster.tf_config import cluster_from_tf_config

    if args.ps_hosts or args.worker_hosts:
        return ClusterSpec.from_hosts(args.ps_hosts or "", args.worker_hosts or "")
    if args.cluster_spec:
        return ClusterSpec.from_string(args.cluster_spec)
    return cluster_from_tf_config()[0]

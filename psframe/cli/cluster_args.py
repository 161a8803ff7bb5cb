"""The running cluster a tool command (``status``, ``shutdown``, ``reshard``) talks to, from its flags.

Such a command is no task of the cluster, so it needs the cluster's
addresses only: ``--ps_hosts``/``--worker_hosts``, ``--cluster_spec`` or
``TF_CONFIG``, and no ``--job_name`` or ``--task_index``. Given none of them,
it talks to the cluster ``psframe launch`` runs on this machine (the newest,
if several run; :mod:`psframe.launch.record`), with that cluster's token.
"""

from __future__ import annotations

import argparse
import logging
import os

from psframe.cluster import ClusterSpec
from psframe.config.security import CA_ENV, CERT_ENV, KEY_ENV, TOKEN_ENV
from psframe.errors import ClusterSpecError

log = logging.getLogger(__name__)


def cluster_named(args: argparse.Namespace) -> ClusterSpec:
    """The cluster named by the flags or TF_CONFIG (no task needed); else the one ``psframe launch`` runs here.

    A launched cluster's token file (and TLS files) fill in the security flags
    left unset whose ``PSFRAME_*`` variable is unset too, so that
    :func:`psframe.flags.security_from_flags` reads them next.

    Raises:
        ClusterSpecError: the flags or TF_CONFIG are malformed, or name no cluster and no launch runs here.
    """
    from psframe.cluster.tf_config import cluster_from_tf_config

    if args.ps_hosts or args.worker_hosts:
        return ClusterSpec.from_hosts(args.ps_hosts or "", args.worker_hosts or "")
    if args.cluster_spec:
        return ClusterSpec.from_string(args.cluster_spec)
    if os.environ.get("TF_CONFIG", "").strip():
        return cluster_from_tf_config()[0]
    return _launched(args)


def _launched(args: argparse.Namespace) -> ClusterSpec:
    from psframe.launch import record

    found, others = record.find()
    if found is None:
        raise ClusterSpecError(
            "no cluster given: give --ps_hosts and --worker_hosts, or --cluster_spec, or set TF_CONFIG; "
            f"no psframe launch runs on this machine (none is recorded in {record.folder()})"
        )
    for flag, variable, value in (
        ("auth_token_file", TOKEN_ENV, found.auth_token_file),
        ("tls_cert_file", CERT_ENV, found.tls_cert_file),
        ("tls_key_file", KEY_ENV, found.tls_key_file),
        ("tls_ca_file", CA_ENV, found.tls_ca_file),
    ):
        if getattr(args, flag, None) is None and not os.environ.get(variable) and value is not None:
            setattr(args, flag, value)
    also = f"; {others} other launch(es) run here too: give --cluster_spec for another" if others else ""
    log.info(
        "the cluster psframe launch (pid %d) runs with %s: %s%s", found.pid, found.script, found.cluster_spec, also
    )
    return found.cluster

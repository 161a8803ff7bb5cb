"""A task's ``TF_CONFIG`` from its Kubernetes StatefulSet pod: ``python -m psframe.k8s -- COMMAND``.

Kubeflow's TFJob operator sets ``TF_CONFIG`` in every pod itself. A plain
StatefulSet does not; this entrypoint works it out and runs ``COMMAND`` with
it, so that any psframe program (``psframe server``, the examples, your own
script calling ``resolve_cluster``) starts unchanged. The cluster is two
StatefulSets, ``NAME-ps`` and ``NAME-worker``, behind one headless Service:

- the pod's hostname, ``NAME-ps-3`` or ``NAME-worker-0`` (the StatefulSet's
  name and the pod's ordinal), gives the task: ``ps`` 3, ``worker`` 0;
- every task's address is its pod's DNS name under the Service,
  ``NAME-ps-0.SERVICE.NAMESPACE.svc:PORT``, for ordinals below the counts:

=========================  =============================================================
``PSFRAME_SERVICE``        the headless Service (``spec.serviceName`` of both StatefulSets)
``PSFRAME_NUM_PS``         replicas of ``NAME-ps``
``PSFRAME_NUM_WORKERS``    replicas of ``NAME-worker``
``PSFRAME_PORT``           the port every task is named with (default 2222)
``PSFRAME_NAMESPACE``      the pods' namespace (downward API ``metadata.namespace``);
                           unset: names relative to the pod's own namespace
``PSFRAME_CLUSTER_DOMAIN`` appended after ``.svc`` when set (e.g. ``cluster.local``)
=========================  =============================================================

A StatefulSet restarts any pod whose container exits, a finished one too;
with ``--stay_after_success`` the entrypoint runs ``COMMAND`` as a child and,
once it exits 0, stays up (idle, until the pod is deleted: SIGTERM exits 0)
instead of ending, so a task that finished is not started again. A failure
still ends the container with the command's code, and the restarted pod
resumes from the checkpoint (give the tasks a shared ``--checkpoint_dir``).
Without ``COMMAND`` it prints the ``TF_CONFIG`` JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from psframe.cluster import ClusterSpec
from psframe.errors import ClusterSpecError

DEFAULT_PORT = 2222
ENV_SERVICE = "PSFRAME_SERVICE"
ENV_NUM_PS = "PSFRAME_NUM_PS"
ENV_NUM_WORKERS = "PSFRAME_NUM_WORKERS"
ENV_PORT = "PSFRAME_PORT"
ENV_NAMESPACE = "PSFRAME_NAMESPACE"
ENV_CLUSTER_DOMAIN = "PSFRAME_CLUSTER_DOMAIN"
ENV_NAMES = (ENV_SERVICE, ENV_NUM_PS, ENV_NUM_WORKERS, ENV_PORT, ENV_NAMESPACE, ENV_CLUSTER_DOMAIN)
"""Every variable :func:`statefulset_tf_config` reads."""


def statefulset_tf_config(hostname: str | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``TF_CONFIG`` of the StatefulSet pod named ``hostname``.

    Args:
        hostname: the pod's name, ``NAME-ps-I`` or ``NAME-worker-I``; default
            this host's name (a StatefulSet pod's hostname is its name).
        environ: where to read the ``PSFRAME_*`` variables; default ``os.environ``.

    Returns:
        ``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": job, "index": i}}``.

    Raises:
        ClusterSpecError: a hostname not of that form, a variable missing or
            malformed, or an ordinal not below its job's count.

    Example:
        >>> statefulset_tf_config("mnist-worker-1", {"PSFRAME_SERVICE": "mnist", "PSFRAME_NUM_PS": "1",
        ...                                          "PSFRAME_NUM_WORKERS": "2"})["task"]
        {'type': 'worker', 'index': 1}
    """
    environ = os.environ if environ is None else environ
    hostname = hostname or socket.gethostname()
    name, job_name, ordinal = _parse_hostname(hostname)
    service = environ.get(ENV_SERVICE, "").strip()
    if not service:
        raise ClusterSpecError(
            f"{ENV_SERVICE} is not set; expected the headless Service that both StatefulSets name in spec.serviceName"
        )
    counts = {"ps": _positive_int(environ, ENV_NUM_PS), "worker": _positive_int(environ, ENV_NUM_WORKERS)}
    port = _positive_int(environ, ENV_PORT, default=DEFAULT_PORT)
    if port > 65535:
        raise ClusterSpecError(f"{ENV_PORT} must be a port number (1..65535), got {port}")
    if ordinal >= counts[job_name]:
        env = ENV_NUM_PS if job_name == "ps" else ENV_NUM_WORKERS
        raise ClusterSpecError(
            f"pod {hostname!r} is {job_name} {ordinal}, but {env}={counts[job_name]} "
            f"(ordinals 0..{counts[job_name] - 1}): is {env} the StatefulSet's replicas?"
        )
    suffix = service
    namespace = environ.get(ENV_NAMESPACE, "").strip()
    if namespace:
        suffix += f".{namespace}.svc"
        domain = environ.get(ENV_CLUSTER_DOMAIN, "").strip().strip(".")
        if domain:
            suffix += f".{domain}"
    cluster = {job: [f"{name}-{job}-{i}.{suffix}:{port}" for i in range(n)] for job, n in counts.items()}
    ClusterSpec(cluster)  # refuse now what a task would refuse later
    return {"cluster": cluster, "task": {"type": job_name, "index": ordinal}}


def _parse_hostname(hostname: str) -> tuple[str, str, int]:
    parts = hostname.split(".")[0].rsplit("-", 2)
    if len(parts) != 3 or not parts[0] or parts[1] not in ("ps", "worker") or not parts[2].isdigit():
        raise ClusterSpecError(
            f"hostname {hostname!r} is not a StatefulSet pod of a psframe job: expected NAME-ps-I or "
            f"NAME-worker-I (StatefulSets named NAME-ps and NAME-worker)"
        )
    return parts[0], parts[1], int(parts[2])


def _positive_int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    text = environ.get(key, "").strip()
    if not text:
        if default is not None:
            return default
        raise ClusterSpecError(f"{key} is not set; expected the number of replicas of that StatefulSet")
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ClusterSpecError(f"{key} must be an int >= 1, got {text!r}")
    return value


def _stay_up() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        "psframe.k8s: the task finished; staying up so that the StatefulSet does not start it again "
        "(delete the StatefulSets to end)",
        flush=True,
    )
    while not stop.wait(3600.0):  # until the pod is deleted
        pass
    return 0


def _run_child(command: Sequence[str], env: dict[str, str]) -> tuple[int, bool]:
    """Runs the command, passing SIGTERM on; returns its exit code and whether SIGTERM came."""
    child = subprocess.Popen(list(command), env=env)
    terminated = threading.Event()

    def forward(signum, _frame):
        terminated.set()
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return (code if code >= 0 else 128 - code), terminated.is_set()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m psframe.k8s [--hostname H] [--stay_after_success] [-- COMMAND ...]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m psframe.k8s", description=__doc__.splitlines()[0])
    parser.add_argument("--hostname", default=None, help="the pod's name (default: this host's name)")
    parser.add_argument(
        "--stay_after_success",
        action="store_true",
        help="run COMMAND as a child and stay up once it exits 0 (a StatefulSet restarts any container that ends)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run with TF_CONFIG")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        tf_config = json.dumps(statefulset_tf_config(args.hostname))
    except ClusterSpecError as e:
        print(f"psframe.k8s: error: {e}", file=sys.stderr)
        return 2
    if not command:
        print(tf_config)
        return 0
    env = {**os.environ, "TF_CONFIG": tf_config}
    try:
        if not args.stay_after_success:
            os.execvpe(command[0], command, env)  # the command becomes the container's process
        code, terminated = _run_child(command, env)
    except OSError as e:
        print(f"psframe.k8s: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127
    return _stay_up() if code == 0 and not terminated else code


if __name__ == "__main__":
    sys.exit(main())

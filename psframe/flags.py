"""Command-line flags for training scripts: the cluster, the task, security and liveness.

The flags of TF's ``mnist_replica.py`` (``--ps_hosts``, ``--worker_hosts``,
``--job_name``, ``--task_index``), plus ``--cluster_spec``, ``TF_CONFIG`` as
TensorFlow reads it, the auth token and TLS files (:mod:`psframe.config.security`)
and keepalive (:mod:`psframe.config.liveness`). ``psframe launch`` and the
``psframe`` command speak the same flags.

Example::

    import argparse
    import psframe
    from psframe import flags

    parser = argparse.ArgumentParser()
    flags.add_cluster_flags(parser)
    flags.add_security_flags(parser)
    args = parser.parse_args()
    cluster, job_name, task_index = flags.cluster_from_flags(args)
    security = flags.security_from_flags(args)
    if job_name == "ps":
        psframe.Server(cluster, "ps", task_index, security=security).join()
    else:
        trainer = psframe.Trainer(model, cluster, task_index, security=security)

A script ends with ``sys.exit(flags.run(main))``: :func:`run` turns an expected
failure (a :class:`~psframe.errors.PsframeError`, Ctrl-C) into one line on
stderr and an exit code, as ``psframe server`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from psframe.cluster import ClusterSpec
from psframe.cluster.tf_config import EVALUATOR, resolve_cluster
from psframe.config import stopping
from psframe.config.liveness import Liveness
from psframe.config.options import BoundedStaleness
from psframe.config.security import Security
from psframe.errors import PsframeError, TaskStopped

if TYPE_CHECKING:
    from psframe.optim import SyncReplicas  # imported where used: psframe.optim loads torch; parsing flags does not

CLUSTER_FLAGS = ("ps_hosts", "worker_hosts", "cluster_spec", "job_name", "task_index")
SECURITY_FLAGS = ("auth_token_file", "tls_cert_file", "tls_key_file", "tls_ca_file")
LIVENESS_FLAGS = ("keepalive_time", "keepalive_timeout")
SYNC_FLAGS = ("sync_replicas", "replicas_to_aggregate", "total_num_replicas", "sync_timeout", "fraction_to_aggregate")
STALENESS_FLAGS = ("staleness_bound", "sync_timeout")

EXIT_FAILURE = 1
"""The exit code of a task that stopped on an expected failure, after one line saying what to do (:func:`run`)."""
EXIT_INTERRUPTED = 130
"""The exit code after Ctrl-C (SIGINT): 128 + 2, as a shell reports a process that SIGINT ended."""

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "add_cluster_flags",
    "add_liveness_flags",
    "add_security_flags",
    "add_sync_flags",
    "cluster_from_flags",
    "liveness_from_flags",
    "run",
    "security_from_flags",
    "staleness_from_flags",
    "sync_from_flags",
]


def add_cluster_flags(parser: argparse.ArgumentParser, *, evaluator: bool = False) -> None:
    """Adds the flags that name a cluster and this process's task.

    ``--ps_hosts``/``--worker_hosts`` (comma-separated ``host:port``), or
    ``--cluster_spec`` (``'ps|h0:2222;h0:2223,worker|h1:2224'``); and
    ``--job_name``/``--task_index``. All default to unset: without them the
    cluster and task come from ``TF_CONFIG`` (:func:`cluster_from_flags`).

    Args:
        parser: the script's parser.
        evaluator: also accept ``--job_name=evaluator``, for a script that
            can run an evaluator beside training (:class:`psframe.Evaluator`).
    """
    jobs = ("ps", "worker", EVALUATOR) if evaluator else ("ps", "worker")
    parser.add_argument("--ps_hosts", default=None, help="comma-separated host:port of the ps tasks")
    parser.add_argument("--worker_hosts", default=None, help="comma-separated host:port of the workers")
    parser.add_argument(
        "--cluster_spec",
        default=None,
        help="the whole cluster as 'ps|h:p;h:p,worker|h:p' (instead of the *_hosts flags)",
    )
    parser.add_argument(
        "--job_name",
        default=None,
        choices=jobs,
        help="this task's job" + ("; evaluator: evaluate checkpoints beside training" if evaluator else ""),
    )
    parser.add_argument("--task_index", type=int, default=None, help="this task's index in its job")


def add_security_flags(parser: argparse.ArgumentParser, no_token: str = "no token") -> None:
    """Adds the flags of the auth token and TLS, in a group of their own.

    ``--auth_token_file``, ``--tls_cert_file``, ``--tls_key_file`` and
    ``--tls_ca_file``; each left unset falls back on its ``PSFRAME_*``
    environment variable (which ``psframe launch`` sets for its tasks).

    Args:
        parser: the script's parser.
        no_token: what happens with neither a token file nor the variable, for the help text.
    """
    group = parser.add_argument_group("security", "who may talk to the cluster (see psframe.config.security)")
    group.add_argument(
        "--auth_token_file",
        default=None,
        help="a file holding the cluster's shared secret; every call carries it and ps tasks "
        f"refuse calls without it (default: $PSFRAME_AUTH_TOKEN, or {no_token})",
    )
    group.add_argument(
        "--tls_cert_file",
        default=None,
        help="this task's TLS certificate (PEM): servers listen with TLS; clients present it "
        "(default: $PSFRAME_TLS_CERT_FILE)",
    )
    group.add_argument(
        "--tls_key_file", default=None, help="the private key of --tls_cert_file (PEM; default: $PSFRAME_TLS_KEY_FILE)"
    )
    group.add_argument(
        "--tls_ca_file",
        default=None,
        help="the CA (PEM) other tasks' certificates chain to: calls use TLS, and a server with "
        "a certificate requires callers' certificates (mutual TLS) "
        "(default: $PSFRAME_TLS_CA_FILE)",
    )


def add_liveness_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the keepalive flags, in a group of their own (see :mod:`psframe.config.liveness`).

    ``--keepalive_time`` and ``--keepalive_timeout``; each left unset falls
    back on its ``PSFRAME_KEEPALIVE_*`` environment variable, then on 5 s.

    Args:
        parser: the script's parser.
    """
    group = parser.add_argument_group(
        "liveness", "how soon a peer that went away is noticed (see psframe.config.liveness)"
    )
    group.add_argument(
        "--keepalive_time",
        type=float,
        default=None,
        help="seconds without traffic before a connection is pinged (default: $PSFRAME_KEEPALIVE_TIME, or 5)",
    )
    group.add_argument(
        "--keepalive_timeout",
        type=float,
        default=None,
        help="seconds a ping, or data sent, may go unacknowledged before the connection is "
        "closed as dead (default: $PSFRAME_KEEPALIVE_TIMEOUT, or 5)",
    )


def add_sync_flags(parser: argparse.ArgumentParser) -> None:
    """Adds synchronous training's flags, as TF's ``mnist_replica.py`` names them, in a group of their own.

    ``--sync_replicas`` (off: asynchronous training), ``--replicas_to_aggregate``,
    ``--total_num_replicas``, ``--sync_timeout`` and ``--fraction_to_aggregate`` (elastic
    clusters); see :class:`psframe.SyncReplicas`.
    And ``--staleness_bound`` (asynchronous training with a bound, :class:`psframe.BoundedStaleness`,
    whose waits ``--sync_timeout`` bounds too).

    Args:
        parser: the script's parser.
    """
    group = parser.add_argument_group("synchronous training", "SyncReplicas (see psframe.SyncReplicas)")
    group.add_argument(
        "--sync_replicas",
        action="store_true",
        help="synchronous training: each update averages replicas_to_aggregate gradients",
    )
    group.add_argument(
        "--replicas_to_aggregate",
        type=int,
        default=None,
        help="gradients per synchronous update (default: the number of workers)",
    )
    group.add_argument(
        "--total_num_replicas",
        type=int,
        default=None,
        help="workers taking part in sync training (default: the number of workers)",
    )
    group.add_argument(
        "--fraction_to_aggregate",
        type=float,
        default=None,
        help="instead of --replicas_to_aggregate: the share of the workers whose gradients make an update, "
        "rounded up; in an elastic cluster (ps tasks given --max_workers) of the workers live at each step "
        "(default there: 1.0, all of them)",
    )
    group.add_argument(
        "--sync_timeout",
        type=float,
        default=300.0,
        help="seconds a synchronous step (or one under --staleness_bound) may wait before failing",
    )
    group.add_argument(
        "--staleness_bound",
        type=int,
        default=None,
        help="asynchronous training in which no worker runs more than this many steps ahead of the slowest "
        "(bounded staleness; 0: lockstep). Default: no bound",
    )


def cluster_from_flags(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, *, evaluator: bool = False
) -> tuple[ClusterSpec, str, int]:
    """This process's cluster and task, from :func:`add_cluster_flags`'s flags or ``TF_CONFIG``.

    The cluster comes from ``--ps_hosts``/``--worker_hosts`` (both needed),
    else ``--cluster_spec``, else ``TF_CONFIG`` (as TensorFlow reads it: a
    ``"chief"`` becomes worker 0). ``--job_name``/``--task_index`` win over
    ``TF_CONFIG``'s ``"task"``.

    Args:
        args: the parsed flags of a parser given :func:`add_cluster_flags`.
        environ: where ``TF_CONFIG`` is read; default: ``os.environ``.
        evaluator: accept the evaluator's task (``TF_CONFIG``'s ``"evaluator"``,
            or ``--job_name=evaluator``): it comes back as
            ``(cluster, "evaluator", index)``, index 0 if none is given. A
            script that runs :class:`psframe.Evaluator` for it passes True.

    Returns:
        ``(cluster, job_name, task_index)``, the task valid in the cluster,
        or the evaluator's.

    Raises:
        TypeError: ``args`` lacks the flags (the parser was not given them).
        ClusterSpecError: the flags define no cluster, or two, or no task; the
            task is not in the cluster (without ``evaluator=True``, the
            evaluator's is not); or ``TF_CONFIG`` is malformed.
    """
    values = _flags(args, CLUSTER_FLAGS, "add_cluster_flags")
    return resolve_cluster(**values, environ=environ, evaluator=evaluator)


def security_from_flags(args: argparse.Namespace) -> Security:
    """The :class:`~psframe.config.security.Security` of :func:`add_security_flags`'s flags and the environment.

    Pass it whole: ``psframe.Server(..., security=...)``, ``psframe.Trainer(..., security=...)``.

    Args:
        args: the parsed flags of a parser given :func:`add_security_flags`.

    Returns:
        The settings; those not given by a flag come from ``PSFRAME_*`` variables.

    Raises:
        TypeError: ``args`` lacks the flags (the parser was not given them).
        SecurityConfigError: a file cannot be read or holds no valid token.
    """
    return Security.resolve(**_flags(args, SECURITY_FLAGS, "add_security_flags"))


def liveness_from_flags(args: argparse.Namespace) -> Liveness:
    """The :class:`~psframe.config.liveness.Liveness` of :func:`add_liveness_flags`'s flags and the environment.

    Args:
        args: the parsed flags of a parser given :func:`add_liveness_flags`.

    Returns:
        The settings; those not given by a flag come from ``PSFRAME_KEEPALIVE_*``, then 5 s.

    Raises:
        TypeError: ``args`` lacks the flags (the parser was not given them).
        ValueError: a setting is not a valid number of seconds.
    """
    return Liveness.resolve(**_flags(args, LIVENESS_FLAGS, "add_liveness_flags"))


def sync_from_flags(args: argparse.Namespace) -> SyncReplicas | None:
    """The :class:`~psframe.SyncReplicas` of :func:`add_sync_flags`'s flags; None without ``--sync_replicas``.

    Pass it as ``psframe.Trainer(..., sync=...)``.

    Args:
        args: the parsed flags of a parser given :func:`add_sync_flags`.

    Raises:
        TypeError: ``args`` lacks the flags (the parser was not given them).
        ValueError: a count is not positive, or ``replicas_to_aggregate`` > ``total_num_replicas``.
    """
    from psframe.optim import SyncReplicas

    values = _flags(args, SYNC_FLAGS, "add_sync_flags")
    if not values["sync_replicas"]:
        return None
    return SyncReplicas(
        values["replicas_to_aggregate"],
        values["total_num_replicas"],
        values["sync_timeout"],
        values["fraction_to_aggregate"],
    )


def staleness_from_flags(args: argparse.Namespace) -> BoundedStaleness | None:
    """The :class:`~psframe.BoundedStaleness` of ``--staleness_bound`` (:func:`add_sync_flags`); None without it.

    Pass it as ``psframe.Trainer(..., staleness=...)``.

    Raises:
        TypeError: ``args`` lacks the flags (the parser was not given them).
        ValueError: a negative bound, or ``--sync_replicas`` too.
    """
    values = _flags(args, STALENESS_FLAGS, "add_sync_flags")
    if values["staleness_bound"] is None:
        return None
    if getattr(args, "sync_replicas", False):
        raise ValueError("--staleness_bound bounds asynchronous training; give it or --sync_replicas, not both")
    return BoundedStaleness(values["staleness_bound"], values["sync_timeout"])


def run(
    main: Callable[[], int | bool | None],
    *,
    expected: tuple[type[BaseException], ...] = (),
    prog: str | None = None,
) -> int:
    """Runs a script's ``main``; an expected failure ends it with one line on stderr and an exit code.

    A :class:`~psframe.errors.PsframeError` (no ps task came up in time, a
    port in use, a malformed ``--ps_hosts``, a task index out of range, tasks
    given different clusters, ...) or an exception of a class in ``expected``
    prints ``"PROG: error: MESSAGE"`` on stderr, as one line, and gives
    :data:`EXIT_FAILURE` (1): psframe's messages say what was expected and
    what to do, so no traceback follows. Ctrl-C (``KeyboardInterrupt``)
    prints ``"PROG: interrupted by Ctrl-C (SIGINT); stopped"`` and gives
    :data:`EXIT_INTERRUPTED` (130). A task that a signal stopped and that said
    so in its own line (:class:`~psframe.errors.TaskStopped`: a ps task's
    :meth:`psframe.Server.join` after Ctrl-C or SIGTERM, a worker given SIGTERM)
    gives its code (130, 143) and no second line. Any other exception is a bug
    (the script's or psframe's): it propagates with its traceback. Another
    ``SystemExit`` (argparse's usage errors, exit code 2) passes through unchanged.

    Args:
        main: the script's entry point, called with no arguments (a lambda
            passes some); it returns the exit code, None counting as 0, or a
            bool: True (``Server.join()``'s "training is over") is 0, False 1.
        expected: more exception classes to report in one line, such as
            ``FileNotFoundError`` for a data set that is not there, when
            their messages say what to do.
        prog: the name the line starts with; default: the file name of the
            script (``sys.argv[0]``), as argparse names it.

    Returns:
        ``main``'s exit code; :data:`EXIT_FAILURE` after an expected failure;
        :data:`EXIT_INTERRUPTED` after Ctrl-C; a stopped task's code (143 after SIGTERM).

    Raises:
        BaseException: whatever ``main`` raises that is neither a
            ``PsframeError``, one of ``expected``, nor ``KeyboardInterrupt``.

    Example::

        def main(argv: list[str] | None = None) -> int:
            args = parse_args(argv)
            cluster, job_name, task_index = flags.cluster_from_flags(args)
            ...

        if __name__ == "__main__":
            sys.exit(flags.run(main))
    """
    name = prog or os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python")
    reported: tuple[type[BaseException], ...] = (PsframeError, *expected)
    try:
        with stopping.named(name):  # the line a task stopped by a signal says starts with it too
            code = main()
    except TaskStopped as e:  # stopped by a signal, and said so in its line already (Ctrl-C too)
        return e.code if isinstance(e.code, int) else EXIT_FAILURE
    except KeyboardInterrupt:
        _say(f"{name}: interrupted by Ctrl-C (SIGINT); stopped")
        return EXIT_INTERRUPTED
    except reported as e:
        _say(f"{name}: error: {_one_line(e)}")
        return EXIT_FAILURE
    if isinstance(code, bool):  # psframe.Server.join(): True once training is over
        return 0 if code else EXIT_FAILURE
    return 0 if code is None else code


def _one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text or type(error).__name__


def _say(line: str) -> None:
    sys.stdout.flush()  # what the script printed comes first
    print(line, file=sys.stderr, flush=True)


def _flags(args: argparse.Namespace, names: tuple[str, ...], adder: str) -> dict[str, Any]:
    missing = [name for name in names if not hasattr(args, name)]
    if missing:
        raise TypeError(
            f"the parsed flags have no {', '.join('--' + n for n in missing)}; expected a parser given "
            f"psframe.flags.{adder}(parser)"
        )
    return {name: getattr(args, name) for name in names}

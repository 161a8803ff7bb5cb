"""Where a task learns its cluster and its own job and index.

A process is told its cluster by the ``--ps_hosts``/``--worker_hosts`` flags,
a ``--cluster_spec`` string such as ``'ps|h0:2222,worker|h1:2224'``, or the
``TF_CONFIG`` environment variable; its job and index come from
``--job_name``/``--task_index`` or the ``"task"`` of ``TF_CONFIG``.

``TF_CONFIG`` is read as TensorFlow reads it, so that the ``TF_CONFIG`` that
Kubeflow's TFJob operator (or another launcher) sets works unchanged: a TF2
``"chief"`` (or TF1 estimator ``"master"``) is folded into worker 0, and an
``"evaluator"`` is no part of the training cluster (TF's ``RunConfig``).

Every bad input raises :class:`~psframe.errors.ClusterSpecError`.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

from psframe.cluster.address import _describe
from psframe.cluster.spec import JOBS, ClusterSpec, _known_jobs
from psframe.errors import ClusterSpecError

EVALUATOR = "evaluator"
"""TF's task type for a process that evaluates checkpoints beside training; it is in no job."""

_CHIEF_TYPES = ("chief", "master")  # TF2's name, and TF1 estimator's (Cloud ML Engine, TFJob "Master")


def cluster_from_tf_config(
    tf_config: str | Mapping[str, Any] | None = None,
) -> tuple[ClusterSpec, str | None, int | None]:
    """Reads a cluster, and this process's task, from ``TF_CONFIG``.

    The JSON has the form ``{"cluster": {"ps": [...], "worker": [...]},
    "task": {"type": "worker", "index": 1}}``; other keys (TFJob's
    ``"environment": "cloud"``) are ignored. A TF2 ``"chief"`` job (exactly
    one address; TF1's ``"master"`` likewise) becomes worker 0: the workers
    are ``chief + worker``, task ``chief:0`` becomes ``("worker", 0)`` and
    ``worker:i`` becomes ``("worker", i + 1)``. An ``"evaluator"`` job is left
    out of the cluster, as TF leaves it out of training; the evaluator's own
    task comes back as ``("evaluator", i)``, which no job of the cluster has
    (:func:`resolve_cluster` refuses it unless given ``evaluator=True``, as
    a program that evaluates beside training does). A missing or empty
    ``"task"`` gives ``None, None``.

    Args:
        tf_config: the JSON text or the decoded mapping; ``None`` reads
            ``os.environ["TF_CONFIG"]``.

    Returns:
        ``(cluster, job_name, task_index)``.

    Raises:
        ClusterSpecError: ``TF_CONFIG`` unset or empty, invalid JSON, no
            ``"cluster"`` (or TFJob's ``"sparseCluster"``, which lacks the
            other workers), a bad chief, a task type or index that is not
            valid in the cluster, or anything :class:`ClusterSpec` refuses.

    Example:
        >>> cluster_from_tf_config('{"cluster": {"chief": ["h1:2224"], "ps": ["h0:2222"],'
        ...                        ' "worker": ["h1:2225"]}, "task": {"type": "worker", "index": 0}}')
        (ClusterSpec('ps|h0:2222,worker|h1:2224;h1:2225'), 'worker', 1)
    """
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if tf_config is None:
            raise ClusterSpecError(
                "TF_CONFIG is not set; expected a JSON cluster such as "
                '\'{"cluster": {"ps": ["h0:2222"], "worker": ["h1:2224"]}}\''
            )
    if isinstance(tf_config, str):
        if not tf_config.strip():
            raise ClusterSpecError(f'TF_CONFIG is empty ({tf_config!r}); expected a JSON object with a "cluster" key')
        try:
            tf_config = json.loads(tf_config)
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"TF_CONFIG is not valid JSON ({e}): {tf_config!r}") from e
    if not isinstance(tf_config, Mapping):
        raise ClusterSpecError(f'TF_CONFIG must be a JSON object with a "cluster" key, got {_describe(tf_config)}')
    if "cluster" not in tf_config:
        if "sparseCluster" in tf_config:
            raise ClusterSpecError(
                'TF_CONFIG has a "sparseCluster" (a TFJob with enableDynamicWorker: true), which names only '
                "this task and the ps tasks; psframe needs every worker's address: turn enableDynamicWorker off"
            )
        raise ClusterSpecError(f'TF_CONFIG has no "cluster" key; found keys {sorted(tf_config)}')
    jobs = tf_config["cluster"]
    if not isinstance(jobs, Mapping):
        raise ClusterSpecError(
            f'TF_CONFIG "cluster" must be an object mapping job names to addresses, got {_describe(jobs)}'
        )
    jobs = dict(jobs)
    evaluators = jobs.pop(EVALUATOR, None)
    chief_type, chief = _pop_chief(jobs)
    if chief is not None:
        workers = jobs.get("worker", [])
        if isinstance(workers, (str, bytes)) or not isinstance(workers, Sequence):
            raise ClusterSpecError(f"TF_CONFIG job 'worker' must be a list of addresses, got {_describe(workers)}")
        jobs["worker"] = [*chief, *workers]
    try:
        cluster = ClusterSpec(jobs)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"TF_CONFIG: {e}") from e

    task = tf_config.get("task")
    if task is None or (isinstance(task, Mapping) and not task):
        return cluster, None, None
    if not isinstance(task, Mapping):
        raise ClusterSpecError(
            f'TF_CONFIG "task" must be an object like {{"type": "worker", "index": 0}}, got {_describe(task)}'
        )
    task_type, task_index = task.get("type"), task.get("index")
    known = (*((chief_type,) if chief is not None else ()), *JOBS, EVALUATOR)
    if task_type not in known:
        raise ClusterSpecError(
            f"TF_CONFIG task type {task_type!r} is not a job of the cluster; expected one of {list(known)}"
        )
    if task_index is None:
        raise ClusterSpecError(f'TF_CONFIG task {dict(task)} has no "index"; expected an int')
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ClusterSpecError(f"TF_CONFIG task index must be an int, got {_describe(task_index)}")
    # Check the index against the job as TF_CONFIG wrote it, so the message uses the user's numbers.
    if task_type == EVALUATOR:
        # Some launchers list the evaluator in the cluster, others (older TFJob operators) do not.
        n = len(evaluators) if isinstance(evaluators, Sequence) and not isinstance(evaluators, str) else None
    elif task_type == chief_type:
        n = 1
    elif task_type == "worker" and chief is not None:
        n = cluster.num_workers - 1
    else:
        n = cluster.num_tasks(str(task_type))
    if n is None:
        if task_index < 0:
            raise ClusterSpecError(f"TF_CONFIG task index {task_index} of the evaluator must be >= 0")
    elif not 0 <= task_index < n:
        raise ClusterSpecError(
            f"TF_CONFIG task index {task_index} is out of range for job {task_type!r} with {n} task{'s' * (n != 1)} "
            f"(expected 0..{n - 1})"
        )
    if task_type == chief_type:
        return cluster, "worker", 0
    if task_type == "worker" and chief is not None:
        return cluster, "worker", task_index + 1
    return cluster, task_type, task_index


def _pop_chief(jobs: dict[str, Any]) -> tuple[str | None, Sequence[str] | None]:
    """Takes the chief job (``"chief"`` or ``"master"``, one address) out of ``jobs``."""
    given = [t for t in _CHIEF_TYPES if t in jobs]
    if len(given) > 1:
        raise ClusterSpecError(
            f"TF_CONFIG has both a 'chief' and a 'master' job ({jobs['chief']!r} and "
            f"{jobs['master']!r}); give one chief"
        )
    if not given:
        return None, None
    chief_type = given[0]
    chief = jobs.pop(chief_type)
    if isinstance(chief, (str, bytes)) or not isinstance(chief, Sequence) or len(chief) != 1:
        raise ClusterSpecError(f"TF_CONFIG job {chief_type!r} must list exactly one address, got {_describe(chief)}")
    return chief_type, chief


def resolve_cluster(
    ps_hosts: str | None = None,
    worker_hosts: str | None = None,
    cluster_spec: str | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    evaluator: bool = False,
) -> tuple[ClusterSpec, str, int]:
    """Works out this process's cluster and task from command-line flags and the environment.

    The cluster comes from ``--ps_hosts``/``--worker_hosts`` (both needed),
    else ``--cluster_spec``, else ``TF_CONFIG``. ``TF_CONFIG`` is read only
    when no flag defines the cluster; then its task is used unless
    ``job_name``/``task_index`` are given, which win. An empty string counts
    as not given (argparse defaults).

    A program that runs an evaluator beside training (:class:`psframe.Evaluator`)
    passes ``evaluator=True``: the evaluator's task (job ``"evaluator"``, from
    ``TF_CONFIG`` or ``job_name``) then comes back as ``("evaluator", i)``,
    index 0 if none is given, instead of being refused.

    Args:
        ps_hosts: the ``--ps_hosts`` flag, ``"h0:2222,h0:2223"``.
        worker_hosts: the ``--worker_hosts`` flag.
        cluster_spec: the ``--cluster_spec`` flag, ``'ps|h0:2222,worker|h1:2224'``.
        job_name: the ``--job_name`` flag.
        task_index: the ``--task_index`` flag.
        environ: where to read ``TF_CONFIG``; defaults to ``os.environ``.
        evaluator: whether the evaluator's task is accepted.

    Returns:
        ``(cluster, job_name, task_index)``, the task valid in the cluster
        (or the evaluator's, with ``evaluator=True``).

    Raises:
        ClusterSpecError: only one of the host flags; host flags together with
            ``--cluster_spec``; nothing that defines a cluster; no job name or
            task index; a task that is not in the cluster; or, without
            ``evaluator=True``, TF_CONFIG's evaluator (see :func:`cluster_from_tf_config`).

    Example:
        >>> resolve_cluster(ps_hosts="h0:2222", worker_hosts="h1:2224,h1:2225", job_name="worker", task_index=1)
        (ClusterSpec('ps|h0:2222,worker|h1:2224;h1:2225'), 'worker', 1)
    """
    environ = os.environ if environ is None else environ
    has_ps, has_workers, has_spec = bool(ps_hosts), bool(worker_hosts), bool(cluster_spec)
    tf_job: str | None = None
    tf_index: int | None = None
    if has_ps != has_workers:
        given, missing = ("--ps_hosts", "--worker_hosts") if has_ps else ("--worker_hosts", "--ps_hosts")
        raise ClusterSpecError(f"{given} was given without {missing}; give both, or --cluster_spec instead")
    if has_ps and has_spec:
        raise ClusterSpecError(
            f"give either --ps_hosts/--worker_hosts or --cluster_spec, not both "
            f"(got --ps_hosts={ps_hosts!r} --worker_hosts={worker_hosts!r} --cluster_spec={cluster_spec!r})"
        )
    if has_ps:
        cluster = ClusterSpec.from_hosts(ps_hosts, worker_hosts)  # type: ignore[arg-type]
        source = "--ps_hosts/--worker_hosts"
    elif has_spec:
        cluster = ClusterSpec.from_string(cluster_spec)  # type: ignore[arg-type]
        source = "--cluster_spec"
    elif environ.get("TF_CONFIG", "").strip():
        cluster, tf_job, tf_index = cluster_from_tf_config(environ["TF_CONFIG"])
        source = "TF_CONFIG"
    else:
        raise ClusterSpecError(
            "no cluster is defined; give --ps_hosts and --worker_hosts, or --cluster_spec, or set TF_CONFIG"
        )
    job = job_name or tf_job
    if job is None:
        raise ClusterSpecError(
            f'no job name; give --job_name ({_known_jobs()}) or a TF_CONFIG "task" (cluster from {source})'
        )
    if job == EVALUATOR and evaluator:
        index = task_index if task_index is not None else tf_index
        if index is None:
            return cluster, EVALUATOR, 0
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ClusterSpecError(f"the evaluator's task index must be an int >= 0, got {_describe(index)}")
        return cluster, EVALUATOR, index
    if job == EVALUATOR:
        raise ClusterSpecError(
            "this process is TF_CONFIG's evaluator, which takes no part in training (it is in no job of the "
            "cluster); a program that evaluates checkpoints beside training (psframe.Evaluator) asks for "
            "its task with psframe.flags.cluster_from_flags(args, evaluator=True), or runs 'psframe evaluate'"
        )
    index = task_index if task_index is not None else tf_index
    if index is None:
        raise ClusterSpecError(
            f'no task index for job {job!r}; give --task_index or a TF_CONFIG "task" (cluster from {source})'
        )
    try:
        cluster.validate_task(job, index)
    except ClusterSpecError as e:
        n = cluster.num_tasks(job) if job in JOBS else 0
        if not n or isinstance(index, bool) or not isinstance(index, int):
            raise
        # Out of range: say which flag to change, and where the job's addresses come from.
        where = f"--{job}_hosts" if source.startswith("--ps_hosts") else source
        raise ClusterSpecError(
            f"{e}: give --task_index from 0 to {n - 1}, or add this task's address to {where}"
        ) from e
    return cluster, job, operator.index(index)


__all__ = ["EVALUATOR", "cluster_from_tf_config", "resolve_cluster"]

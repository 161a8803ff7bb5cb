"""Cluster definitions: who the tasks are and where they listen.

A cluster maps each job name (``"ps"``, ``"worker"``) to the ordered addresses
of its tasks, as TensorFlow's ``tf.train.ClusterSpec`` does. This module reads
a cluster from every place a TF user would give one -- a dict, the
``--ps_hosts``/``--worker_hosts`` flags, the ``grpc_tensorflow_server`` string
``'ps|h0:2222;h0:2223,worker|h1:2224'`` or the ``TF_CONFIG`` variable -- and
parses TF device strings such as ``'/job:ps/task:1'``.

Every bad input raises :class:`~psframe.errors.ClusterSpecError` with a message
that says what was expected and what was found.

Example:
    >>> cluster = ClusterSpec.from_hosts("h0:2222,h0:2223", "h1:2224")
    >>> cluster.task_address("ps", 1)
    'h0:2223'
    >>> DeviceSpec.parse("/job:ps/task:1").validate(cluster)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from psframe.errors import ClusterSpecError

JOBS: tuple[str, ...] = ("ps", "worker")
"""The only job names psframe knows, in canonical order."""

# Host names and IPv4 addresses; IPv6 (with an optional zone) goes in brackets.
# Separators of the string formats (',', ';', '|') can never appear in a host,
# so from_string(to_string()) always round-trips.
_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_IPV6_RE = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9._-]+)?")


def _known_jobs() -> str:
    return " and ".join(repr(j) for j in JOBS)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def parse_address(address: str) -> tuple[str, int]:
    """Splits a task address into host and port.

    Args:
        address: ``"host:port"``, ``"1.2.3.4:2222"`` or ``"[::1]:2222"`` (an
            IPv6 host goes in brackets). Surrounding whitespace is ignored.

    Returns:
        ``(host, port)``; an IPv6 host is returned without its brackets.

    Raises:
        ClusterSpecError: the address is not a string, is empty, contains
            whitespace, has no port, an empty or malformed host, or a port that
            is not an integer in 1..65535.

    Example:
        >>> parse_address("[::1]:2222")
        ('::1', 2222)
    """
    if not isinstance(address, str):
        raise ClusterSpecError(f"a task address must be a 'host:port' string, got {_describe(address)}")
    text = address.strip()
    if not text:
        raise ClusterSpecError(f"task address {address!r} is empty; expected 'host:port' such as 'h0:2222'")
    if any(c.isspace() for c in text):
        raise ClusterSpecError(f"task address {address!r} contains whitespace; expected 'host:port' such as 'h0:2222'")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ClusterSpecError(f"task address {address!r} opens '[' without a closing ']'; expected '[ipv6]:port'")
        host, rest = text[1:close], text[close + 1 :]
        if not rest.startswith(":"):
            raise ClusterSpecError(f"task address {address!r} has no port; expected '[ipv6]:port' such as '[::1]:2222'")
        port_text = rest[1:]
        if not host:
            raise ClusterSpecError(f"task address {address!r} has an empty host; expected '[ipv6]:port'")
        if not _IPV6_RE.fullmatch(host):
            raise ClusterSpecError(f"task address {address!r} has {host!r} in brackets; expected an IPv6 address")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ClusterSpecError(f"task address {address!r} has no port; expected 'host:port' such as '{text}:2222'")
        if ":" in host:
            raise ClusterSpecError(
                f"task address {address!r} has more than one ':'; an IPv6 host goes in brackets, as in '[::1]:2222'"
            )
        if not host:
            raise ClusterSpecError(f"task address {address!r} has an empty host; expected 'host:port' like 'h0:2222'")
        if not _HOST_RE.fullmatch(host):
            raise ClusterSpecError(
                f"task address {address!r} has host {host!r}; expected letters, digits, '.', '-' and '_' only"
            )
    # isdigit() alone would accept '²' and int() would accept '+1' or '1_0'.
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ClusterSpecError(f"task address {address!r} has port {port_text!r}; expected an integer in 1..65535")
    return host, int(port_text)


def _check_job_name(job_name: object) -> str:
    if not isinstance(job_name, str):
        raise ClusterSpecError(f"a job name must be a string, one of {_known_jobs()}; got {_describe(job_name)}")
    if job_name not in JOBS:
        hint = " (a TF2 'chief' is folded into 'worker' by cluster_from_tf_config)" if job_name == "chief" else ""
        raise ClusterSpecError(f"unknown job {job_name!r}; psframe knows only {_known_jobs()}{hint}")
    return job_name


def _check_index(task_index: object, what: str = "task_index") -> int:
    if isinstance(task_index, (bool, str, bytes)):
        raise ClusterSpecError(f"{what} must be an int, got {_describe(task_index)}")
    try:
        return operator.index(task_index)  # type: ignore[arg-type]
    except TypeError:
        raise ClusterSpecError(f"{what} must be an int, got {_describe(task_index)}") from None


def _job_addresses(job: str, tasks: object) -> list[str]:
    if isinstance(tasks, Mapping):
        indices = []
        for key in tasks:
            if isinstance(key, bool) or not isinstance(key, int):
                raise ClusterSpecError(
                    f"job {job!r} maps task indices to addresses; expected int keys, got {_describe(key)}"
                )
            indices.append(key)
        missing = sorted(set(range(len(indices))) - set(indices))
        if missing:
            raise ClusterSpecError(
                f"job {job!r} has task indices {sorted(indices)}; expected every index 0..{len(indices) - 1} "
                f"(missing {missing})"
            )
        tasks = [tasks[i] for i in range(len(indices))]
    elif isinstance(tasks, (str, bytes)) or not isinstance(tasks, Sequence):
        raise ClusterSpecError(
            f"job {job!r} must map to a list of 'host:port' addresses or an {{index: address}} dict, "
            f"got {_describe(tasks)}"
        )
    addresses = []
    for address in tasks:
        parse_address(address)
        addresses.append(address.strip())
    return addresses


class ClusterSpec:
    """An immutable map from job name to the ordered addresses of its tasks.

    psframe's counterpart of ``tf.train.ClusterSpec``. Both jobs, ``"ps"`` and
    ``"worker"``, must be present and non-empty, and no address may be used by
    two tasks.

    Args:
        cluster: a mapping from job name to a list of ``"host:port"`` strings,
            or (as TF accepts) to an ``{index: address}`` dict with indices
            ``0..n-1``; or another ``ClusterSpec`` (copied).

    Raises:
        ClusterSpecError: an unknown or missing job, a job without tasks, a bad
            address, sparse task indices, or an address given twice.

    Example:
        >>> cluster = ClusterSpec({"ps": ["h0:2222"], "worker": {0: "h1:2224", 1: "h1:2225"}})
        >>> cluster.num_workers, str(cluster)
        (2, 'ps|h0:2222,worker|h1:2224;h1:2225')
    """

    __slots__ = ("_tasks", "_fingerprint")
    _tasks: dict[str, tuple[str, ...]]
    _fingerprint: str

    def __init__(self, cluster: Mapping[str, Sequence[str] | Mapping[int, str]] | ClusterSpec) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, Mapping):
            raise ClusterSpecError(
                f"a cluster must be a mapping from job name ({_known_jobs()}) to task addresses, "
                f"got {_describe(cluster)}"
            )
        given = {_check_job_name(job): _job_addresses(job, tasks) for job, tasks in cluster.items()}
        for job in JOBS:
            if job not in given:
                raise ClusterSpecError(
                    f"the cluster has no {job!r} job; expected both {_known_jobs()}, got {sorted(given)}"
                )
            if not given[job]:
                raise ClusterSpecError(f"job {job!r} has no tasks; expected at least one 'host:port' address")
        owner: dict[tuple[str, int], str] = {}
        for job in JOBS:
            for index, address in enumerate(given[job]):
                host, port = parse_address(address)
                key = (host.lower(), port)  # host names are case-insensitive
                name = self.task_name(job, index)
                if key in owner:
                    raise ClusterSpecError(
                        f"address {address!r} is given twice, to {owner[key]} and {name}; every task needs its own port"
                    )
                owner[key] = name
        object.__setattr__(self, "_tasks", {job: tuple(given[job]) for job in JOBS})
        # Computed once: every request a ps task answers checks it.
        object.__setattr__(self, "_fingerprint",
                           hashlib.sha256(self.to_string().encode("utf-8")).hexdigest()[:16])

    @classmethod
    def from_hosts(cls, ps_hosts: str | Sequence[str], worker_hosts: str | Sequence[str]) -> ClusterSpec:
        """Builds a cluster from the ``--ps_hosts``/``--worker_hosts`` flags.

        Args:
            ps_hosts: comma-separated addresses (``"h0:2222,h0:2223"``) or a list.
            worker_hosts: the same for the workers.

        Returns:
            The cluster.

        Raises:
            ClusterSpecError: an empty list, an empty item (``"h0:2222,"``), or
                anything :class:`ClusterSpec` refuses.

        Example:
            >>> ClusterSpec.from_hosts("h0:2222", ["h1:2224", "h1:2225"]).num_workers
            2
        """
        return cls({"ps": _split_hosts(ps_hosts, "ps_hosts"), "worker": _split_hosts(worker_hosts, "worker_hosts")})

    @classmethod
    def from_string(cls, spec: str) -> ClusterSpec:
        """Parses the ``grpc_tensorflow_server`` format ``'ps|h0:2222;h0:2223,worker|h1:2224'``.

        Jobs are separated by ``','``; each is ``job|address;address;...``.

        Args:
            spec: the cluster string.

        Returns:
            The cluster.

        Raises:
            ClusterSpecError: a job without ``'|'``, an empty job name, a job
                given twice, an empty address list or item, or anything
                :class:`ClusterSpec` refuses.

        Example:
            >>> ClusterSpec.from_string("ps|h0:2222,worker|h1:2224").task_address("worker", 0)
            'h1:2224'
        """
        if not isinstance(spec, str):
            raise ClusterSpecError(
                f"a cluster spec must be a string like 'ps|h0:2222,worker|h1:2224', got {_describe(spec)}"
            )
        if not spec.strip():
            raise ClusterSpecError(f"cluster spec {spec!r} is empty; expected 'ps|h0:2222,worker|h1:2224'")
        jobs: dict[str, list[str]] = {}
        for part in spec.split(","):
            job, sep, addresses = part.partition("|")
            job = job.strip()
            if not sep:
                raise ClusterSpecError(
                    f"cluster spec {spec!r} has {part!r} without '|'; expected 'job|host:port;host:port' per job"
                )
            if not job:
                raise ClusterSpecError(f"cluster spec {spec!r} has {part!r} with an empty job name; expected 'job|...'")
            if job in jobs:
                raise ClusterSpecError(f"cluster spec {spec!r} gives job {job!r} twice; expected each job once")
            if not addresses.strip():
                raise ClusterSpecError(
                    f"cluster spec {spec!r} gives job {job!r} no addresses; expected '{job}|host:port;host:port'"
                )
            items = addresses.split(";")
            for i, item in enumerate(items):
                if not item.strip():
                    raise ClusterSpecError(
                        f"cluster spec {spec!r} has an empty address at position {i} of job {job!r}"
                    )
            jobs[job] = items
        return cls(jobs)

    def to_string(self) -> str:
        """Returns the ``grpc_tensorflow_server`` form, jobs in ``JOBS`` order; inverse of :meth:`from_string`."""
        return ",".join(f"{job}|{';'.join(self._tasks[job])}" for job in JOBS)

    def as_dict(self) -> dict[str, list[str]]:
        """Returns a fresh ``{job: [address, ...]}`` dict; changing it leaves the cluster as it is."""
        return {job: list(tasks) for job, tasks in self._tasks.items()}

    @property
    def jobs(self) -> list[str]:
        """The job names, in ``JOBS`` order."""
        return list(self._tasks)

    def num_tasks(self, job_name: str) -> int:
        """Returns the number of tasks of ``job_name``; raises ClusterSpecError for an unknown job."""
        return len(self._tasks[_check_job_name(job_name)])

    @property
    def num_ps(self) -> int:
        """The number of ps tasks."""
        return len(self._tasks["ps"])

    @property
    def num_workers(self) -> int:
        """The number of worker tasks."""
        return len(self._tasks["worker"])

    def job_tasks(self, job_name: str) -> list[str]:
        """Returns the addresses of ``job_name``'s tasks, in task order; raises ClusterSpecError for an unknown job."""
        return list(self._tasks[_check_job_name(job_name)])

    def task_address(self, job_name: str, task_index: int) -> str:
        """Returns the address of one task.

        Args:
            job_name: ``"ps"`` or ``"worker"``.
            task_index: the task's index in its job.

        Returns:
            The ``"host:port"`` address.

        Raises:
            ClusterSpecError: as :meth:`validate_task`.

        Example:
            >>> ClusterSpec.from_string("ps|h0:2222,worker|h1:2224").task_address("ps", 0)
            'h0:2222'
        """
        self.validate_task(job_name, task_index)
        return self._tasks[job_name][operator.index(task_index)]

    def validate_task(self, job_name: str, task_index: int) -> None:
        """Checks that ``(job_name, task_index)`` names a task of this cluster.

        Args:
            job_name: ``"ps"`` or ``"worker"``.
            task_index: an int in ``0..num_tasks(job_name) - 1``.

        Raises:
            ClusterSpecError: an unknown job, or an index that is not an int,
                negative or out of range.

        Example:
            >>> ClusterSpec.from_string("ps|h0:2222,worker|h1:2224").validate_task("worker", 0)
        """
        n = self.num_tasks(job_name)
        index = _check_index(task_index)
        if not 0 <= index < n:
            raise ClusterSpecError(
                f"task_index {index} is out of range for job {job_name!r} with {n} task{'s' * (n != 1)} "
                f"(expected 0..{n - 1})"
            )

    @property
    def fingerprint(self) -> str:
        """A short hash of the cluster (16 hex chars); tasks compare it to detect a mismatched cluster."""
        return self._fingerprint

    @staticmethod
    def task_name(job_name: str, task_index: int) -> str:
        """Returns TF's name for a task, such as ``'/job:ps/task:1'``.

        Raises:
            ClusterSpecError: an unknown job or a task index that is not a non-negative int.
        """
        index = _check_index(task_index)
        if index < 0:
            raise ClusterSpecError(f"task_index must be >= 0, got {index}")
        return f"/job:{_check_job_name(job_name)}/task:{index}"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"ClusterSpec is immutable; cannot set {name!r}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (ClusterSpec, (self.as_dict(),))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._tasks == other._tasks

    def __hash__(self) -> int:
        return hash(tuple(self._tasks.items()))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.to_string()!r})"

    def __str__(self) -> str:
        return self.to_string()


def _split_hosts(hosts: str | Sequence[str], flag: str) -> list[str]:
    if isinstance(hosts, str):
        if not hosts.strip():
            return []  # ClusterSpec reports the empty job
        items = hosts.split(",")
    elif isinstance(hosts, Sequence) and not isinstance(hosts, bytes):
        items = list(hosts)
    else:
        raise ClusterSpecError(f"--{flag} must be comma-separated 'host:port' addresses, got {_describe(hosts)}")
    for i, item in enumerate(items):
        if isinstance(item, str) and not item.strip():
            raise ClusterSpecError(
                f"--{flag}={hosts!r} has an empty address at position {i}; expected 'h0:2222,h0:2223'"
            )
    return items


def cluster_from_tf_config(
    tf_config: str | Mapping[str, Any] | None = None,
) -> tuple[ClusterSpec, str | None, int | None]:
    """Reads a cluster, and this process's task, from ``TF_CONFIG``.

    The JSON has the form ``{"cluster": {"ps": [...], "worker": [...]},
    "task": {"type": "worker", "index": 1}}``. A TF2 ``"chief"`` job (exactly
    one address) becomes worker 0: the workers are ``chief + worker``, task
    ``chief:0`` becomes ``("worker", 0)`` and ``worker:i`` becomes
    ``("worker", i + 1)``. A missing or empty ``"task"`` gives ``None, None``.

    Args:
        tf_config: the JSON text or the decoded mapping; ``None`` reads
            ``os.environ["TF_CONFIG"]``.

    Returns:
        ``(cluster, job_name, task_index)``.

    Raises:
        ClusterSpecError: ``TF_CONFIG`` unset or empty, invalid JSON, no
            ``"cluster"``, a bad chief, a task type or index that is not valid
            in the cluster, or anything :class:`ClusterSpec` refuses.

    Example:
        >>> cluster_from_tf_config('{"cluster": {"chief": ["h1:2224"], "ps": ["h0:2222"],'
        ...                        ' "worker": ["h1:2225"]}, "task": {"type": "worker", "index": 0}}')
        (ClusterSpec('ps|h0:2222,worker|h1:2224;h1:2225'), 'worker', 1)
    """
    if tf_config is None:
        tf_config = os.environ.get("TF_CONFIG")
        if tf_config is None:
            raise ClusterSpecError("TF_CONFIG is not set; expected a JSON cluster such as "
                                   '\'{"cluster": {"ps": ["h0:2222"], "worker": ["h1:2224"]}}\'')
    if isinstance(tf_config, str):
        if not tf_config.strip():
            raise ClusterSpecError(f"TF_CONFIG is empty ({tf_config!r}); expected a JSON object with a \"cluster\" key")
        try:
            tf_config = json.loads(tf_config)
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"TF_CONFIG is not valid JSON ({e}): {tf_config!r}") from e
    if not isinstance(tf_config, Mapping):
        raise ClusterSpecError(f"TF_CONFIG must be a JSON object with a \"cluster\" key, got {_describe(tf_config)}")
    if "cluster" not in tf_config:
        raise ClusterSpecError(f"TF_CONFIG has no \"cluster\" key; found keys {sorted(tf_config)}")
    jobs = tf_config["cluster"]
    if not isinstance(jobs, Mapping):
        raise ClusterSpecError(
            f"TF_CONFIG \"cluster\" must be an object mapping job names to addresses, got {_describe(jobs)}"
        )
    jobs = dict(jobs)
    chief = jobs.pop("chief", None)
    if chief is not None:
        if isinstance(chief, (str, bytes)) or not isinstance(chief, Sequence) or len(chief) != 1:
            raise ClusterSpecError(f"TF_CONFIG job 'chief' must list exactly one address, got {_describe(chief)}")
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
            f"TF_CONFIG \"task\" must be an object like {{\"type\": \"worker\", \"index\": 0}}, got {_describe(task)}"
        )
    task_type, task_index = task.get("type"), task.get("index")
    known = ("chief", *JOBS) if chief is not None else JOBS
    if task_type not in known:
        raise ClusterSpecError(
            f"TF_CONFIG task type {task_type!r} is not a job of the cluster; expected one of {list(known)}"
        )
    if task_index is None:
        raise ClusterSpecError(f"TF_CONFIG task {dict(task)} has no \"index\"; expected an int")
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise ClusterSpecError(f"TF_CONFIG task index must be an int, got {_describe(task_index)}")
    # Check the index against the job as TF_CONFIG wrote it, so the message uses the user's numbers.
    if task_type == "chief":
        n = 1
    elif task_type == "worker" and chief is not None:
        n = cluster.num_workers - 1
    else:
        n = cluster.num_tasks(task_type)
    if not 0 <= task_index < n:
        raise ClusterSpecError(
            f"TF_CONFIG task index {task_index} is out of range for job {task_type!r} with {n} task{'s' * (n != 1)} "
            f"(expected 0..{n - 1})"
        )
    if task_type == "chief":
        return cluster, "worker", 0
    if task_type == "worker" and chief is not None:
        return cluster, "worker", task_index + 1
    return cluster, task_type, task_index


def resolve_cluster(
    ps_hosts: str | None = None,
    worker_hosts: str | None = None,
    cluster_spec: str | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[ClusterSpec, str, int]:
    """Works out this process's cluster and task from command-line flags and the environment.

    The cluster comes from ``--ps_hosts``/``--worker_hosts`` (both needed),
    else ``--cluster_spec``, else ``TF_CONFIG``. ``TF_CONFIG`` is read only
    when no flag defines the cluster; then its task is used unless
    ``job_name``/``task_index`` are given, which win. An empty string counts
    as not given (argparse defaults).

    Args:
        ps_hosts: the ``--ps_hosts`` flag, ``"h0:2222,h0:2223"``.
        worker_hosts: the ``--worker_hosts`` flag.
        cluster_spec: the ``--cluster_spec`` flag, ``'ps|h0:2222,worker|h1:2224'``.
        job_name: the ``--job_name`` flag.
        task_index: the ``--task_index`` flag.
        environ: where to read ``TF_CONFIG``; defaults to ``os.environ``.

    Returns:
        ``(cluster, job_name, task_index)``, the task valid in the cluster.

    Raises:
        ClusterSpecError: only one of the host flags; host flags together with
            ``--cluster_spec``; nothing that defines a cluster; no job name or
            task index; or a task that is not in the cluster.

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
            f"no job name; give --job_name ({_known_jobs()}) or a TF_CONFIG \"task\" (cluster from {source})"
        )
    index = task_index if task_index is not None else tf_index
    if index is None:
        raise ClusterSpecError(
            f"no task index for job {job!r}; give --task_index or a TF_CONFIG \"task\" (cluster from {source})"
        )
    cluster.validate_task(job, index)
    return cluster, job, operator.index(index)


_DEVICE_TYPES = {"CPU": "CPU", "GPU": "GPU", "CUDA": "GPU"}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A TF device string such as ``'/job:ps/task:1'`` or ``'/job:worker/replica:0/task:0/device:GPU:0'``.

    Every part is optional. ``device_type`` is ``"CPU"`` or ``"GPU"``
    (``"cuda"`` is read as ``"GPU"``, case does not matter); a
    ``device_index`` of ``None`` with a type means any device of that type.

    Raises:
        ClusterSpecError: a field of the wrong type, a negative number, an
            unknown device type, or a device index without a device type.

    Example:
        >>> DeviceSpec.parse("/gpu:1/job:worker/task:0").to_string()
        '/job:worker/task:0/device:GPU:1'
    """

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        if self.job is not None and (not isinstance(self.job, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job)):
            raise ClusterSpecError(f"device job must be a name such as 'ps', got {_describe(self.job)}")
        for field in ("replica", "task", "device_index"):
            value = getattr(self, field)
            if value is not None:
                index = _check_index(value, f"device {field}")
                if index < 0:
                    raise ClusterSpecError(f"device {field} must be >= 0, got {index}")
                object.__setattr__(self, field, index)
        if self.device_type is not None:
            kind = _DEVICE_TYPES.get(self.device_type.upper()) if isinstance(self.device_type, str) else None
            if kind is None:
                raise ClusterSpecError(
                    f"device type must be 'CPU' or 'GPU' (or 'cuda'), got {_describe(self.device_type)}"
                )
            object.__setattr__(self, "device_type", kind)
        elif self.device_index is not None:
            raise ClusterSpecError(f"device_index {self.device_index} needs a device_type ('CPU' or 'GPU')")

    @classmethod
    def parse(cls, spec: str) -> DeviceSpec:
        """Parses a TF device string; components may come in any order.

        Components: ``/job:NAME``, ``/replica:N``, ``/task:N``,
        ``/device:TYPE:N`` (``N`` may be ``*`` or left out, meaning any), and
        the short forms ``/cpu:N``, ``/gpu:N``, ``/cuda:N``. ``''`` gives a
        spec with every part ``None``.

        Args:
            spec: the device string.

        Returns:
            The parsed spec.

        Raises:
            ClusterSpecError: no leading ``'/'``, an unknown or empty component,
                a number that is not a non-negative integer, or a component
                given twice.

        Example:
            >>> DeviceSpec.parse("/job:ps/task:1")
            DeviceSpec(job='ps', replica=None, task=1, device_type=None, device_index=None)
        """
        if not isinstance(spec, str):
            raise ClusterSpecError(f"a device must be a string such as '/job:ps/task:0', got {_describe(spec)}")
        if spec == "":
            return cls()
        if not spec.startswith("/"):
            raise ClusterSpecError(f"device {spec!r} must start with '/', as in '/job:ps/task:0'")
        parts: dict[str, Any] = {}

        def put(key: str, value: Any, component: str) -> None:
            if key in parts:
                raise ClusterSpecError(f"device {spec!r} gives the {key} twice (again in {component!r})")
            parts[key] = value

        def number(text: str, component: str, wildcard: bool = False) -> int | None:
            if wildcard and text == "*":
                return None
            if not (text.isascii() and text.isdigit()):
                raise ClusterSpecError(
                    f"device {spec!r} has {component!r}; expected a non-negative integer, got {text!r}"
                )
            return int(text)

        for component in spec[1:].split("/"):
            name, _, rest = component.partition(":")
            lowered = name.lower()
            if lowered in ("job", "replica", "task", "device") and not rest:
                raise ClusterSpecError(f"device {spec!r} has {component!r} without a value; expected '{lowered}:...'")
            if lowered == "job":
                put("job", rest, component)
            elif lowered in ("replica", "task"):
                put(lowered, number(rest, component), component)
            elif lowered == "device":
                kind, _, index = rest.partition(":")
                if kind.upper() not in _DEVICE_TYPES:
                    raise ClusterSpecError(f"device {spec!r} has device type {kind!r}; expected 'CPU' or 'GPU'")
                put("device", (kind, number(index, component, wildcard=True) if index else None), component)
            elif lowered.upper() in _DEVICE_TYPES and rest:
                put("device", (name, number(rest, component, wildcard=True)), component)
            else:
                raise ClusterSpecError(
                    f"device {spec!r} has unknown component {component!r}; expected /job:NAME, /replica:N, "
                    f"/task:N, /device:CPU:N, /device:GPU:N, /cpu:N or /gpu:N"
                )
        kind, index = parts.pop("device", (None, None))
        return cls(job=parts.get("job"), replica=parts.get("replica"), task=parts.get("task"),
                   device_type=kind, device_index=index)

    def to_string(self) -> str:
        """Returns the canonical form ``/job:ps/replica:0/task:1/device:GPU:0``, absent parts left out."""
        out = ""
        if self.job is not None:
            out += f"/job:{self.job}"
        if self.replica is not None:
            out += f"/replica:{self.replica}"
        if self.task is not None:
            out += f"/task:{self.task}"
        if self.device_type is not None:
            out += f"/device:{self.device_type}" + (f":{self.device_index}" if self.device_index is not None else "")
        return out

    def validate(self, cluster: ClusterSpec) -> None:
        """Checks that the job (if given) exists in ``cluster`` and the task (if given) is in range.

        Args:
            cluster: the cluster the device must belong to.

        Raises:
            ClusterSpecError: an unknown job, a task out of range, or a task
                without a job (it would be ambiguous).

        Example:
            >>> DeviceSpec.parse("/job:ps/task:0").validate(ClusterSpec.from_string("ps|h0:2222,worker|h1:2224"))
        """
        if self.job is not None and self.job not in cluster.jobs:
            raise ClusterSpecError(
                f"device {self.to_string()!r} names job {self.job!r}; the cluster has jobs {cluster.jobs}"
            )
        if self.task is None:
            return
        if self.job is None:
            raise ClusterSpecError(
                f"device {self.to_string()!r} names a task but no job; expected e.g. '/job:ps{self.to_string()}'"
            )
        n = cluster.num_tasks(self.job)
        if self.task >= n:
            raise ClusterSpecError(
                f"device {self.to_string()!r}: task {self.task} is out of range for job {self.job!r} "
                f"with {n} task{'s' * (n != 1)} (expected 0..{n - 1})"
            )

    def __str__(self) -> str:
        return self.to_string()


__all__ = ["JOBS", "ClusterSpec", "DeviceSpec", "cluster_from_tf_config", "parse_address", "resolve_cluster"]

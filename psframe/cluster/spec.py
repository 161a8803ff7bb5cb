"""Cluster definitions: who the tasks are and where they listen.

A cluster maps each job name (``"ps"``, ``"worker"``) to the ordered addresses
of its tasks, as TensorFlow's ``tf.train.ClusterSpec`` does. This module builds
a cluster from a dict, the ``--ps_hosts``/``--worker_hosts`` flags or the
``grpc_tensorflow_server`` string ``'ps|h0:2222;h0:2223,worker|h1:2224'``, and
holds the checks shared by :mod:`psframe.cluster.tf_config` (the cluster from flags or
``TF_CONFIG``) and :mod:`psframe.cluster.device_spec` (TF device strings).

Every bad input raises :class:`~psframe.errors.ClusterSpecError` with a message
that says what was expected and what was found.

Example:
    >>> cluster = ClusterSpec.from_hosts("h0:2222,h0:2223", "h1:2224")
    >>> cluster.task_address("ps", 1)
    'h0:2223'
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from psframe.cluster.address import _describe, parse_address
from psframe.errors import ClusterSpecError

JOBS: tuple[str, ...] = ("ps", "worker")
"""The only job names psframe knows, in canonical order."""


def _known_jobs() -> str:
    return " and ".join(repr(j) for j in JOBS)


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
        parse_address(address, any_port=True)
        addresses.append(address.strip())
    return addresses


class ClusterSpec:
    """An immutable map from job name to the ordered addresses of its tasks.

    psframe's counterpart of ``tf.train.ClusterSpec``. Both jobs, ``"ps"`` and
    ``"worker"``, must be present and non-empty, and no address may be used by
    two tasks. Port 0 (``"localhost:0"``) asks for any free port: the server of
    that task picks one, and its :attr:`psframe.Server.cluster` holds the real
    address, which the other tasks must be given (see ``psframe.local_cluster``).

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

    __slots__ = ("_fingerprint", "_ps_fingerprint", "_tasks")
    _tasks: dict[str, tuple[str, ...]]
    _fingerprint: str
    _ps_fingerprint: str

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
                host, port = parse_address(address, any_port=True)
                key = (host.lower(), port)  # host names are case-insensitive
                name = self.task_name(job, index)
                if port == 0:
                    continue  # each such task gets a port of its own when its server binds
                if key in owner:
                    raise ClusterSpecError(
                        f"address {address!r} is given twice, to {owner[key]} and {name}; every task needs its own port"
                    )
                owner[key] = name
        object.__setattr__(self, "_tasks", {job: tuple(given[job]) for job in JOBS})
        # Computed once: every request a ps task answers checks it.
        object.__setattr__(self, "_fingerprint", _short_hash(self.to_string()))
        object.__setattr__(self, "_ps_fingerprint", _short_hash(f"ps|{';'.join(self._tasks['ps'])}"))

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
                    raise ClusterSpecError(f"cluster spec {spec!r} has an empty address at position {i} of job {job!r}")
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

    def tasks_on_any_port(self, job_name: str) -> list[int]:
        """Returns the indices of ``job_name``'s tasks whose address has port 0 (any free port).

        Example:
            >>> ClusterSpec.from_string("ps|h0:0;h0:2223,worker|h1:2224").tasks_on_any_port("ps")
            [0]
        """
        return [i for i, a in enumerate(self.job_tasks(job_name)) if parse_address(a, any_port=True)[1] == 0]

    def with_task_address(self, job_name: str, task_index: int, address: str) -> ClusterSpec:
        """Returns this cluster with one task's address replaced (e.g. by the port its server picked).

        Raises:
            ClusterSpecError: as :meth:`validate_task`, or anything :class:`ClusterSpec` refuses.

        Example:
            >>> ClusterSpec.from_string("ps|h0:0,worker|h1:2224").with_task_address("ps", 0, "h0:40123")
            ClusterSpec('ps|h0:40123,worker|h1:2224')
        """
        self.validate_task(job_name, task_index)
        jobs = self.as_dict()
        jobs[job_name][operator.index(task_index)] = address
        return ClusterSpec(jobs)

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

    @property
    def ps_fingerprint(self) -> str:
        """A short hash of the cluster's ps tasks alone: an elastic ps task (``max_workers``)
        takes a worker whose cluster has the same ps tasks and more workers."""
        return self._ps_fingerprint

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

    @staticmethod
    def caller_name(job_name: str, task_index: int) -> str:
        """TF's name for a task as a caller states it, unchecked (it came off the wire;
        ``psframe status`` calls itself ``/job:tool/task:0``)."""
        return f"/job:{job_name or '?'}/task:{task_index}"

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
        try:
            parse_address(item, any_port=True)
        except ClusterSpecError as e:  # name the flag: the user typed it, not the ClusterSpec
            hint = f" (--{flag} separates addresses with ',', not ';')" if ";" in str(item) else ""
            raise ClusterSpecError(f"--{flag}={hosts!r}: {e}{hint}") from e
    return items


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


__all__ = ["JOBS", "ClusterSpec", "parse_address"]

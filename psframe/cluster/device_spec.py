"""TF device strings such as ``/job:ps/task:1/device:CPU:0``, parsed and checked.

:class:`DeviceSpec` reads the long and short forms TensorFlow accepts
(``/job:ps/replica:0/task:1/device:GPU:0``, ``/gpu:1``, ``/cuda:0``...),
writes the canonical form back and checks a device against a cluster.

Every bad input raises :class:`~psframe.errors.ClusterSpecError`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from psframe.cluster.address import _describe
from psframe.cluster.spec import ClusterSpec, _check_index
from psframe.errors import ClusterSpecError

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
        return cls(
            job=parts.get("job"),
            replica=parts.get("replica"),
            task=parts.get("task"),
            device_type=kind,
            device_index=index,
        )

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


__all__ = ["DeviceSpec"]

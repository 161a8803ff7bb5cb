"""What ``psframe launch`` does when a task fails: stop the job, start the task again, or go on without it.

A task **fails** when it exits with a code other than 0, or a signal kills it
(SIGKILL from the kernel's OOM killer, say), while the launcher has not asked
it to stop. ``--on_failure`` chooses what follows (:class:`FailurePolicy`):

``stop`` (the default)
    stop every other task (SIGTERM, then SIGKILL after ``--grace``) and exit
    with the failed task's code.
``restart``
    start the task again, with the same flags, address and ``TF_CONFIG``, as
    torchrun's ``--max_restarts`` does, up to ``--max_restarts`` times per
    task (3 by default); a ps task restores its shard from the newest
    checkpoint, a worker joins the job again (see the guide "Failures and exit
    codes"). Past the limit, ``stop``.
``continue``
    let the others go on without it, as asynchronous training tolerates a
    lost worker: the ps tasks stop waiting for it once it is presumed dead
    (``worker_timeout``), and the launch exits 0 if every other task does.
    The chief and the ps tasks are needed to the end: one of them failing
    stops the job, as ``stop``.

``--max_restarts N`` given alone means ``--on_failure=restart``, as for
torchrun. Once training is over (a ps task exited 0), a task that fails is
not started again: the job stops with its code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from psframe.errors import LaunchError

DEFAULT_MAX_RESTARTS = 3


class OnFailure(str, enum.Enum):
    """``--on_failure``: what follows a task's failure (see the module)."""

    STOP = "stop"
    RESTART = "restart"
    CONTINUE = "continue"


class Action(enum.Enum):
    """What the launcher does with one failed task."""

    STOP = "stop"  # stop the others; the launch exits with the task's code
    RESTART = "restart"  # start it again
    LEAVE_OUT = "leave out"  # the others go on without it


def on_failure_named(name: OnFailure | str) -> OnFailure:
    """The :class:`OnFailure` of a name (``"stop"``, ``"restart"``, ``"continue"``).

    Raises:
        LaunchError: no such name.
    """
    try:
        return OnFailure(name)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in OnFailure)
        raise LaunchError(f"on_failure must be one of {choices}, got {name!r}") from None


@dataclass(frozen=True)
class FailurePolicy:
    """What ``psframe launch`` does when a task fails (see the module).

    Args:
        on_failure: ``"stop"``, ``"restart"`` or ``"continue"``.
        max_restarts: with ``"restart"``, the times one task is started again at most.

    Raises:
        LaunchError: an unknown ``on_failure``, or ``max_restarts`` is not an int >= 0.
    """

    on_failure: OnFailure = OnFailure.STOP
    max_restarts: int = DEFAULT_MAX_RESTARTS

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_failure", on_failure_named(self.on_failure))
        restarts = self.max_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise LaunchError(f"max_restarts must be an int >= 0, got {restarts!r}")

    @classmethod
    def from_flags(cls, on_failure: str | None, max_restarts: int | None) -> FailurePolicy:
        """The policy of ``--on_failure`` and ``--max_restarts``: ``--max_restarts`` alone means
        ``restart`` (as torchrun's); neither, ``stop``.

        Raises:
            LaunchError: ``--max_restarts`` with ``--on_failure`` other than ``restart``, or a bad value.
        """
        if max_restarts is not None and on_failure not in (None, OnFailure.RESTART.value):
            raise LaunchError(f"--max_restarts applies to --on_failure=restart, not --on_failure={on_failure}")
        if on_failure is None:
            on_failure = OnFailure.STOP.value if max_restarts is None else OnFailure.RESTART.value
        return cls(on_failure_named(on_failure), DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts)

    def decide(self, job_name: str, task_index: int, restarts: int, training_over: bool) -> tuple[Action, str]:
        """What to do with a task that failed, and why, as the end of the launcher's line.

        Args:
            job_name, task_index: the task.
            restarts: the times it was started again already.
            training_over: a ps task exited 0 (every worker finished).
        """
        if self.on_failure is OnFailure.RESTART:
            if training_over:
                return Action.STOP, "training is over, so it is not started again; stopping the others"
            if restarts < self.max_restarts:
                return Action.RESTART, f"starting it again (restart {restarts + 1} of {self.max_restarts})"
            return Action.STOP, f"it was started again {restarts} times (--max_restarts); stopping the others"
        if self.on_failure is OnFailure.CONTINUE:
            if job_name == "worker" and task_index != 0:
                return Action.LEAVE_OUT, "the others go on without it (--on_failure=continue)"
            needed = "the chief" if job_name == "worker" else "a ps task"
            return Action.STOP, f"{needed} is needed to the end; stopping the others"
        return Action.STOP, "stopping the others"

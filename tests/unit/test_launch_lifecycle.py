"""psframe launch's lifecycle: what follows a task's failure (``--on_failure``, ``--max_restarts``), the
grace a task gets to stop (``--grace``), the launcher's own SIGTERM, and the cluster it leaves for
``psframe status``.

The policy's rules are unit tests; the rest are real child processes on loopback ports the OS
picks, every wait bounded, every process started here killed by PID (a launch by the session it
leads) at the end.

This file holds the unit tier's tests of the subject; `tests/cluster/test_launch_lifecycle.py` holds
the other tiers'.
"""

from __future__ import annotations

import pytest

from psframe import cli
from psframe.errors import LaunchError
from psframe.launch import DEFAULT_GRACE, FailurePolicy, OnFailure
from psframe.launch.policy import Action
from tests.cluster.test_launch_lifecycle import launch_dir  # noqa: F401


def test_the_failure_policy_from_flags_defaults_to_stop_and_max_restarts_alone_means_restart():
    assert FailurePolicy.from_flags(None, None) == FailurePolicy(OnFailure.STOP)
    assert FailurePolicy.from_flags(None, 5) == FailurePolicy(OnFailure.RESTART, 5)
    assert FailurePolicy.from_flags("restart", None) == FailurePolicy(OnFailure.RESTART, 3)
    assert FailurePolicy.from_flags("continue", None) == FailurePolicy(OnFailure.CONTINUE)
    with pytest.raises(LaunchError, match="--max_restarts applies to --on_failure=restart, not --on_failure=stop"):
        FailurePolicy.from_flags("stop", 2)
    with pytest.raises(LaunchError, match="on_failure must be one of 'stop', 'restart', 'continue', got 'again'"):
        FailurePolicy("again")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="max_restarts must be an int >= 0, got -1"):
        FailurePolicy(OnFailure.RESTART, -1)


def test_the_failure_policy_decides_per_task():
    restart = FailurePolicy(OnFailure.RESTART, 2)
    assert restart.decide("ps", 0, 0, False) == (Action.RESTART, "starting it again (restart 1 of 2)")
    assert restart.decide("worker", 0, 1, False)[0] is Action.RESTART
    assert restart.decide("worker", 1, 2, False) == (
        Action.STOP,
        "it was started again 2 times (--max_restarts); stopping the others",
    )
    assert restart.decide("worker", 1, 0, True)[0] is Action.STOP  # training is over: nothing to rejoin
    go_on = FailurePolicy(OnFailure.CONTINUE)
    assert go_on.decide("worker", 1, 0, False)[0] is Action.LEAVE_OUT
    assert go_on.decide("worker", 0, 0, False) == (Action.STOP, "the chief is needed to the end; stopping the others")
    assert go_on.decide("ps", 1, 0, False)[0] is Action.STOP
    assert FailurePolicy().decide("worker", 1, 0, False) == (Action.STOP, "stopping the others")


def test_the_launch_flags_and_their_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["launch", "job.py"])
    assert (args.grace, args.on_failure, args.max_restarts) == (DEFAULT_GRACE, None, None) == (30.0, None, None)
    args = parser.parse_args(["launch", "--grace=120", "--on_failure=continue", "job.py", "--", "--x=1"])
    assert (args.grace, args.on_failure, args.script_args[-1]) == (120.0, "continue", "--x=1")
    with pytest.raises(SystemExit):
        parser.parse_args(["launch", "--on_failure=retry", "job.py"])

"""Tasks asked to stop: SIGTERM (Kubernetes, Spark, spot machines, ``psframe launch``) and Ctrl-C.

A worker given SIGTERM finishes its step and leaves as a finished worker does, within
``PSFRAME_STOP_GRACE`` (psframe.worker.leaving); a ps task given SIGTERM saves a checkpoint where
it can and ends with one line (psframe.ps.serving.leaving); a ps task given Ctrl-C ends with one
line, with or without ``flags.run``; ``flags.run`` gives a stopped task's code, and 0 for
``Server.join()``'s True.

Unit tests of the parts, then real processes (tests/support/cluster_job.py, which does not use
``flags.run``) on loopback ports the OS picks, every wait bounded and every process killed by PID
at the end.

This file holds the unit tier's tests of the subject; `tests/cluster/test_leaving.py` holds the
other tiers'.
"""

from __future__ import annotations

import signal
import threading

import pytest

from psframe import flags
from psframe.config import stopping
from psframe.errors import Interrupted, TaskStopped
from psframe.worker.leaving import LeaveOnSigterm

WAIT_S = 120.0  # bounds every wait; no test relies on it

# ---- flags.run, unit


def test_flags_run_exits_0_on_server_join_true():
    assert flags.run(lambda: True) == 0  # flags.run(lambda: server.join()) once training is over
    assert flags.run(lambda: False) == flags.EXIT_FAILURE  # join(timeout) ran out
    assert flags.run(lambda: None) == 0 and flags.run(lambda: 3) == 3


@pytest.mark.parametrize("stopped, code", [(Interrupted(130), 130), (TaskStopped(143), 143)])
def test_flags_run_gives_a_stopped_tasks_code_and_no_second_line(capsys, stopped, code):
    def main() -> int:
        raise stopped

    assert flags.run(main, prog="job.py") == code
    assert capsys.readouterr().err == ""  # the task said its line already


def test_an_interrupted_task_is_still_a_keyboard_interrupt_and_exits_quietly():
    assert issubclass(Interrupted, KeyboardInterrupt) and issubclass(Interrupted, SystemExit)
    assert not issubclass(TaskStopped, KeyboardInterrupt) and Interrupted(130).code == 130


# ---- the grace and the handler, unit


def test_the_stop_grace_comes_from_the_environment():
    assert stopping.stop_grace({}) == stopping.DEFAULT_STOP_GRACE == 20.0
    assert stopping.stop_grace({"PSFRAME_STOP_GRACE": " 7.5 "}) == 7.5
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ValueError, match="PSFRAME_STOP_GRACE must be a number of seconds >= 0"):
            stopping.stop_grace({"PSFRAME_STOP_GRACE": bad})


def test_the_sigterm_handler_is_installed_only_over_the_default_and_restored():
    # From the default action, whatever an earlier test of this process left (a trainer it never closed).
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        _handler_installed_only_over_the_default_and_restored()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _handler_installed_only_over_the_default_and_restored():
    noted = threading.Event()
    handler = stopping.SigtermHandler(noted.set)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    try:
        assert handler.install() and handler.installed
        assert not stopping.SigtermHandler(noted.set).install()  # SIGTERM is handled already: left alone
        signal.raise_signal(signal.SIGTERM)
        assert noted.is_set()
    finally:
        handler.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not handler.installed
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(stopping.SigtermHandler(noted.set).install()))
    thread.start()
    thread.join(10)
    assert outcome == [False]  # only the main thread handles signals


class Ends:
    """A fake process end for LeaveOnSigterm: records the code instead of exiting."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def test_a_worker_asked_to_leave_leaves_at_the_end_of_its_step(capsys):
    finished, ends = [], Ends()
    leaving = LeaveOnSigterm("worker 1", lambda: finished.append(True), grace=60.0, exit=ends)
    leaving.check()  # nothing asked: the step goes on
    leaving.asked_to_leave()
    with pytest.raises(TaskStopped) as stopped:
        leaving.check()
    assert stopped.value.code == 143
    assert capsys.readouterr().err.endswith(": stopped by SIGTERM; worker 1 finished its step and left\n")
    leaving.disarm()  # the trainer closed: it told the ps tasks itself
    assert not ends.done.wait(0.5) and finished == [] and capsys.readouterr().err == ""


def test_a_worker_that_does_not_end_its_step_within_the_grace_is_ended(capsys):
    finished, ends = [], Ends()
    leaving = LeaveOnSigterm("worker 1", lambda: finished.append(True), grace=0.1, exit=ends)
    leaving.asked_to_leave()
    assert ends.done.wait(WAIT_S)
    assert ends.codes == [143] and finished == [True]  # the ps tasks were told it finished, then it ended
    assert "worker 1 did not end its step within 0.1s (PSFRAME_STOP_GRACE) and left without it" in (
        capsys.readouterr().err
    )


def test_a_sigterm_that_came_as_the_worker_closed_ends_the_script_then(capsys):
    leaving = LeaveOnSigterm("worker 2", lambda: None, grace=60.0, exit=Ends())
    leaving.asked_to_leave()
    with pytest.raises(TaskStopped):
        leaving.disarm()
    assert capsys.readouterr().err.endswith(": stopped by SIGTERM; worker 2 finished and left\n")


# ---- real processes: tests/support/cluster_job.py, without flags.run


def _no_traceback(output: str) -> None:
    assert "Traceback" not in output, output[-3000:]

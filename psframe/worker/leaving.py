"""A worker asked to leave (SIGTERM): it finishes the step under way, then leaves as a finished worker does.

Kubernetes, Spark, spot machines and ``psframe launch`` send SIGTERM first to
ask a task to leave. Killed at once, a worker would never say it finished, and
in synchronous training the rounds would wait for it for ``worker_timeout``
seconds. So while a :class:`psframe.Trainer` is connected, SIGTERM is noted,
and:

1. the step under way finishes (its gradients are applied); the next
   :meth:`~psframe.Trainer.step` to end (this one, if SIGTERM came during it)
   prints ``PROG: stopped by SIGTERM; worker N finished its step and left``
   and raises :class:`~psframe.errors.TaskStopped` (a ``SystemExit``: exit
   code 143, no traceback);
2. leaving ``with trainer:``, the worker finishes as at the end of training
   (hooks end: the chief saves its last checkpoint; the ps tasks are told it
   finished, so synchronous rounds stop waiting for it at once, as the
   elastic rules say of a worker that leaves);
3. if the process is still there ``PSFRAME_STOP_GRACE`` seconds (20) after
   SIGTERM (a step that hangs, a long pause between steps), the ps tasks are
   told it finished and the process ends with exit code 143 there and then.

A second SIGTERM ends the process at once (SIGTERM's default action). The
handler is installed at :meth:`~psframe.Trainer.connect`, from the main thread
only and only where SIGTERM has its default action (a program with its own
handler keeps it), and removed at :meth:`~psframe.Trainer.close`. Off the main
thread, or before ``connect``, SIGTERM does what it did.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

from psframe.config.stopping import EXIT_TERMINATED, SigtermHandler, program, say, stop_grace
from psframe.errors import TaskStopped

log = logging.getLogger(__name__)

FINISH_WAIT_S = 5.0  # when the grace ran out: at most this long to tell the ps tasks


class LeaveOnSigterm:
    """What a worker does on SIGTERM (see the module): one per connected :class:`psframe.Trainer`.

    Args:
        name: the worker, as its lines name it (``"worker 1"``).
        finish: tells the ps tasks this worker finished; called from another
            thread when the grace runs out before the worker left.
        grace: seconds from SIGTERM to the end of the process at the latest;
            None: ``PSFRAME_STOP_GRACE``, or 20.
        exit: ends the process with a code (``os._exit``; tests pass another).

    Raises:
        ValueError: ``PSFRAME_STOP_GRACE`` is no number of seconds >= 0.
    """

    def __init__(
        self,
        name: str,
        finish: Callable[[], None],
        grace: float | None = None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self._name = name
        self._finish = finish
        self.grace = stop_grace() if grace is None else grace
        self._exit = exit
        self._handler = SigtermHandler(self.asked_to_leave)
        # Whether SIGTERM came: a plain attribute, which the trainer reads after every step and
        # calls into this only once it is set (set from the handler, in the main thread).
        self.asked = False
        self._gone = threading.Event()  # the worker finished (closed) or the process ends: nothing left to force
        self._said = False

    def arm(self) -> bool:
        """Note SIGTERM from now on (see the module); True if the handler is installed."""
        return self._handler.install()

    def disarm(self) -> None:
        """The worker finished (closed): SIGTERM's default action again.

        Raises:
            TaskStopped: a SIGTERM came that no step acted on (it came as the worker
                closed): the script ends now, as SIGTERM asked, after the line.
        """
        self._handler.restore()
        self._gone.set()
        if self.asked and not self._said:
            self._said = True
            say(f"{program()}: stopped by SIGTERM; {self._name} finished and left")
            raise TaskStopped(EXIT_TERMINATED)

    def check(self) -> None:
        """At the end of a step: leave if SIGTERM came (:attr:`asked`).

        Raises:
            TaskStopped: SIGTERM came (exit code 143), after the line saying so.
        """
        if self.asked:
            if not self._said:
                self._said = True
                say(f"{program()}: stopped by SIGTERM; {self._name} finished its step and left")
            raise TaskStopped(EXIT_TERMINATED)

    def asked_to_leave(self) -> None:
        """SIGTERM (the handler; callable directly): leave after the step under way, and by the grace."""
        if self.asked:
            return
        self.asked = True
        self._handler.restore()  # a second SIGTERM ends the process at once
        threading.Thread(target=self._bound, name="psframe-leave", daemon=True).start()

    def _bound(self) -> None:
        """The grace: unless the worker finished (closed) by its end, the process ends there."""
        log.info("%s: SIGTERM; it leaves after the step under way, within %gs", self._name, self.grace)
        if self._gone.wait(self.grace):
            return
        if not self._said:
            self._said = True
            say(
                f"{program()}: stopped by SIGTERM; {self._name} did not end its step within {self.grace:g}s "
                f"(PSFRAME_STOP_GRACE) and left without it"
            )
        else:  # the step ended, but leaving (the hooks' end, say) takes longer
            log.warning("%s: still leaving %gs after SIGTERM; exiting now", self._name, self.grace)
        telling = threading.Thread(target=self._tell_finished, name="psframe-finish", daemon=True)
        telling.start()
        telling.join(FINISH_WAIT_S)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._exit(EXIT_TERMINATED)

    def _tell_finished(self) -> None:
        try:
            self._finish()
        except Exception as e:  # noqa: BLE001 - the process ends next; say why the ps tasks were not told
            log.warning("%s could not tell the ps tasks it left: %s", self._name, e)


def leave_on_sigterm(name: str, finish: Callable[[], None]) -> LeaveOnSigterm | None:
    """A worker's :class:`LeaveOnSigterm`, armed; None where SIGTERM is not this thread's to handle
    (not the main thread, or the program handles SIGTERM itself): the step path then checks nothing."""
    leaving = LeaveOnSigterm(name, finish)
    return leaving if leaving.arm() else None

"""How a task stops when it is asked to: SIGTERM's grace, and the one line it ends with.

Kubernetes, Spark, spot machines and ``psframe launch`` ask a task to leave
with SIGTERM, and kill it (SIGKILL) a grace period later (Kubernetes' is 30 s
by default). A psframe task is gone within its own grace,
``PSFRAME_STOP_GRACE`` seconds (:data:`DEFAULT_STOP_GRACE`, 20, by default;
keep it below the sender's):

- a worker (``psframe.Trainer``) finishes the step under way, tells the ps
  tasks it finished, as a worker at the end of training does (so that
  synchronous rounds stop waiting for it at once), and exits 143
  (:mod:`psframe.worker.leaving`);
- a ps task (``psframe.Server.join``) saves a checkpoint of the cluster where
  it has a ``checkpoint_dir`` and every ps task is ready, stops serving, and
  exits 143 (:mod:`psframe.ps.serving.leaving`).

Each ends with one line on stderr, ``PROG: stopped by SIGTERM; ...``, and no
traceback, whether or not :func:`psframe.flags.run` wraps the script: it raises
:class:`~psframe.errors.TaskStopped`, a ``SystemExit``. A ps task given Ctrl-C
ends the same way, with exit code 130 (:class:`~psframe.errors.Interrupted`).

A handler is installed from the main thread only, and only where SIGTERM still
has its default action: a program that handles SIGTERM itself keeps its
handler, and psframe leaves SIGTERM alone there.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType

STOP_GRACE_ENV = "PSFRAME_STOP_GRACE"
DEFAULT_STOP_GRACE = 20.0
"""Seconds a task given SIGTERM takes at most to leave (see the module)."""
EXIT_TERMINATED = 128 + signal.SIGTERM
"""A task's exit code after SIGTERM (143), as a shell reports a process that SIGTERM ended."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""A task's exit code after Ctrl-C (130)."""


def stop_grace(environ: Mapping[str, str] | None = None) -> float:
    """The seconds a task given SIGTERM takes at most to leave: ``PSFRAME_STOP_GRACE``, or 20.

    Raises:
        ValueError: the variable is set (not empty) to no number of seconds >= 0.
    """
    value = (os.environ if environ is None else environ).get(STOP_GRACE_ENV, "").strip()
    if not value:
        return DEFAULT_STOP_GRACE
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(f"{STOP_GRACE_ENV} must be a number of seconds >= 0, got {value!r}")
    return seconds


_named: list[str] = []  # the names programs gave themselves (psframe.flags.run's prog), innermost last


def program() -> str:
    """The name a task's one line starts with: the one :func:`named` gives (``psframe.flags.run``'s
    ``prog``, e.g. ``"psframe server"``), else the script's file name, as argparse names it."""
    if _named:
        return _named[-1]
    return os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "python")


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """While the block runs, :func:`program` is ``name``."""
    _named.append(name)
    try:
        yield
    finally:
        _named.pop()


def say(line: str) -> None:
    """Print a task's one line on stderr, after what it printed on stdout."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


class SigtermHandler:
    """Calls ``callback`` on SIGTERM, from :meth:`install` to :meth:`restore`.

    ``callback`` runs in the main thread between two bytecodes, as every Python
    signal handler does: it should only note the request (set a flag, start a
    thread), and leave the work to the code it interrupted.

    Args:
        callback: what to call, with no argument.
    """

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether SIGTERM is handled here now."""
        return self._installed

    def install(self) -> bool:
        """Handle SIGTERM from now on, if this is the main thread and SIGTERM has its default
        action (else leave it alone). True if installed."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False  # the program's own handler, or an ignored SIGTERM: not ours to change
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return True

    def restore(self) -> None:
        """SIGTERM's default action again (idempotent; from the main thread; a handler
        installed since by someone else is left as it is)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._callback()


__all__ = [
    "DEFAULT_STOP_GRACE",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
    "STOP_GRACE_ENV",
    "SigtermHandler",
    "named",
    "program",
    "say",
    "stop_grace",
]

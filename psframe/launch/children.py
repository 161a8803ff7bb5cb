"""The child processes of ``psframe launch``: started, their lines prefixed, signalled, reaped.

One :class:`Child` per task. It keeps the command and environment it was
started with, so that :meth:`Child.restart` starts the task again the same way
(its address, flags and ``TF_CONFIG`` unchanged). Only processes started here
are ever signalled, by their PID, and a PID is signalled only while its
process is unreaped (``Popen`` checks), so a reused PID is never hit.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO, TextIO

from psframe.errors import LaunchError

POLL_S = 0.05
DRAIN_S = 5.0  # a grandchild may hold a pipe open; do not wait on it for ever


class Output:
    """Where every child's lines go: whole lines, one at a time, each prefixed with its task."""

    def __init__(self, sink: TextIO) -> None:
        self._sink = sink
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:  # one whole line at a time, so tasks never interleave mid-line
            self._sink.write(text)
            self._sink.flush()

    def log(self, message: str) -> None:
        """A line of the launcher's own: ``[launch] message``."""
        self.write(f"[launch] {message}\n")


class Child:
    """One task's process (and the processes that ran it before, if it was started again).

    Args:
        job_name, task_index: the task.
        argv, env: the command and environment it runs with, each time.
        output: where its lines go.
    """

    def __init__(
        self, job_name: str, task_index: int, argv: Sequence[str], env: dict[str, str], output: Output
    ) -> None:
        self.job_name = job_name
        self.task_index = task_index
        self._argv = list(argv)
        self._env = env
        self._output = output
        self._readers: list[threading.Thread] = []
        self.stopped = False  # the launcher signalled it: its code is no failure of its own
        self.restarts = 0
        self.left_out = False  # it failed and the others went on without it
        self.proc = self._start()

    @property
    def name(self) -> str:
        return f"{self.job_name}{self.task_index}"

    @property
    def chief(self) -> bool:
        return self.job_name == "worker" and self.task_index == 0

    def running(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        """Start the task again, as it was started (its last process has exited)."""
        self.restarts += 1
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            self._argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            errors="replace",
            env=self._env,
        )
        for pipe in (p for p in (proc.stdout, proc.stderr) if p is not None):  # both are PIPE
            reader = threading.Thread(
                target=_pump, args=(pipe, f"[{self.name}] ", self._output), name=f"launch-{self.name}", daemon=True
            )
            reader.start()
            self._readers.append(reader)
        return proc

    def how_it_ended(self) -> str:
        """``"exited with code 3"`` or ``"was killed by SIGKILL (code 137)"``."""
        returncode = self.proc.returncode
        code = exit_code(returncode)
        if returncode is not None and returncode < 0 and -returncode in signal.valid_signals():
            return f"was killed by {signal.Signals(-returncode).name} (code {code})"
        return f"exited with code {code}"

    def summary(self) -> str:
        """``worker1=0``, with what the launcher did to it: ``(stopped)``, ``(restarted 2)``, ``(left out)``."""
        notes = [f"restarted {self.restarts}"] if self.restarts else []
        notes += ["left out"] if self.left_out else []
        notes += ["stopped"] if self.stopped else []
        return f"{self.name}={exit_code(self.proc.returncode)}" + (f" ({', '.join(notes)})" if notes else "")

    def drain(self, until: float) -> None:
        """Wait (until ``time.monotonic()`` reaches ``until``) for the last lines of every process it ran."""
        for reader in self._readers:
            reader.join(max(0.0, until - time.monotonic()))


def _pump(pipe: IO[str], prefix: str, output: Output) -> None:
    with pipe:
        for line in pipe:
            output.write(prefix + (line if line.endswith("\n") else line + "\n"))


def exit_code(returncode: int | None) -> int:
    """A process's exit code as a shell gives it: 128 + N if signal N killed it."""
    # None cannot happen once a child is reaped; -N means killed by signal N.
    return -1 if returncode is None else 128 - returncode if returncode < 0 else returncode


def stop(children: Sequence[Child], grace: float) -> None:
    """Stop every child still running: the workers first, then the ps tasks.

    Each group gets SIGTERM, then ``grace`` seconds to leave (a psframe
    worker finishes its step and tells the ps tasks it left; a ps task saves
    where it can), then SIGKILL; every child is reaped.
    """
    for job in ("worker", "ps"):
        alive = [c for c in children if c.job_name == job and c.running()]
        for c in alive:
            c.stopped = True
            c.proc.terminate()  # Popen checks poll() first: an exited (reaped) PID is never signalled
        wait_for_exit(alive, grace)
        for c in alive:
            if c.running():
                c.proc.kill()
        for c in alive:
            c.proc.wait()


def wait_for_exit(children: Sequence[Child], seconds: float) -> None:
    """Wait up to ``seconds`` for every child to exit."""
    end = time.monotonic() + seconds
    while any(c.running() for c in children) and time.monotonic() < end:
        time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))


def drain(children: Sequence[Child]) -> None:
    """Wait a few seconds at most for the children's last lines."""
    until = time.monotonic() + DRAIN_S
    for c in children:
        c.drain(until)


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ask the OS for ``count`` distinct free TCP ports on ``host``.

    All sockets stay bound until every port is picked, so the ports differ; they
    are closed on return, so another process could still take one first (the
    usual small race of port 0).

    Args:
        count: how many ports to pick (0 gives ``[]``).
        host: the local address to bind, e.g. ``"127.0.0.1"`` or ``"::1"``.

    Returns:
        ``count`` distinct port numbers.

    Raises:
        LaunchError: ``count`` is negative or ``host`` cannot be bound.

    Example:
        >>> a, b = pick_free_ports(2)
        >>> a != b
        True
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise LaunchError(f"count must be an int >= 0, got {count!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    except OSError as e:
        raise LaunchError(f"cannot bind a free port on host {host!r}: {e}") from e
    finally:
        for sock in sockets:
            sock.close()

"""Start a whole psframe cluster on this machine (``psframe launch``).

:func:`launch` picks free loopback ports, starts one child process per task
with the flags (and ``TF_CONFIG``) a hand-started task would get, prefixes
every line a child prints with its task name, and stops every child as soon
as one fails, so that a broken cluster never hangs.

One launch goes through these states::

    STARTING -> RUNNING -> every child exited 0 ------------------> return 0
                        -> a child failed       -> STOPPING -> return its code
                        -> timeout expired      -> STOPPING -> return 124
                        -> KeyboardInterrupt    -> STOPPING -> return 130

STOPPING sends SIGTERM to every child still running, waits ``kill_grace``
seconds, sends SIGKILL to those left, and reaps them all. After Ctrl-C, which
a terminal sends to every task as well, the children first get ``kill_grace``
seconds to stop on their own (a psframe script prints its one line and exits
130, see :func:`psframe.flags.run`); a second Ctrl-C stops them at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TextIO

from psframe.config.security import Security, generate_token
from psframe.errors import LaunchError

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
_POLL_S = 0.05
_DRAIN_S = 5.0  # a grandchild may hold a pipe open; do not wait on it for ever


@dataclass(frozen=True)
class TaskResult:
    """How one task ended: its exit status, or 128 + N if killed by signal N."""

    task_name: str
    job_name: str
    task_index: int
    returncode: int


@dataclass
class _Task:
    job_name: str
    task_index: int
    proc: subprocess.Popen[str]
    readers: list[threading.Thread] = field(default_factory=list)
    stopped: bool = False  # the launcher signalled it; its code is not a failure

    @property
    def name(self) -> str:
        return f"{self.job_name}{self.task_index}"


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


def launch(
    script: str,
    num_ps: int,
    num_workers: int,
    script_args: Sequence[str] = (),
    *,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    kill_grace: float = 5.0,
    security: Security | None = None,
) -> int:
    """Run ``script`` as a cluster of ``num_ps`` ps and ``num_workers`` worker tasks.

    Each child runs ``python script --ps_hosts=... --worker_hosts=...
    --job_name=ps|worker --task_index=i *script_args`` with ``TF_CONFIG`` set to
    the same cluster and task. Every line it prints (stdout and stderr) goes to
    ``out`` prefixed with its task name, e.g. ``"[worker1] step 10"``. When one
    child fails, the others get SIGTERM, then SIGKILL after ``kill_grace``
    seconds. A summary line such as ``"[launch] done: ps0=0 worker0=0"`` ends
    the output.

    Every task gets the cluster's auth token in ``PSFRAME_AUTH_TOKEN`` (and
    the TLS files of ``security`` in ``PSFRAME_TLS_*``), which
    ``psframe.Server`` and ``psframe.Trainer`` read: the token of
    ``security`` if it has one, else a fresh random one made for this
    cluster alone (never printed: only its tasks know it).

    Args:
        script: path of the Python script every task runs.
        num_ps: number of ps tasks (>= 1).
        num_workers: number of worker tasks (>= 1).
        script_args: extra arguments passed after the cluster flags, as given.
        python: interpreter that runs the children.
        host: loopback address the tasks listen on.
        timeout: seconds before every task is stopped; None waits for ever.
        env: variables added to this process's environment for the children.
            Without ``OMP_NUM_THREADS`` there, each task gets an equal share
            of this machine's cores as its number of compute threads.
        out: where the children's lines go; defaults to ``sys.stdout``.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping; after
            Ctrl-C, also the time the children get to stop on their own first.
        security: the token and TLS files for every task; None: the
            ``PSFRAME_*`` variables of the environment (and ``env``).

    Returns:
        0 when every task exited 0; else the exit code of the first task that
        failed (128 + N if it was killed by signal N); 124 on timeout; 130 on
        KeyboardInterrupt.

    Raises:
        LaunchError: a count is < 1, ``script`` is not a file, or another argument is bad.
        OSError: a child could not be started (those already started are stopped).

    Example::

        code = launch("examples/mlp_mnist_dist.py", 2, 2, ["--train_steps", "2000"])
    """
    _check_args(script, num_ps, num_workers, script_args, timeout, kill_grace)
    sink: TextIO = sys.stdout if out is None else out
    lock = threading.Lock()

    def log(message: str) -> None:
        _write(sink, lock, f"[launch] {message}\n")

    ports = pick_free_ports(num_ps + num_workers, host)
    addr = f"[{host}]:{{}}" if ":" in host else f"{host}:{{}}"
    cluster = {"ps": [addr.format(p) for p in ports[:num_ps]], "worker": [addr.format(p) for p in ports[num_ps:]]}
    flags = [f"--{job}_hosts={','.join(cluster[job])}" for job in ("ps", "worker")]
    base_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if security is None:
        security = Security.resolve(environ=base_env)
    if security.auth_token is None:
        security = dataclasses.replace(security, auth_token=generate_token())
        log("made a fresh auth token for this cluster; every task gets it in PSFRAME_AUTH_TOKEN")
    base_env = security.child_environment(base_env)
    if "OMP_NUM_THREADS" not in base_env:
        # Every task's torch would otherwise start a compute thread per core:
        # N tasks on one machine then fight over the cores (as torchrun, share them).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        base_env["OMP_NUM_THREADS"] = str(max(1, cores // (num_ps + num_workers)))
        log(
            f"OMP_NUM_THREADS is not set: each of the {num_ps + num_workers} tasks gets "
            f"{base_env['OMP_NUM_THREADS']} compute thread(s) of the {cores} cores; set it to choose"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    tasks: list[_Task] = []
    interrupted = False
    try:
        for job_name, count in (("ps", num_ps), ("worker", num_workers)):
            for index in range(count):
                task_env = {
                    **base_env,
                    "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job_name, "index": index}}),
                }
                argv = [python, script, *flags, f"--job_name={job_name}", f"--task_index={index}", *script_args]
                tasks.append(_start(job_name, index, argv, task_env, sink, lock))
        code = _wait(tasks, deadline, timeout, log)
    except KeyboardInterrupt:
        log("interrupted; stopping every task")
        code = EXIT_INTERRUPTED
        interrupted = True
    finally:
        if interrupted:
            _wait_for_exit(tasks, kill_grace)  # a terminal's Ctrl-C reached them too: let them stop cleanly
        _stop(tasks, kill_grace)
        _drain(tasks)
    results = [TaskResult(t.name, t.job_name, t.task_index, _exit_code(t.proc.returncode)) for t in tasks]
    log(
        "done: "
        + " ".join(
            f"{r.task_name}={r.returncode}" + (" (stopped)" if t.stopped else "") for r, t in zip(results, tasks)
        )
    )
    return code


def _check_args(
    script: str, num_ps: int, num_workers: int, script_args: Sequence[str], timeout: float | None, kill_grace: float
) -> None:
    for name, value in (("num_ps", num_ps), ("num_workers", num_workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LaunchError(f"{name} must be an int >= 1, got {value!r}")
    if not os.path.isfile(script):
        raise LaunchError(f"script {script!r} is not a file (looked in {os.getcwd()!r})")
    if isinstance(script_args, str) or not all(isinstance(a, str) for a in script_args):
        raise LaunchError(f"script_args must be a sequence of str, got {script_args!r}")
    if timeout is not None and not timeout > 0:
        raise LaunchError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if not kill_grace >= 0:
        raise LaunchError(f"kill_grace must be >= 0 seconds, got {kill_grace!r}")


def _start(
    job_name: str, index: int, argv: list[str], env: dict[str, str], sink: TextIO, lock: threading.Lock
) -> _Task:
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        errors="replace",
        env=env,
    )
    task = _Task(job_name, index, proc)
    for pipe in (p for p in (proc.stdout, proc.stderr) if p is not None):  # both are PIPE
        reader = threading.Thread(
            target=_pump, args=(pipe, f"[{task.name}] ", sink, lock), name=f"launch-{task.name}", daemon=True
        )
        reader.start()
        task.readers.append(reader)
    return task


def _pump(pipe: IO[str], prefix: str, sink: TextIO, lock: threading.Lock) -> None:
    with pipe:
        for line in pipe:
            _write(sink, lock, prefix + (line if line.endswith("\n") else line + "\n"))


def _write(sink: TextIO, lock: threading.Lock, text: str) -> None:
    with lock:  # one whole line at a time, so tasks never interleave mid-line
        sink.write(text)
        sink.flush()


def _wait(tasks: list[_Task], deadline: float | None, timeout: float | None, log: Callable[[str], None]) -> int:
    while True:
        running = [t for t in tasks if t.proc.poll() is None]
        for t in tasks:
            if t.proc.returncode not in (None, 0):
                code = _exit_code(t.proc.returncode)
                how = (
                    f"was killed by {signal.Signals(-t.proc.returncode).name} (code {code})"
                    if t.proc.returncode < 0 and -t.proc.returncode in signal.valid_signals()
                    else f"exited with code {code}"
                )
                log(f"{t.name} {how}; stopping the others")
                return code
        if not running:
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            log(f"timeout after {timeout:g}s; still running: {' '.join(t.name for t in running)}; stopping them")
            return EXIT_TIMEOUT
        time.sleep(_POLL_S)


def _stop(tasks: list[_Task], kill_grace: float) -> None:
    # Popen.terminate/kill check poll() first, so an exited (reaped) PID is never signalled.
    alive = [t for t in tasks if t.proc.poll() is None]
    for t in alive:
        t.stopped = True
        t.proc.terminate()
    end = time.monotonic() + kill_grace
    while any(t.proc.poll() is None for t in alive) and time.monotonic() < end:
        time.sleep(min(_POLL_S, max(0.0, end - time.monotonic())))
    for t in alive:
        if t.proc.poll() is None:
            t.proc.kill()
    for t in alive:
        t.proc.wait()


def _wait_for_exit(tasks: list[_Task], seconds: float) -> None:
    end = time.monotonic() + seconds
    try:
        while any(t.proc.poll() is None for t in tasks) and time.monotonic() < end:
            time.sleep(_POLL_S)
    except KeyboardInterrupt:  # a second Ctrl-C: stop them now
        pass


def _drain(tasks: list[_Task]) -> None:
    end = time.monotonic() + _DRAIN_S
    for t in tasks:
        for reader in t.readers:
            reader.join(max(0.0, end - time.monotonic()))


def _exit_code(returncode: int | None) -> int:
    # None cannot happen after _stop (every child is reaped); -N means killed by signal N.
    return -1 if returncode is None else 128 - returncode if returncode < 0 else returncode


__all__ = ["LaunchError", "TaskResult", "launch", "pick_free_ports"]

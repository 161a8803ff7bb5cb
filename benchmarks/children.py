"""Child processes of the benchmarks: a benchmark's group of them (:class:`Children`, each
killed by its PID at the end), and the ``--quick`` runs' fork server, which starts Python
children without importing torch and psframe again (:func:`forked_children`).

Standard library only, as :mod:`benchmarks.common`.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from benchmarks.common import ROOT, BenchmarkError, child_env

# ------------------------------------------------------- forked children (--quick)

# What a fork server imports once: torch and psframe, the seconds of CPU every Python child
# would otherwise spend importing them (all but a few hundredths of its start-up); torch._dynamo
# is what the first torch.optim optimizer of a process imports (2-3 s of CPU on its own).
FORK_PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.nn.functional",
    "numpy",
    "psutil",
    "grpc",
    "psframe",
    "psframe.ps.serving.server",
    "psframe.worker.trainer",
)
# How long the fork server may take to answer: its first answer waits for its imports (seconds
# on an idle machine, a minute or more on a loaded one).
FORK_SERVER_TIMEOUT_S = 180.0
_FORKABLE_KWARGS = {"stdin", "stdout", "stderr", "env", "cwd", "text"}
_fork_server: ForkServer | None = None  # forked_children's
_open_servers: set[ForkServer] = set()
_fork_server_wanted = False


class ForkedProcess:
    """A child forked by a :class:`ForkServer`, with the part of ``subprocess.Popen``'s interface
    the benchmarks use: ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill`` and ``stdout`` (with ``stdout=subprocess.PIPE``).

    The fork server reaps the child only when asked (:meth:`poll`), so its PID is not
    reused before :attr:`returncode` is set: signalling it until then is safe.
    """

    def __init__(self, server: ForkServer, pid: int, args: list[str], stdout=None) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A process that imports :data:`FORK_PRELOAD` once, then forks a child for each command line
    of this repository's Python code it is given (``python -m module ...``, ``python script.py
    ...``, ``python -c code ...``): the child runs it as ``python`` would (as ``__main__``, with
    that ``sys.argv``, environment, working folder and standard streams), without importing torch
    and psframe again. Used by ``--quick`` runs, whose children live a few seconds: most of a
    fresh child's CPU went into those imports. Other command lines start as usual.

    Requests and replies are JSON datagrams on a Unix socket pair; a child's standard streams
    travel as file descriptors. The server exits when this process closes its end.

    Args:
        preload: the modules the server imports before it forks anything.
        popen: how the server itself is started (``subprocess.Popen``'s signature): a
            test host's ``popen`` runs it, and so every child it forks, on that host.
    """

    def __init__(
        self, preload: Sequence[str] = FORK_PRELOAD, popen: Callable[..., subprocess.Popen] | None = None
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Every answer within a deadline: the first waits for the server's imports.
        ours.settimeout(FORK_SERVER_TIMEOUT_S)
        self._socket = ours
        self._lock = threading.Lock()
        code = f"from benchmarks.children import serve_forks; serve_forks({theirs.fileno()}, {list(preload)!r})"
        try:
            self.proc = (popen or subprocess.Popen)(
                [sys.executable, "-c", code],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=child_env(),
                cwd=ROOT,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        _open_servers.add(self)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ask(self, request: dict, fds: Sequence[int] = ()) -> dict:
        data = json.dumps(request).encode()
        try:
            with self._lock:
                if fds:
                    socket.send_fds(self._socket, [data], list(fds))
                else:
                    self._socket.send(data)
                reply = self._socket.recv(1 << 16)
        except TimeoutError as e:
            raise BenchmarkError(
                f"the fork server (pid {self.proc.pid}) did not answer within {FORK_SERVER_TIMEOUT_S:g}s"
            ) from e
        except OSError as e:
            raise BenchmarkError(f"the fork server (pid {self.proc.pid}) is gone: {e}") from e
        if not reply:
            raise BenchmarkError(f"the fork server (pid {self.proc.pid}) exited with {self.proc.poll()}")
        answer = json.loads(reply)
        if "error" in answer:
            raise BenchmarkError(f"the fork server could not start a child: {answer['error']}")
        return answer

    def exit_code(self, pid: int) -> int | None:
        """The exit code of child ``pid`` (``-N``: killed by signal N), or None while it runs."""
        return self._ask({"poll": pid})["code"]

    def reaped_cpu_seconds(self) -> float:
        """The CPU seconds (user + system) of the children the server has reaped."""
        return self._ask({"usage": True})["cpu"]

    def start(self, argv: Sequence[str], **kwargs) -> ForkedProcess | None:
        """Fork ``argv`` (``subprocess.Popen``'s keyword arguments ``stdin``, ``stdout``,
        ``stderr``, ``env``, ``cwd``, ``text``); None if it is not Python code to fork."""
        argv = [os.fspath(arg) for arg in argv]
        run = _forkable(argv)
        if run is None or not set(kwargs) <= _FORKABLE_KWARGS:
            return None
        opened: list[int] = []
        pipe = None

        def fd_of(stream, default: int, mode: int = os.O_RDWR) -> int:
            if stream is None:  # this process's own, as Popen's child inherits it (/dev/null if closed)
                try:
                    os.fstat(default)
                    return default
                except OSError:
                    stream = subprocess.DEVNULL
            if stream == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, mode))
                return opened[-1]
            return stream if isinstance(stream, int) else stream.fileno()

        try:
            stdin = fd_of(kwargs.get("stdin"), 0, os.O_RDONLY)
            stdout_arg = kwargs.get("stdout")
            if stdout_arg == subprocess.PIPE:
                read, write = os.pipe()
                opened.append(write)
                pipe = os.fdopen(read, "r" if kwargs.get("text") else "rb")
                stdout = write
            else:
                stdout = fd_of(stdout_arg, 1, os.O_WRONLY)
            stderr_arg = kwargs.get("stderr")
            stderr = stdout if stderr_arg == subprocess.STDOUT else fd_of(stderr_arg, 2, os.O_WRONLY)
            env = kwargs.get("env")
            request = {
                "run": run,
                "argv": list(argv[2:] if run[0] == "path" else argv[3:]),
                "env": dict(os.environ if env is None else env),
                "cwd": str(kwargs.get("cwd") or os.getcwd()),
            }
            pid = self._ask(request, [stdin, stdout, stderr])["pid"]
        except BaseException:
            if pipe is not None:
                pipe.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)
        return ForkedProcess(self, pid, list(argv), pipe)

    def close(self) -> None:
        """Close our end: the server exits (its children, if any, run on)."""
        _open_servers.discard(self)
        self._socket.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _forkable(argv: Sequence[str]) -> list[str] | None:
    """``["module", name]``, ``["path", script]`` or ``["code", text]`` for this Python's command
    lines that run a module, a script or code; None for anything else."""
    argv = [os.fspath(arg) for arg in argv]
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] == "-m" and len(argv) >= 3:
        return ["module", argv[2]]
    if argv[1] == "-c" and len(argv) >= 3:
        return ["code", argv[2]]
    if argv[1].endswith(".py"):
        return ["path", argv[1]]
    return None


def serve_forks(fd: int, preload: Sequence[str]) -> None:
    """The fork server's loop (see :class:`ForkServer`); ``fd`` is its end of the socket pair."""
    import importlib
    import resource

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a module moved: the children import it themselves
            print(f"[fork server] not preloaded: {e}", file=sys.stderr, flush=True)
    server = socket.socket(fileno=fd)
    codes: dict[int, int] = {}
    while True:
        data, fds, _, _ = socket.recv_fds(server, 1 << 20, 3)
        if not data:
            return  # the benchmark is done
        request = json.loads(data)
        if "usage" in request:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            reply = {"cpu": usage.ru_utime + usage.ru_stime}
        elif "poll" in request:
            pid = request["poll"]
            if pid not in codes:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 255 << 8  # never ours: reported as failed
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            reply = {"code": codes.get(pid)}
        else:
            try:
                pid = os.fork()
            except OSError as e:
                reply = {"error": str(e)}
            else:
                if pid == 0:
                    server.close()
                    _run_forked(request, fds)  # never returns
                reply = {"pid": pid}
            for each in fds:
                os.close(each)
        server.send(json.dumps(reply).encode())


def _text_stream(fd: int, errors: str, unbuffered: bool) -> io.TextIOWrapper:
    """A standard output stream on ``fd`` as python makes it (``-u``: every write goes out at once)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=True, write_through=unbuffered)


def _run_forked(request: dict, fds: Sequence[int]) -> None:
    """In a forked child: become the command line of ``request`` and exit with its code."""
    code = 1
    try:
        for target, each in zip((0, 1, 2), fds):
            os.dup2(each, target)
        for each in set(fds) - {0, 1, 2}:
            os.close(each)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, closefd=False)
        sys.stdout = _text_stream(1, "strict", unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
        sys.stderr = _text_stream(2, "backslashreplace", unbuffered=True)
        kind, target = request["run"]
        if kind == "module":
            sys.argv = [target, *request["argv"]]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "path":
            sys.argv = [target, *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-c", *request["argv"]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as python prints it, then exit 1
        traceback.print_exc()
    finally:
        try:  # what the interpreter does on its way out: wait for threads, run atexit, flush
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def start_process(argv: Sequence[str], **kwargs):
    """``subprocess.Popen(argv, **kwargs)``, or, inside :func:`forked_children`, the same command
    line forked by the fork server where it is Python code of this repository."""
    global _fork_server
    if _fork_server_wanted and _forkable(argv) is not None:
        if _fork_server is None:
            _fork_server = ForkServer()
        forked = _fork_server.start(argv, **kwargs)
        if forked is not None:
            return forked
    return subprocess.Popen(argv, **kwargs)


def forked_cpu_seconds() -> float:
    """CPU seconds of the forked children that have ended, of every :class:`ForkServer` open:
    they are a fork server's children, not this process's (once a server is closed and reaped,
    they count among this process's children)."""
    total = 0.0
    for server in list(_open_servers):
        try:
            total += server.reaped_cpu_seconds()
        except BenchmarkError:
            pass
    return total


@contextlib.contextmanager
def forked_children(enabled: bool = True) -> Iterator[None]:
    """Within: :func:`start_process` forks Python children from one :class:`ForkServer` (started
    at the first), if ``enabled``. The ``--quick`` runs use it; the full runs start every child
    afresh, as a user would."""
    global _fork_server, _fork_server_wanted
    if not enabled or _fork_server_wanted:
        yield
        return
    _fork_server_wanted = True
    try:
        yield
    finally:
        _fork_server_wanted = False
        if _fork_server is not None:
            _fork_server.close()
            _fork_server = None


class Children:
    """Child processes of one benchmark, each writing to its own log file.

    Used as a context manager: on exit every child still running is killed
    by its PID (``Popen.kill``), whatever happened.

    Args:
        log_dir: where the children's logs go.
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen | ForkedProcess:
        """Start ``argv`` as child ``name`` in the repository root."""
        if name in self.procs:
            raise BenchmarkError(f"a child named {name!r} was already started")
        with open(self.log_path(name), "w") as log:
            proc = start_process(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(env), cwd=ROOT
            )
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_output(self, name: str, pattern: str, timeout: float) -> re.Match:
        """Wait until child ``name`` printed a line matching ``pattern``.

        Raises:
            BenchmarkError: the child exited first, or ``timeout`` passed.
        """
        regex = re.compile(pattern)
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_path(name).read_text(errors="replace")
            match = regex.search(text)
            if match:
                return match
            if proc.poll() is not None:
                raise BenchmarkError(
                    f"{name} (pid {proc.pid}) exited with code {proc.returncode} before "
                    f"printing /{pattern}/; its log:\n{self.log_tail(name)}"
                )
            if time.monotonic() >= deadline:
                raise BenchmarkError(
                    f"{name} (pid {proc.pid}) did not print /{pattern}/ within "
                    f"{timeout:g}s; its log:\n{self.log_tail(name)}"
                )
            time.sleep(0.02)

    def wait_exit(self, name: str, timeout: float) -> int | None:
        """Wait for child ``name`` to exit; its exit code, or None if it is still running."""
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self, name: str) -> None:
        """Kill child ``name`` by its PID if it still runs, and reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"[bench] warning: {name} (pid {proc.pid}) survived SIGKILL for 10s", file=sys.stderr)

    def kill_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

"""Shared helpers of the benchmarks: settings, deadlines, timing, child processes, units.

Only the standard library is imported here, so the raw gRPC echo server
(:mod:`benchmarks.baselines.raw_grpc`) runs in a process without torch or
psframe, and the TensorFlow baseline (:mod:`benchmarks.baselines.tf_ps`) in an
environment that has neither. Numbers and tables are made in
:mod:`benchmarks.formatting`.

Conventions used by every benchmark:

- sizes of payloads are binary (``4 KiB``, ``64 MiB``); throughput is decimal
  (``GB/s`` = 10**9 bytes per second), each way: a round trip of an N-byte
  request and an N-byte response at R round trips/s moves N*R bytes each way;
- a rate is the median of several repeats, each timed after a warm-up;
- every wait has a deadline (:class:`Deadline`), and every child process is
  killed by its PID when the benchmark that started it ends (:class:`Children`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import math
import os
import re
import runpy
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KiB = 1024
MiB = 1024 * KiB
GB = 10**9  # throughput unit (decimal), as network speeds are quoted
MB = 10**6

FULL_SIZES = (4 * KiB, 320 * KiB, 4 * MiB, 64 * MiB)
QUICK_SIZES = (4 * KiB, 320 * KiB)


class BenchmarkError(RuntimeError):
    """A benchmark could not run (a child died, a deadline passed, a bad reply)."""


# --------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """How long and how often to measure.

    Args:
        quick: the smoke-test mode (tiny sizes, few repeats).
        sizes: payload sizes in bytes.
        repeats: timed repeats per measurement; the median is reported.
        target_seconds: aim for repeats of about this long (more calls per
            repeat for small payloads).
        min_calls: calls per repeat at least, however slow each one is.
        warmup_calls: untimed calls before the repeats, at least...
        warmup_seconds: ...and for at least this long.
    """

    quick: bool
    sizes: tuple[int, ...]
    repeats: int
    target_seconds: float
    min_calls: int
    warmup_calls: int
    warmup_seconds: float
    max_calls: int = 20_000

    @classmethod
    def for_mode(cls, quick: bool) -> Settings:
        if quick:
            return cls(
                quick=True,
                sizes=QUICK_SIZES,
                repeats=3,
                target_seconds=0.05,
                min_calls=2,
                warmup_calls=2,
                warmup_seconds=0.02,
            )
        return cls(
            quick=False,
            sizes=FULL_SIZES,
            repeats=5,
            target_seconds=0.5,
            min_calls=3,
            warmup_calls=3,
            warmup_seconds=0.3,
        )

    def describe(self) -> str:
        return (
            f"median of {self.repeats} repeats of at least {self.min_calls} calls and about "
            f"{self.target_seconds:g} s each, after at least {self.warmup_calls} warm-up calls "
            f"and {self.warmup_seconds:g} s of warm-up"
        )


class Deadline:
    """A point in time that a benchmark must not run past.

    Args:
        seconds: how long from now.
        what: what is being waited for, for the error message.
    """

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self.start = time.monotonic()
        self.end = self.start + seconds

    def remaining(self, floor: float = 0.1) -> float:
        """Seconds left (at least ``floor``, so it can be passed as a timeout)."""
        return max(floor, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def check(self, doing: str = "") -> None:
        """Raise :class:`BenchmarkError` once the deadline has passed."""
        if self.expired():
            raise BenchmarkError(
                f"{self.what}: deadline of {self.seconds:g}s passed" + (f" while {doing}" if doing else "")
            )


# ----------------------------------------------------------------------- timing


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of nothing")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Rate:
    """Calls per second: the median of the timed repeats, and each of them."""

    per_second: float
    samples: list[float] = field(default_factory=list)
    calls_per_repeat: int = 0

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats: how stable the measurement was."""
        if not self.samples or not self.per_second:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.per_second


def measure_rate(call: Callable[[], object], settings: Settings, deadline: Deadline, doing: str = "") -> Rate:
    """Time ``call`` (one round trip): warm up, then ``settings.repeats`` repeats.

    The number of calls per repeat is chosen from the warm-up so that a repeat
    lasts about ``settings.target_seconds`` (at least ``settings.min_calls``).

    Returns:
        The median rate over the repeats (warm-up excluded).

    Raises:
        BenchmarkError: ``deadline`` passed (checked between calls of the warm-up
            and between repeats).
    """
    durations = []
    warm_start = time.perf_counter()
    while len(durations) < settings.warmup_calls or time.perf_counter() - warm_start < settings.warmup_seconds:
        deadline.check(f"warming up {doing}")
        t = time.perf_counter()
        call()
        durations.append(time.perf_counter() - t)
    # The first calls pay for connections and caches: estimate from the later ones.
    per_call = median(durations[len(durations) // 2 :]) or 1e-6
    calls = int(min(settings.max_calls, max(settings.min_calls, math.ceil(settings.target_seconds / per_call))))
    samples = []
    for _ in range(settings.repeats):
        deadline.check(f"timing {doing}")
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append(calls / (time.perf_counter() - start))
    return Rate(median(samples), samples, calls)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None where either is missing or not a number, or base is 0."""
    if value is None or not base or math.isnan(value) or math.isnan(base):
        return None
    return value / base


def gb_per_second(nbytes: int, per_second: float) -> float:
    """Decimal GB/s moved each way by ``per_second`` round trips of ``nbytes`` each way."""
    return nbytes * per_second / GB


def single_thread() -> None:
    """One compute thread in this process (and, through the environment, its children)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


# ------------------------------------------------- shared by the training children

NUM_WINDOWS = 5  # pieces of a training run's timed window; the median piece's rate is reported


def timed_windows(
    times: Sequence[float], counts: Sequence[int], start_count: int, num_windows: int = NUM_WINDOWS
) -> dict:
    """Rates over the records from the first one whose count reached ``start_count``.

    Args:
        times: ``time.perf_counter()`` after each step, in order.
        counts: the step counter (global or local) at those times.
        start_count: the count at which warm-up is over.
        num_windows: how many pieces the timed records are cut into.

    Returns:
        ``steps_per_sec`` (the median piece's rate), ``window_rates``,
        ``overall_steps_per_sec``, ``steps`` and ``seconds`` of the whole window,
        and ``window``: its first and last ``time.perf_counter()``.

    Raises:
        ValueError: fewer than two records after warm-up.
    """
    first = next((i for i, c in enumerate(counts) if c >= start_count), len(counts))
    t, c = list(times[first:]), list(counts[first:])
    if len(t) < 2:
        raise ValueError(
            f"only {len(t)} step(s) recorded after warm-up (count {start_count}); {len(counts)} in all: run more steps"
        )
    pieces = min(num_windows, len(t) - 1)
    bounds = [round(j * (len(t) - 1) / pieces) for j in range(pieces + 1)]
    rates = [(c[b] - c[a]) / (t[b] - t[a]) for a, b in zip(bounds, bounds[1:]) if t[b] > t[a]]
    seconds = t[-1] - t[0]
    return {
        "steps_per_sec": statistics.median(rates) if rates else math.nan,
        "window_rates": [round(r, 2) for r in rates],
        "overall_steps_per_sec": (c[-1] - c[0]) / seconds if seconds > 0 else math.nan,
        "steps": c[-1] - c[0],
        "seconds": seconds,
        "window": [t[0], t[-1]],
    }


def file_barrier(directory: str, name: str, count: int, timeout: float) -> None:
    """Wait until ``count`` processes called this with the same ``directory``.

    Raises:
        TimeoutError: after ``timeout`` seconds, naming who arrived.
    """
    path = Path(directory)
    (path / f"ready-{name}").touch()
    deadline = time.monotonic() + timeout
    while True:
        arrived = sorted(p.name[len("ready-") :] for p in path.glob("ready-*"))
        if len(arrived) >= count:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"start barrier: {len(arrived)} of {count} processes arrived ({', '.join(arrived)}) after {timeout:g}s"
            )
        time.sleep(0.01)


def emit(result: dict) -> None:
    """Print the one JSON line the parent reads."""
    print(json.dumps(result), flush=True)


# -------------------------------------------------------------- child processes


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: one compute thread, unbuffered, psframe importable."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        **(extra or {}),
    }


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
        self._socket = ours
        self._lock = threading.Lock()
        code = f"from benchmarks.common import serve_forks; serve_forks({theirs.fileno()}, {list(preload)!r})"
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


# ------------------------------------------------------------------ command line


def table_main(argv: Sequence[str] | None, doc: str, quick_help: str, table_of: Callable[[bool], str]) -> int:
    """The command line of a benchmark module that prints one report table:
    ``--quick`` (described by ``quick_help``) is passed to ``table_of``, whose table is printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    args = parser.parse_args(argv)
    print(table_of(args.quick))
    return 0

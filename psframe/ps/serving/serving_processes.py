"""A ps task served from several processes on its one port.

``psframe.Server(..., serving_processes=K)`` listens on the task's port with
``SO_REUSEPORT`` and starts K - 1 serving processes that listen on the same
port: the kernel spreads the workers' connections among the K processes
(gRPC's multiprocessing pattern). The task's own process (the owner) creates
the variables in shared memory (:mod:`psframe.ps.serving.shared_store`). A serving process
answers asynchronous PushPull requests itself, over the same variables and
optimizer state under one lock, once the owner published them; every other
call (and every push before that, and every synchronous push) it forwards
to the owner on this host, as the bytes it received and with their
deadlines, relaying the answers and errors unchanged. So the task behaves
as one task however its connections are spread: one global step, exact
sync rounds, one checkpoint, one ``status``.

Security: a serving process listens with the task's TLS settings and
checks the task's auth token; it gets them from the owner through its
environment (never its command line, which other users may read), and
reaches the owner on a Unix socket in the task's private shared folder.

Lifecycle: the owner starts the serving processes once it listens and waits
(with a deadline) until each one listens too; it stops them (SIGTERM, then
SIGKILL) when it stops; a serving process that dies is reported by
:meth:`ServingProcesses.check`, and one whose owner dies exits on its own.

    python -m psframe.ps.serving.serving_processes --cluster_spec=... --task_index=0 --bind=h0:2222 \\
        --owner=unix:/dev/shm/psframe-ps-.../owner.sock --shared=/dev/shm/psframe-ps-... --index=1  # by the owner
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from psframe.cluster import ClusterSpec
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.errors import NotKeptHere, PsframeError
from psframe.memory import HugePageMemory, malloc
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.ps.serving.shared_service import shared_service
from psframe.ps.serving.shared_store import SharedStore
from psframe.ps.store import VariableStore
from psframe.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, Connection, RpcServer, Watchdog

log = logging.getLogger(__name__)

FORWARD_REPLY_TIMEOUT_S = 3600.0  # a forwarded sync push may wait for its round as long as the sync timeout
START_TIMEOUT_S = 60.0  # a fresh interpreter imports torch and gRPC before it listens
STOP_GRACE_S = 2.0
_READY = "psframe serving process listening"


# A serving process per this many cores the task may use (workers and the
# kernel's network work need the rest), and at most this many: a raw gRPC echo
# server on 16 cores made ~3.5x the round trips of one process with 4.
CORES_PER_SERVING_PROCESS = 4
MAX_DEFAULT_SERVING_PROCESSES = 8


def default_serving_processes(cores: int | None = None) -> int:
    """How many processes serve a ps task unless told: one per
    :data:`CORES_PER_SERVING_PROCESS` cores this process may run on
    (``os.sched_getaffinity``; a container's CPU set counts), at least 1 and
    at most :data:`MAX_DEFAULT_SERVING_PROCESSES`: 1 on up to 7 cores, 4 on 16.
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_SERVING_PROCESSES, cores // CORES_PER_SERVING_PROCESS))


class ServingProcesses:
    """The serving processes of one ps task (all but its owner).

    Args:
        count: how many to start.
        task_name: the task, for logs and errors (``/job:ps/task:0``).
        bind: the address they listen on: the task's own.
        owner: where the owner answers them (``unix:PATH`` or ``host:port``).
        max_threads: calls each one serves at once.
        security: the task's auth token and TLS settings (passed in their environment).
        max_message_bytes: the largest request each one accepts.
        liveness: the task's keepalive settings (passed as flags).
        max_workers: the task's worker slots (``Server(max_workers=...)``, or the cluster's workers).
    """

    def __init__(
        self,
        count: int,
        *,
        cluster: ClusterSpec,
        task_index: int,
        bind: str,
        owner: str,
        shared_folder: str,
        max_threads: int,
        security: Security | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        liveness: Liveness | None = None,
        max_workers: int | None = None,
    ) -> None:
        liveness = liveness or Liveness.resolve()
        max_workers = max_workers or cluster.num_workers
        self.task_name = ClusterSpec.task_name("ps", task_index)
        self._security = security or Security()
        self._argv = [
            [
                sys.executable,
                "-m",
                "psframe.ps.serving.serving_processes",
                f"--cluster_spec={cluster.to_string()}",
                f"--task_index={task_index}",
                f"--bind={bind}",
                f"--owner={owner}",
                f"--shared={shared_folder}",
                f"--index={i}",
                f"--max_threads={max_threads}",
                f"--parent_pid={os.getpid()}",
                f"--max_message_bytes={max_message_bytes}",
                f"--keepalive_time={liveness.keepalive_time}",
                f"--keepalive_timeout={liveness.keepalive_timeout}",
                f"--max_workers={max_workers}",
            ]
            for i in range(1, count + 1)
        ]
        self._procs: list[subprocess.Popen] = []
        self._stopping = False

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start every serving process and wait until each one listens.

        Raises:
            PsframeError: one did not listen within ``timeout`` (or exited),
                with its last words; every one started is stopped.
        """
        # The same psframe as this process's, wherever it was imported from.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = self._security.child_environment()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        for argv in self._argv:
            # A session of their own: a terminal's Ctrl-C goes to the owner alone, which stops them
            # (a KeyboardInterrupt in each would print a traceback apiece); they still exit with the owner.
            self._procs.append(
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
                    bufsize=1,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        try:
            for index, proc in enumerate(self._procs, start=1):
                self._wait_listening(index, proc, deadline, timeout)
        except BaseException:
            self.stop()
            raise
        log.info(
            "%s: serving from %d processes (pids %s and this one, %d)",
            self.task_name,
            len(self._procs) + 1,
            ", ".join(str(p.pid) for p in self._procs),
            os.getpid(),
        )

    def _wait_listening(self, index: int, proc: subprocess.Popen, deadline: float, timeout: float) -> None:
        lines: list[str] = []
        stdout = proc.stdout
        if stdout is None:
            raise PsframeError(f"serving process {index} was started without a pipe for its output")
        while time.monotonic() < deadline:
            ready, _, _ = select.select([stdout], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
            if ready:
                line = stdout.readline()
                if line.startswith(_READY):
                    threading.Thread(target=_drain, args=(stdout,), daemon=True).start()
                    return
                if line:
                    lines.append(line.rstrip())
                    continue
            if proc.poll() is not None:
                raise PsframeError(
                    f"serving process {index} of {self.task_name} exited with code {proc.returncode} before it "
                    f"listened: {' | '.join(lines[-5:]) or 'no output'}"
                )
        raise PsframeError(
            f"serving process {index} of {self.task_name} did not listen within "
            f"{timeout:g}s: {' | '.join(lines[-5:]) or 'no output'}"
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def check(self) -> None:
        """Raise if a serving process exited while the task serves.

        Raises:
            PsframeError: naming the process and its exit code.
        """
        if self._stopping:
            return
        for index, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                raise PsframeError(
                    f"serving process {index} (pid {proc.pid}) of {self.task_name} exited "
                    f"with code {proc.returncode}; its connections are lost"
                )

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every serving process (SIGTERM; SIGKILL after ``grace`` seconds). Idempotent."""
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace + 1.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _drain(stream) -> None:
    """Read (and drop) what a serving process prints once it listens, so it never blocks on a full pipe."""
    for _ in stream:
        pass


# ---- the serving process itself


class SharedPushPull:
    """A serving process's PushPull: answered here over the shared model once the owner
    published it, forwarded to the owner before that (and for every sync push, and every
    push that carries data progress: the owner keeps the data queues)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        task_index: int,
        shared: SharedStore,
        owner: str,
        security: Security,
        liveness: Liveness | None = None,
        max_workers: int | None = None,
    ) -> None:
        self._cluster, self._task_index, self._shared = cluster, task_index, shared
        self._max_workers = max_workers
        self._owner = Connection(owner, f"{ClusterSpec.task_name('ps', task_index)} (owner)", security, liveness)
        self._watchdog = Watchdog()
        self._service: ParameterServerService | None = None
        self._version = 0
        self._lock = threading.Lock()

    def _local(self) -> ParameterServerService | None:
        """The service over the model published last (None before the first publication)."""
        version = self._shared.version
        if version != self._version:
            with self._lock, self._shared.lock:
                if self._shared.version != self._version:
                    variables, states, optimizer, tables, table_optimizer, versions = self._shared.load()
                    store = VariableStore(
                        self._service_name(),
                        lock=self._shared.lock,
                        counters=self._shared.counters,
                        memory=HugePageMemory(),
                    )
                    store.attach_shared(variables, states, optimizer, tables, table_optimizer, versions)
                    self._service = shared_service(
                        self._shared,
                        self._cluster,
                        self._task_index,
                        store,
                        max_workers=self._max_workers,
                        keeps_data=False,
                    )
                    self._version = self._shared.version
        return self._service

    def _service_name(self) -> str:
        return ClusterSpec.task_name("ps", self._task_index)

    def push_pull(self, requests: Iterator[bytes]) -> Iterator[bytes]:
        forwarded = None
        cache = StreamCache()
        try:
            for data in requests:
                service = self._local()
                if service is not None:
                    try:
                        yield service.push_pulls.reply(data, cache)
                        continue
                    except NotKeptHere:  # nothing applied: the owner answers it
                        pass
                forwarded = forwarded or self._owner.open_stream("PushPull", self._watchdog)
                forwarded.send(data, FORWARD_REPLY_TIMEOUT_S)
                yield forwarded.receive()
        finally:
            if forwarded is not None:
                forwarded.close()

    def close(self) -> None:
        self._watchdog.stop()
        self._owner.close()


def serve(
    cluster: ClusterSpec,
    task_index: int,
    bind: str,
    owner: str,
    shared_folder: str,
    index: int,
    max_threads: int,
    parent_pid: int,
    security: Security | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    liveness: Liveness | None = None,
    max_workers: int | None = None,
) -> int:
    """Listen on ``bind`` beside the owner, answer pushes over the shared model and forward
    the rest to the owner, until told to stop. ``security``: the task's (default: none);
    ``max_message_bytes``: the largest request accepted; ``liveness``: the task's keepalive;
    ``max_workers``: the task's worker slots (default: the cluster's workers).

    Returns:
        The exit code: 0 when stopped (SIGTERM) or once the owner is gone.
    """
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    task_name = ClusterSpec.task_name("ps", task_index)
    max_workers = max_workers or cluster.num_workers
    shared = SharedStore.attach(shared_folder, cluster.num_workers, max_workers)
    security = security or Security()
    push_pull = SharedPushPull(cluster, task_index, shared, owner, security, liveness, max_workers)
    server = RpcServer(
        {"PushPull": push_pull.push_pull},
        name=f"{task_name}-serving{index}",
        max_threads=max_threads,
        forward_to=owner,
        share_port=True,
        security=security,
        max_message_bytes=max_message_bytes,
        liveness=liveness,
    )
    server.bind(bind)
    server.start()
    print(f"{_READY} at {bind} (pid {os.getpid()})", flush=True)
    # Never outlive the owner: a serving process without one only fails calls.
    while not stopped.wait(0.5) and os.getppid() == parent_pid:
        pass
    server.stop(grace=STOP_GRACE_S)
    push_pull.close()
    shared.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One serving process of a ps task (started by the task).")
    parser.add_argument("--cluster_spec", required=True)
    parser.add_argument("--task_index", type=int, required=True)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--owner", required=True)
    parser.add_argument("--shared", required=True, help="the task's shared-memory folder")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--max_threads", type=int, default=16)
    parser.add_argument("--parent_pid", type=int, required=True)
    parser.add_argument("--max_message_bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--keepalive_time", type=float, default=None)
    parser.add_argument("--keepalive_timeout", type=float, default=None)
    parser.add_argument("--max_workers", type=int, default=None)
    args = parser.parse_args(argv)
    malloc.tune_malloc()  # before any gRPC thread: a serving process moves the task's messages
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # The task's token and TLS files, from the owner through the environment.
        return serve(
            ClusterSpec.from_string(args.cluster_spec),
            args.task_index,
            args.bind,
            args.owner,
            args.shared,
            args.index,
            args.max_threads,
            args.parent_pid,
            Security.resolve(),
            args.max_message_bytes,
            Liveness.resolve(args.keepalive_time, args.keepalive_timeout),
            args.max_workers,
        )
    except PsframeError as e:
        print(f"error: {e}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

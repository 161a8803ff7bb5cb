"""``psframe.Server``: one task's gRPC server, as TF's ``tf.train.Server``."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn

from psframe.cluster import ClusterSpec, parse_address
from psframe.config.liveness import Liveness
from psframe.config.security import Security, accept_security
from psframe.config.stopping import stop_grace
from psframe.errors import ClusterSpecError, NotReadyError, PsframeError
from psframe.ps.elastic import relayout
from psframe.ps.protocol.roster import check_max_workers
from psframe.ps.service import ParameterServerService
from psframe.ps.service.task_service import TaskService
from psframe.ps.serving import leaving
from psframe.ps.serving.serving_processes import ServingProcesses, default_serving_processes
from psframe.ps.serving.shared_service import Publisher, shared_service
from psframe.ps.serving.shared_store import PortLock, SharedStore
from psframe.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, METHODS, RpcServer

MIN_MESSAGE_BYTES = 64 << 10  # below, not even an Init of a small model or a status call's reply fits

log = logging.getLogger(__name__)


class Server:
    """The server of one task of the cluster.

    A ps task holds the variables placed on it and applies the gradients
    workers push; :meth:`join` returns once every worker has finished, so a ps
    process ends with exit code 0 on its own. A worker task's server only
    answers who it is (``psframe ping``).

    A task's address with port 0 (``"localhost:0"``, as for TF's
    ``Server.create_local_server()``) asks for any free port: the server
    binds one and reports it in :attr:`port`, :attr:`address`, :attr:`target`
    and :attr:`cluster`, the cluster with the real address. The workers need
    that address: give them ``server.cluster`` (in this process, as
    :func:`psframe.local_cluster` does), or the address ``psframe server``
    prints when it starts. Only the task's own address may have port 0 in a
    ps task's cluster, since ps tasks call each other.

    Args:
        cluster: the cluster, as a :class:`ClusterSpec` or a dict of job name to
            addresses.
        job_name: ``"ps"`` or ``"worker"``.
        task_index: this task's index in its job.
        bind_address: where to listen instead of the task's address in the
            cluster, e.g. ``"[::]:2222"`` or ``"0.0.0.0:2222"`` in a container.
        start: start serving now (as TF's ``Server(start=True)``).
        max_threads: request threads; defaults to enough for every worker to
            have several calls in flight. Callers on one host may hold three
            quarters of them; a call beyond is answered ``RESOURCE_EXHAUSTED``
            (see :mod:`psframe.wire.transport.limits`).
        max_message_bytes: the largest request accepted (256 MiB by
            default); a larger one is answered ``RESOURCE_EXHAUSTED``. Raise it
            for Trainers given a ``max_shard_bytes`` near it.
        liveness: how the task's connections are probed for a peer that went
            away (keepalive pings; see :mod:`psframe.config.liveness`). None: the
            ``PSFRAME_KEEPALIVE_*`` environment variables, or 5 s + 5 s.
        worker_timeout: (ps) once some workers have finished, workers other
            than the chief silent for this many seconds are presumed dead and
            not waited for.
        chief_timeout: (ps) the same for the chief, which is waited for longer
            (it writes the final checkpoint and reports the result); default:
            ten times ``worker_timeout``. The rules: :mod:`psframe.ps.protocol.roster`.
        max_workers: (ps) the worker slots of an elastic cluster: workers beyond the
            cluster's (started with a grown ``--worker_hosts``, the same ps tasks) join
            a running job up to this many, workers leave (finish) or die while the
            others train, and sync rounds count the live workers
            (the guide "Elastic clusters"). None: the cluster's workers are fixed. Give every
            ps task the same value.
        checkpoint_dir: (ps) where checkpoints are kept (any fsspec URL). A ps
            started again after a crash restores its shard from the latest
            valid checkpoint there on its own.
        serving_processes: (ps) how many processes listen on the task's port
            (see :mod:`psframe.ps.serving.serving_processes`); this process holds the variables
            and the others share them. None (the default): one per 4 cores
            this process may use, at most 8 (1 on up to 7 cores, 4 on 16;
            :func:`psframe.ps.serving.serving_processes.default_serving_processes`); 1 serves
            from this process alone. A worker task always uses 1.
        security: who may talk to the task, a :class:`psframe.Security`: the
            cluster's shared auth token, which every call must carry (the
            task's own calls to other ps tasks do); this task's certificate
            and key (PEM), with which the server listens with TLS and which it
            presents as a client certificate to other ps tasks; the CA (PEM)
            the other tasks' certificates chain to (with a certificate,
            callers must present one it signed: mutual TLS). Used as given.
            None: from the ``PSFRAME_AUTH_TOKEN`` and ``PSFRAME_TLS_*``
            environment variables (:meth:`Security.resolve`), or none.

    Raises:
        ClusterSpecError: the cluster, job or index is invalid, or another ps
            task's address has port 0.
        PortInUseError: the address cannot be listened on.
        SecurityConfigError: a security setting is invalid or its file cannot be read.

    Example::

        cluster = psframe.ClusterSpec({"ps": ["localhost:2222"], "worker": ["localhost:2223"]})
        psframe.Server(cluster, "ps", 0).join()

        server = psframe.Server({"ps": ["localhost:0"], "worker": ["localhost:0"]}, "ps", 0)
        server.port, server.target    # (40123, 'grpc://localhost:40123')
        trainer = psframe.Trainer(model, server.cluster)
    """

    def __init__(
        self,
        cluster: ClusterSpec | Mapping[str, Sequence[str]],
        job_name: str,
        task_index: int,
        *,
        bind_address: str | None = None,
        start: bool = True,
        max_threads: int | None = None,
        worker_timeout: float = 60.0,
        chief_timeout: float | None = None,
        checkpoint_dir: str | None = None,
        serving_processes: int | None = None,
        security: Security | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        liveness: Liveness | None = None,
        max_workers: int | None = None,
    ) -> None:
        self.security = accept_security("Server", security)
        self.liveness = liveness or Liveness.resolve()
        cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        cluster.validate_task(job_name, task_index)
        self.job_name = job_name
        self.task_index = task_index
        self._checkpoint_dir = checkpoint_dir
        self.task_name = ClusterSpec.task_name(job_name, task_index)
        if job_name == "ps":
            others = [k for k in cluster.tasks_on_any_port("ps") if k != task_index]
            if others:
                raise ClusterSpecError(
                    f"{self.task_name}: {ClusterSpec.task_name('ps', others[0])} has address "
                    f"{cluster.task_address('ps', others[0])!r}; port 0 (any free port) may be given only for "
                    f"this task's own address, since ps tasks call each other: give the other ps tasks' real addresses"
                )
        if serving_processes is None:
            serving_processes = default_serving_processes() if job_name == "ps" else 1
        if isinstance(serving_processes, bool) or not isinstance(serving_processes, int) or serving_processes < 1:
            raise ValueError(f"serving_processes must be an int >= 1, got {serving_processes!r}")
        if serving_processes > 1 and job_name != "ps":
            raise ValueError(f"serving_processes applies to ps tasks; {self.task_name} is a worker task")
        if max_workers is not None and job_name != "ps":
            raise ValueError(f"max_workers applies to ps tasks; {self.task_name} is a worker task")
        slots = check_max_workers(max_workers, cluster.num_workers)
        if (
            isinstance(max_message_bytes, bool)
            or not isinstance(max_message_bytes, int)
            or not MIN_MESSAGE_BYTES <= max_message_bytes < 2**31
        ):
            raise ValueError(
                f"max_message_bytes must be an int from {MIN_MESSAGE_BYTES} (64 KiB) to 2**31 - 1 "
                f"(gRPC's limit), got {max_message_bytes!r}"
            )
        # Several serving processes share the variables, in shared memory.
        self._shared = SharedStore.create(cluster.num_workers, slots) if serving_processes > 1 else None
        threads = max_threads or max(16, 4 * slots + 8)
        bind = (bind_address or cluster.task_address(job_name, task_index)).strip()
        self._port_lock: PortLock | None = None
        slot = _ServiceSlot(_methods_answered(job_name))
        rpc: RpcServer | None = None
        try:
            self._rpc = rpc = RpcServer(
                slot.handlers(),
                name=self.task_name,
                max_threads=threads,
                share_port=serving_processes > 1,
                security=self.security,
                max_message_bytes=max_message_bytes,
                liveness=self.liveness,
            )
            host, port = parse_address(bind, any_port=True)
            if warning := self.security.clear_token_warning(host):
                log.warning("%s: %s", self.task_name, warning)
            if serving_processes > 1 and port != 0:
                # SO_REUSEPORT lets any process of this user listen beside us: take the port first.
                self._port_lock = PortLock(port, self.task_name)
            self._port = self._rpc.bind(bind)
            if port == 0:
                bind = _with_port(bind, self._port)
                if serving_processes > 1:  # a port the kernel just picked: nobody else listens there
                    self._port_lock = PortLock(self._port, self.task_name)
            own = cluster.task_address(job_name, task_index)
            if parse_address(own, any_port=True)[1] == 0:
                cluster = cluster.with_task_address(job_name, task_index, _with_port(own, self._port))
            self.cluster = cluster
            self.address = cluster.task_address(job_name, task_index)
            # Made once the port is bound: the service's cluster holds the real address.
            if job_name == "ps":
                options: dict[str, Any] = dict(
                    worker_timeout=worker_timeout,
                    checkpoint_dir=checkpoint_dir,
                    security=self.security,
                    chief_timeout=chief_timeout,
                    liveness=self.liveness,
                    max_workers=max_workers,
                )
                if self._shared is None:
                    self.service: TaskService = ParameterServerService(self.cluster, task_index, **options)
                    handlers = self.service.handlers()
                else:  # the model lives in the shared folder; the serving processes get it once published
                    self.service = service = shared_service(self._shared, self.cluster, task_index, **options)
                    handlers = Publisher(service, self._shared).handlers()
            else:
                self.service = TaskService(self.cluster, job_name, task_index)
                handlers = self.service.handlers()
            slot.fill(self.task_name, handlers)
        except BaseException:
            if rpc is not None:
                _release_port(rpc)
            if self._shared is not None:
                self._shared.close()  # nothing else holds the folder yet
            if self._port_lock is not None:
                self._port_lock.release()
            raise
        self._serving: ServingProcesses | None = None
        if self._shared is not None:  # several serving processes
            # The other serving processes reach this one on a socket in the shared folder,
            # which only this user may enter (as the variables there).
            owner = self._rpc.bind_local(os.path.join(self._shared.folder, "owner.sock"))
            self._serving = ServingProcesses(
                serving_processes - 1,
                cluster=self.cluster,
                task_index=task_index,
                bind=bind,
                owner=owner,
                shared_folder=self._shared.folder,
                max_threads=threads,
                security=self.security,
                max_message_bytes=max_message_bytes,
                liveness=self.liveness,
                max_workers=slots,
            )
        self._stopped = threading.Event()
        self._started = False
        if start:
            self.start()

    @property
    def port(self) -> int:
        """The port this server listens on: the one it picked if it was given port 0."""
        return self._port

    @property
    def target(self) -> str:
        """The address to reach this task, as ``grpc://host:port`` (the real port, if it picked one)."""
        return f"grpc://{self.address}"

    def start(self) -> None:
        """Start serving (idempotent)."""
        if not self._started:
            self._rpc.start()
            self._started = True
            if self._serving is not None:
                try:
                    self._serving.start()
                except BaseException:
                    self.stop(grace=0.0)
                    raise
            if self.job_name == "ps":  # meanwhile, torch.optim's first optimizer (a second of imports)
                threading.Thread(target=relayout.prepare, name="psframe-make-ready", daemon=True).start()
            # Said last: once a task says it serves, it has nothing left to start, so a Ctrl-C that
            # follows the line finds it in join() (one line, exit code 130), not half started.
            log.info("%s serving at %s (%s)", self.task_name, self.address, self.security.describe())

    def join(self, timeout: float | None = None) -> bool:
        """Serve until training is over (ps: every worker finished) or :meth:`stop`.

        Asked to stop meanwhile, the task stops serving and ends with one line on
        stderr, whether or not :func:`psframe.flags.run` wraps the script
        (:mod:`psframe.ps.serving.leaving`): after Ctrl-C, exit code 130; after
        SIGTERM (from the main thread, where SIGTERM has its default action), it
        first saves a checkpoint of the cluster where it has a ``checkpoint_dir``,
        within ``PSFRAME_STOP_GRACE`` seconds (20), and exits 143.

        Args:
            timeout: seconds to wait at most; None waits for as long as it takes.

        Returns:
            True if the server is done and stopped, False if ``timeout`` ran out.

        Raises:
            PsframeError: one of the task's serving processes died (the task stops).
            psframe.errors.Interrupted: Ctrl-C (a ``KeyboardInterrupt`` and a
                ``SystemExit(130)``), after the line.
            psframe.errors.TaskStopped: SIGTERM (a ``SystemExit(143)``), after the line.
        """
        with leaving.sigterm_noted() as sigterm:
            try:
                return self._join(timeout, sigterm)
            except KeyboardInterrupt:
                self.stop(grace=0.5)
                leaving.interrupted()

    def _leave(self) -> NoReturn:
        """SIGTERM came: save if the task can, stop, say so (:mod:`psframe.ps.serving.leaving`)."""
        grace = stop_grace()
        log.info("%s: SIGTERM; leaving within %gs", self.task_name, grace)
        saved = "stopped serving"  # a worker task's server holds nothing to save
        if self.job_name == "ps":
            saved = leaving.save_cluster(
                self.service.cluster,
                self.task_index,
                self._checkpoint_dir,
                security=self.security,
                liveness=self.liveness,
                timeout=max(0.0, grace - 1.0),  # a second left to stop
            )
        self.stop(grace=0.5)
        leaving.terminated(self.task_name, saved)

    def _join(self, timeout: float | None, sigterm: threading.Event) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._stopped.wait(0.1):
            if sigterm.is_set():
                self._leave()
            if self._serving is not None:
                try:
                    self._serving.check()
                except PsframeError:
                    self.stop(grace=0.5)
                    raise
            if self.service.check_training_over():
                info = self.service.info()
                if self.job_name == "ps":
                    log.info(
                        "%s: training is over at global step %d (%d worker steps applied, %d dropped as "
                        "stale or late, %d pushes refused as invalid); exiting",
                        self.task_name,
                        info.global_step,
                        info.applied_steps,
                        info.dropped_gradients,
                        info.rejected_pushes,
                    )
                if isinstance(self.service, ParameterServerService):  # the streams' offsets it keeps (ps 0)
                    for name, offsets in sorted(self.service.data.streams.offsets().items()):
                        log.info("%s: stream %r committed up to offsets %s", self.task_name, name, offsets)
                self.stop()
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving; calls in flight get ``grace`` seconds to finish."""
        if not self._stopped.is_set():
            self._stopped.set()
            if self._serving is not None:  # first, so that nothing is forwarded to a stopped owner
                self._serving.stop()
            self._rpc.stop(grace)
            self.service.close()
            if self._shared is not None:
                self._shared.close()
            if self._port_lock is not None:
                self._port_lock.release()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0.5)

    def __repr__(self) -> str:
        return f"Server({self.task_name} at {self.address})"


def _methods_answered(job_name: str) -> Collection[str]:
    """The methods a task of ``job_name`` answers: a ps task every method of the
    service, another task who it is (see the services' ``handlers()``)."""
    return tuple(METHODS) if job_name == "ps" else ("GetInfo", "Shutdown")


def _release_port(rpc: RpcServer) -> None:
    """Give up the port of a server that never served (the error being raised wins over any here)."""
    try:
        # gRPC lets go of a bound port only once the server has started and stopped;
        # a call in between finds no service and is refused as not ready.
        rpc.start()
        rpc.stop(0.0)
    except Exception:
        log.exception("could not release the port of a server that failed to start")


def _with_port(address: str, port: int) -> str:
    """``address`` (``host:port``, ``[ipv6]:port``) with another port."""
    return f"{address.strip().rpartition(':')[0]}:{port}"


class _ServiceSlot:
    """A task's RPC handlers, calling its service once :meth:`fill` gave it.

    The server binds its port before it makes the service: a task asked to pick
    a free port learns its address only then, and the service's cluster holds it
    (every call compares clusters).
    """

    def __init__(self, names: Collection[str]) -> None:
        self._names = frozenset(names)
        self._handlers: dict[str, Callable[..., Any]] = {}

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {name: functools.partial(self._call, name) for name in self._names}

    def fill(self, task_name: str, handlers: dict[str, Callable[..., Any]]) -> None:
        if set(handlers) != self._names:
            raise TypeError(f"{task_name} answers {sorted(handlers)}, expected {sorted(self._names)}")
        self._handlers = handlers

    def _call(self, name: str, request: Any) -> Any:
        handler = self._handlers.get(name)
        if handler is None:
            raise NotReadyError(f"{name}: the task is not serving (it failed to start)")
        return handler(request)

"""``psframe serve`` as a running thing: the follower's thread, the HTTP server's thread, and how they stop.

:class:`ServeProcess` binds its socket itself (loopback and a port the OS picks by default, so
that the address is known before anything is served), then runs the
:class:`~psframe.serve.follower.CheckpointFollower` in one thread and uvicorn, serving the app of
:mod:`psframe.serve.http_api`, in another. Tests and notebooks use it as a context manager;
:func:`serve_until_stopped` is the command's main loop: it prints one line saying where it
serves, then waits for SIGTERM or Ctrl-C, and stops both threads within their deadlines.

Stopping ends as every psframe task ends (:mod:`psframe.config.stopping`): after SIGTERM, one
line ``psframe serve: stopped by SIGTERM; ...`` and exit code 143; after Ctrl-C, ``psframe serve:
interrupted by Ctrl-C (SIGINT); stopped`` and 130. Requests under way get
:data:`STOP_GRACE_S` seconds to finish.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import sys
import threading
import time
from types import TracebackType
from typing import NoReturn, TextIO

import uvicorn

from psframe.config.stopping import EXIT_TERMINATED, SigtermHandler, program, say
from psframe.errors import PortInUseError, PsframeError, TaskStopped
from psframe.serve.follower import CheckpointFollower
from psframe.serve.http_api import make_app
from psframe.serve.model import ModelFactory
from psframe.serve.versions import VersionHolder

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
"""How long the HTTP server may take to start listening."""
STOP_GRACE_S = 5.0
"""How long requests under way may take to finish once the process is asked to stop."""
_THREAD_JOIN_S = 10.0


class ServeProcess:
    """A checkpoint follower and the HTTP server answering from its versions.

    Args:
        checkpoint_dir: the folder or fsspec URL the chief saves to.
        models: makes each version's model (``--model``); None: lookups and parameters only.
        host: the address to listen on (loopback by default).
        port: the port; 0 lets the OS pick a free one (:attr:`url` tells which).
        poll_seconds: how often the directory is looked at.

    Raises:
        ValueError: ``port`` or ``poll_seconds`` out of range.

    Example::

        with ServeProcess("ckpt/") as served:
            print(served.url)             # http://127.0.0.1:PORT
    """

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        models: ModelFactory | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        poll_seconds: float = 1.0,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535 (0: the OS picks one), got {port!r}")
        if isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float)):
            raise ValueError(f"poll_seconds must be a number of seconds > 0, got {poll_seconds!r}")
        if not 0 < poll_seconds < math.inf:
            raise ValueError(f"poll_seconds must be a finite number of seconds > 0, got {poll_seconds!r}")
        self.host, self.port, self.poll_seconds = host, port, float(poll_seconds)
        self.holder = VersionHolder()
        self.follower = CheckpointFollower(checkpoint_dir, self.holder, models=models)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: uvicorn.Server | None = None

    @property
    def url(self) -> str:
        """Where it serves, ``http://HOST:PORT`` (the port the OS picked, once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind, start following and serving; return once the server listens.

        Raises:
            PortInUseError: the port is taken.
            PsframeError: ``host`` cannot be listened on, or the server did not start within
                :data:`START_TIMEOUT_S`.
        """
        sock = _bound_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            make_app(self.follower),
            log_config=None,  # the process's own logging, as the command set it up
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(STOP_GRACE_S),
        )
        self._server = uvicorn.Server(config)
        server = self._server
        follow = threading.Thread(
            target=self.follower.follow, args=(self._stop, self.poll_seconds), name="psframe-serve-follower"
        )
        # Off the main thread, uvicorn leaves signals alone: the command handles them (serve_until_stopped).
        http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="psframe-serve-http")
        self._threads = [follow, http]
        for thread in self._threads:
            thread.daemon = True  # a thread past its deadline never keeps the process alive
            thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not http.is_alive():
                raise PsframeError(f"the HTTP server on {self.url} stopped while starting (its error is logged above)")
            if time.monotonic() > deadline:
                self.stop()
                raise PsframeError(f"the HTTP server on {self.url} did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.01)

    def alive(self) -> bool:
        """Whether both threads still run."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def stop(self) -> None:
        """Stop serving (requests under way get :data:`STOP_GRACE_S`) and following; idempotent.
        Each thread is waited for at most a few seconds past that."""
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=_THREAD_JOIN_S + STOP_GRACE_S)
            if thread.is_alive():
                log.warning("psframe serve: %s did not stop within %.0fs; leaving it", thread.name, _THREAD_JOIN_S)

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def serve_until_stopped(process: ServeProcess, out: TextIO | None = None) -> NoReturn:
    """Start ``process``, print ``psframe serve: serving URL (following DIR)`` on ``out``, serve
    until SIGTERM or Ctrl-C, then stop it and end as a psframe task ends.

    Raises:
        TaskStopped: after SIGTERM, with exit code 143 (one line said so).
        KeyboardInterrupt: after Ctrl-C (``psframe.flags.run`` says so, exit code 130).
        PsframeError: the server could not start, or its thread ended on its own.
    """
    out = sys.stdout if out is None else out
    asked = threading.Event()
    handler = SigtermHandler(asked.set)
    handler.install()
    try:
        process.start()
        print(f"{program()}: serving {process.url} (following {process.follower.checkpoint_dir})", file=out, flush=True)
        while not asked.wait(0.5):
            if not process.alive():
                raise PsframeError(f"the server on {process.url} stopped on its own (its error is logged above)")
    finally:
        process.stop()
        handler.restore()
    version = process.holder.current()
    served = "no version served" if version is None else f"served version {version.number} (step {version.step})"
    say(f"{program()}: stopped by SIGTERM; {served}")
    raise TaskStopped(EXIT_TERMINATED)


def _bound_socket(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise PsframeError(f"cannot listen on host {host!r}: {e}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"port {port} on {host} is in use: give another --port, or 0 for a free one") from e
        raise PsframeError(f"cannot listen on {host}:{port}: {e}") from e
    sock.listen(1024)
    return sock


__all__ = ["DEFAULT_HOST", "START_TIMEOUT_S", "STOP_GRACE_S", "ServeProcess", "serve_until_stopped"]

"""Calls to a task: unary calls (blocking or in parallel) and long-lived streams, each with a deadline."""

from __future__ import annotations

import functools
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from psframe import errors
from psframe.config.liveness import Liveness
from psframe.config.security import Security
from psframe.errors import PsframeError
from psframe.wire.transport.auth import call_metadata, open_channel
from psframe.wire.transport.error_codec import error_from_rpc
from psframe.wire.transport.methods import METHODS


class _InterruptGuard:
    """Holds Ctrl-C off while the main thread runs gRPC's code, and raises it as that code returns.

    A ``KeyboardInterrupt`` raised inside gRPC's Python code can leave one of its
    locks held, and then every later call (the one that tells the ps tasks this
    worker stopped, too) and the channel's own threads hang. So the first call
    from the main thread installs a SIGINT handler (where SIGINT still has
    Python's own): outside gRPC's code it raises ``KeyboardInterrupt`` at once,
    as Python's would; inside, it notes the interrupt, runs ``cancel`` (on a
    thread of its own, as the watchdog's cancels do: it ends a wait that may be
    long, a stream's reply at a sync barrier) and the interrupt is raised as the
    code returns. Entering and leaving costs a counter, not a system call: the
    step path goes through here for every reply. A program whose SIGINT handler
    is its own at that first call keeps it (the guard then stays out of the way).
    """

    def __init__(self) -> None:
        self._depth = 0
        self._pending = False
        self._cancel: Callable[[], object] | None = None
        self._guarding: bool | None = None  # decided at the main thread's first call: None until then

    def __call__(self, cancel: Callable[[], object] | None = None) -> _InterruptGuard:
        if threading.get_ident() == _MAIN_THREAD:  # another thread's call is not the main thread's to cancel
            self._cancel = cancel
        return self

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        if self._guarding is None:  # once: reading and setting a handler costs microseconds
            self._guarding = signal.getsignal(signal.SIGINT) is signal.default_int_handler
            if self._guarding:
                signal.signal(signal.SIGINT, self._on_interrupt)
        if self._guarding:
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        if self._depth == 0 or threading.get_ident() != _MAIN_THREAD:
            return
        self._depth -= 1
        if self._depth == 0:
            self._cancel = None
            if self._pending:
                self._pending = False
                raise KeyboardInterrupt

    def _on_interrupt(self, signum: int, frame: object) -> None:
        if self._depth == 0:
            raise KeyboardInterrupt
        if not self._pending and self._cancel is not None:
            threading.Thread(target=self._cancel, name="psframe-interrupt", daemon=True).start()
        self._pending = True


_MAIN_THREAD = threading.main_thread().ident
_interrupt_after = _InterruptGuard()


class Connection:
    """Calls to one task, over one channel made on construction.

    Args:
        address: ``host:port`` of the task.
        peer: how errors name the task, e.g. ``"/job:ps/task:1 at h0:2223"``.
        security: the auth token every call carries, and TLS (default: none).
        liveness: how the channel probes its connection (default: :meth:`Liveness.resolve`).

    Raises:
        SecurityConfigError: a TLS file of ``security`` cannot be read.
    """

    def __init__(
        self, address: str, peer: str | None = None, security: Security | None = None, liveness: Liveness | None = None
    ) -> None:
        self.address = address
        self.peer = peer or address
        security = security or Security()
        self._channel = open_channel(address, security, liveness)
        self._metadata = call_metadata(security)
        self._callables: dict[str, Any] = {}

    def _callable(self, name: str) -> Any:
        found = self._callables.get(name)
        if found is None:
            method = METHODS[name]
            make = self._channel.stream_stream if method.streaming else self._channel.unary_unary
            found = self._callables[name] = make(method.path, **method.serializers("client"))
        return found

    def call(self, method: str, request: Any, *, timeout: float, wait_for_ready: bool = False) -> Any:
        """One unary call; its reply.

        Raises:
            PsframeError: the error the task raised, or a transport error naming it
                (:class:`TaskUnavailableError`, :class:`RpcTimeoutError` after ``timeout``).
        """
        try:
            with _interrupt_after():
                return self._callable(method)(
                    request, timeout=timeout, wait_for_ready=wait_for_ready, metadata=self._metadata
                )
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.peer, timeout) from e

    def open_stream(self, method: str, watchdog: Watchdog) -> Stream:
        """A long-lived two-way stream of ``method``; ``watchdog`` enforces each reply's deadline."""
        return Stream(self._callable(method), self.peer, watchdog, self._metadata)

    def close(self) -> None:
        with _interrupt_after():
            self._channel.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def call_all(
    calls: Sequence[tuple[Connection, str, Any]], timeout: float, *, wait_for_ready: bool = False
) -> list[Any]:
    """Make unary calls to several tasks in parallel; their replies, in order.

    Each is a blocking call: the first in the calling thread, the others in threads kept for
    them (:class:`_Helpers`). gRPC's own parallel calls (futures) start a thread of the
    channel's for every call on a channel with none in flight: on a busy process that costs
    more than the call. Every call is waited for (each has its deadline); then the first
    failure, if any, is raised.
    """
    outcomes = call_each(calls, timeout, wait_for_ready=wait_for_ready)
    failure = next((e for _, e in outcomes if e is not None), None)
    if failure is not None:
        raise failure
    return [reply for reply, _ in outcomes]


def call_each(
    calls: Sequence[tuple[Connection, str, Any]], timeout: float, *, wait_for_ready: bool = False
) -> list[tuple[Any, PsframeError | None]]:
    """:func:`call_all`, each call's outcome apart: ``(reply, None)`` or ``(None, error)``, in order."""
    if not calls:
        return []

    def call(connection: Connection, method: str, request: Any) -> Any:
        return connection.call(method, request, timeout=timeout, wait_for_ready=wait_for_ready)

    others = [_helpers.run(functools.partial(call, *c)) for c in calls[1:]]
    outcomes: list[tuple[Any, PsframeError | None]] = []
    try:
        outcomes.append((call(*calls[0]), None))
    except PsframeError as e:
        outcomes.append((None, e))
    # A helper's call ends by its deadline; the margin covers the thread's own hand-over.
    outcomes.extend(result.wait(timeout + _HELPER_MARGIN_S) for result in others)
    return outcomes


_HELPER_MARGIN_S = 5.0


class _Outcome:
    """A call a helper makes: its reply or its error, once made."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._reply: Any = None
        self._error: Exception | None = None

    def finish(self, reply: Any, error: Exception | None) -> None:
        self._reply, self._error = reply, error
        self._done.set()

    def wait(self, timeout: float) -> tuple[Any, PsframeError | None]:
        """``(reply, None)`` or ``(None, error)``; an :class:`RpcTimeoutError` if the helper never answered.

        Raises:
            Exception: the call raised one that is no :class:`PsframeError` (a bug): as the caller's own would.
        """
        if not self._done.wait(timeout):
            return None, errors.RpcTimeoutError(f"a parallel call did not end within {timeout:.1f}s")
        if self._error is not None and not isinstance(self._error, PsframeError):
            raise self._error
        return self._reply, self._error


class _Helpers:
    """Threads that make the calls of :func:`call_all` beside the caller's own, started as many
    as were ever needed at once, and kept: daemon threads, so an exit waits for no call in flight."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, call: Callable[[], Any]) -> _Outcome:
        outcome = _Outcome()
        with self._lock:
            if self._idle:
                self._idle -= 1
                start = False
            else:
                start = True
        self._work.put((call, outcome))
        if start:
            threading.Thread(target=self._serve, name="psframe-call", daemon=True).start()
        return outcome

    def _serve(self) -> None:
        while True:
            call, outcome = self._work.get()
            try:
                outcome.finish(call(), None)
            except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it
                outcome.finish(None, e)
            with self._lock:
                self._idle += 1


_helpers = _Helpers()


class Stream:
    """One long-lived two-way call: send a request, then receive its reply, in order.

    Replies are matched to requests by order; at most as many requests are
    in flight as the caller chooses. Each sent request arms a deadline in
    the :class:`Watchdog` (a stream has no per-message deadline of its own).
    """

    _CLOSE = object()

    def __init__(self, method: Any, peer: str, watchdog: Watchdog, metadata: Any = None) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        with _interrupt_after():
            self._call = method(iter(self._requests.get, self._CLOSE), metadata=metadata)
        self._peer = peer
        self._watchdog = watchdog
        self._timeout = 0.0
        self._expired = False

    def send(self, data: Any, timeout: float) -> None:
        """Queue a request; its reply must come within ``timeout`` seconds."""
        self._timeout = timeout
        self._watchdog.arm(self, time.monotonic() + timeout)
        self._requests.put(data)

    def receive(self) -> Any:
        """The reply to the oldest request not yet answered.

        Raises:
            RpcTimeoutError: the reply was overdue (the stream is then cancelled).
            PsframeError: the stream failed (the task went away, or a bug there).
        """
        try:
            with _interrupt_after(self._call.cancel):
                return next(self._call)
        except grpc.RpcError as e:
            if self._expired:
                raise errors.RpcTimeoutError(f"{self._peer} did not answer within {self._timeout}s") from e
            raise error_from_rpc(e, self._peer, self._timeout) from e
        except StopIteration:
            raise errors.RemoteError(f"{self._peer} ended the stream") from None
        finally:
            self._watchdog.disarm(self)

    def expire(self) -> None:
        self._expired = True
        self._call.cancel()

    def close(self) -> None:
        self._requests.put(self._CLOSE)
        with _interrupt_after():
            self._call.cancel()


class Watchdog:
    """Cancels a stream whose reply is overdue.

    One thread per owner, started on first use, checking a few times a second.
    """

    def __init__(self) -> None:
        self._deadlines: dict[Stream, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, stream: Stream, deadline: float) -> None:
        with self._lock:
            self._deadlines[stream] = deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="psframe-deadlines", daemon=True)
                self._thread.start()

    def disarm(self, stream: Stream) -> None:
        with self._lock:
            self._deadlines.pop(stream, None)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = time.monotonic()
            with self._lock:
                overdue = [s for s, deadline in self._deadlines.items() if deadline <= now]
                for stream in overdue:
                    del self._deadlines[stream]
            for stream in overdue:
                stream.expire()

    def stop(self) -> None:
        self._stop.set()

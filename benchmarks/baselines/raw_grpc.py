"""The ceiling: raw gRPC round trips with no psframe code at all.

A bytes-in, bytes-out echo server (generic handlers, no serializers, no
message size limit) runs in a child process; this process calls it

- **unary**: one call per round trip, and
- **stream**: one long-lived bidirectional stream on which request i is
  answered by response i (one request in flight at a time),

with requests and responses of the same size. Whatever psframe adds on top
of gRPC in Python (encode, decode, the store, the optimizer) can only make
it slower than this. :mod:`benchmarks.run` reports it as its first section,
and the transport section's ratios are against it.

    python -m benchmarks.baselines.raw_grpc [--quick]   # measure and print the table
    python -m benchmarks.baselines.raw_grpc --serve     # the server (started by the above)

:mod:`benchmarks.suite.scaling` runs the server and its clients as separate
processes, N clients at once (each one stream, one request in flight, as a
psframe worker's PushPull stream to one ps task)::

    python -m benchmarks.baselines.raw_grpc --serve --port=P --clients=N
    python -m benchmarks.baselines.raw_grpc --client=127.0.0.1:P --bytes=B --trips=T --warmup=W \\
        --barrier_dir=D --index=I --clients=N
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures

import grpc

from benchmarks.children import Children
from benchmarks.common import (
    BenchmarkError,
    Deadline,
    Settings,
    file_barrier,
    gb_per_second,
    measure_rate,
    timed_windows,
)
from benchmarks.formatting import format_bytes, format_number, format_percent, markdown_table

SERVICE = "bench.Echo"
# No limit on message size either way (gRPC's default receive limit is 4 MiB).
OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
READY_PATTERN = r"raw-grpc echo serving at (\S+)"
CALL_TIMEOUT_S = 60.0
# A client of a server that is not up yet retries at once, not after gRPC's
# default backoff (up to two minutes); clients and server start together.
CLIENT_OPTIONS = OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
)
# A server that counts its clients stays this long after the last stream
# ended, so that whoever samples its CPU time takes a sample after the
# clients' last round trip.
LINGER_S = 0.25
_END = object()  # ends the request stream


# ----------------------------------------------------------------------- server


def _echo_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _echo_stream(requests, context: grpc.ServicerContext):
    yield from requests


class _StreamCount:
    """Echo streams that ended, and the round trips they made; ``done`` is set
    once ``expected`` streams ended."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.ended = 0
        self.trips = 0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def echo_stream(self, requests, context: grpc.ServicerContext):
        trips = 0
        try:
            for request in requests:
                trips += 1
                yield request
        finally:  # half-closed, cancelled or failed: the stream is over either way
            with self._lock:
                self.ended += 1
                self.trips += trips
                if self.ended >= self.expected:
                    self.done.set()


def serve(host: str = "127.0.0.1", timeout: float = 3600.0, port: int = 0, clients: int | None = None) -> int:
    """Serve the echo service on ``host:port`` (port 0: chosen by the OS) for at most ``timeout`` s.

    Prints ``raw-grpc echo serving at HOST:PORT`` once it accepts calls. With
    ``clients``, it serves that many streams at once and returns as soon as
    that many streams ended, printing one JSON line (``streams``, ``trips``).

    Returns:
        0; 1 when ``clients`` streams did not end within ``timeout``.
    """
    count = _StreamCount(clients) if clients else None
    server = grpc.server(
        # A stream holds its thread for as long as it is open: one per client, and some to spare.
        futures.ThreadPoolExecutor(max_workers=max(8, (clients or 0) + 4), thread_name_prefix="echo"),
        handlers=(
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
                    "Stream": grpc.stream_stream_rpc_method_handler(count.echo_stream if count else _echo_stream),
                },
            ),
        ),
        options=OPTIONS + (("grpc.so_reuseport", 0),),
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        print(f"raw-grpc echo: cannot listen on {host}:{port}", file=sys.stderr)
        return 1
    port = bound
    server.start()
    loaded = [m for m in ("psframe", "torch") if m in sys.modules]
    print(
        f"raw-grpc echo serving at {host}:{port} (pid {os.getpid()}"
        f"{', loaded: ' + ', '.join(loaded) if loaded else ''})",
        flush=True,
    )
    if count is None:
        # The parent kills this process by PID; the timeout is a backstop only.
        server.wait_for_termination(timeout=timeout)
        server.stop(0)
        return 0
    if not count.done.wait(timeout):
        server.stop(0)
        print(
            f"raw-grpc echo: {count.ended} of {clients} client streams ended within {timeout:g}s",
            file=sys.stderr,
            flush=True,
        )
        return 1
    time.sleep(LINGER_S)
    server.stop(0)
    print(json.dumps({"task": "server", "streams": count.ended, "trips": count.trips}), flush=True)
    return 0


def start_server(children: Children, deadline: Deadline, name: str = "raw-echo") -> str:
    """Start the echo server as a child process; its ``host:port`` once it serves."""
    children.start(
        name,
        [
            sys.executable,
            "-m",
            "benchmarks.baselines.raw_grpc",
            "--serve",
            f"--timeout={deadline.remaining() + 60:.0f}",
        ],
    )
    return children.wait_for_output(name, READY_PATTERN, timeout=min(60.0, deadline.remaining())).group(1)


# ----------------------------------------------------------------------- client


class UnaryEcho:
    """One unary call per round trip."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._call = channel.unary_unary(f"/{SERVICE}/Unary")

    def __call__(self, payload: bytes) -> bytes:
        return self._call(payload, timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        pass


class StreamEcho:
    """One long-lived bidirectional stream; each call sends one request and
    waits for its response.

    Args:
        channel: the channel to the echo server.
        timeout: deadline of the whole stream, in seconds.
    """

    def __init__(self, channel: grpc.Channel, timeout: float) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        method = channel.stream_stream(f"/{SERVICE}/Stream")
        self._responses = method(iter(self._requests.get, _END), timeout=timeout)

    def __call__(self, payload: bytes) -> bytes:
        self._requests.put(payload)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(_END)  # half-close: the server's loop ends and the call completes
        self._responses.cancel()  # no-op once completed; never leaves the call open


def measure_echo(echo, nbytes: int, settings: Settings, deadline: Deadline, doing: str):
    """The round-trip rate of ``echo`` with ``nbytes`` each way (checks the echo's size)."""
    payload = os.urandom(nbytes)

    def round_trip() -> None:
        reply = echo(payload)
        if len(reply) != nbytes:
            raise BenchmarkError(f"{doing}: sent {nbytes} bytes, got {len(reply)} back")

    return measure_rate(round_trip, settings, deadline, doing)


def run_client(
    target: str,
    nbytes: int,
    trips: int,
    warmup: int,
    *,
    seconds: float = 0.0,
    barrier_dir: str | None = None,
    index: int = 0,
    clients: int = 1,
    timeout: float = 300.0,
) -> dict:
    """Round trips of ``nbytes`` each way on one long-lived stream to the echo server at ``target``.

    Connects, waits at the file barrier in ``barrier_dir`` for all ``clients``
    (so that they start together), makes ``warmup`` round trips, then times
    at least ``trips`` more and for at least ``seconds``.

    Returns:
        :func:`benchmarks.common.timed_windows` of the timed round trips
        (``steps_per_sec``: this client's round trips/s; ``window``), plus
        ``trip_times``: ``time.perf_counter()`` after each timed round trip,
        for counting the trips of several clients in a common window.

    Raises:
        BenchmarkError: a reply of the wrong size. grpc.FutureTimeoutError,
            TimeoutError, grpc.RpcError: the server was not reached, the
            others did not come, or the stream failed, within ``timeout``.
    """
    end = time.monotonic() + timeout
    payload = os.urandom(nbytes)
    with grpc.insecure_channel(target, options=CLIENT_OPTIONS) as channel:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        echo = StreamEcho(channel, max(1.0, end - time.monotonic()))
        try:
            if barrier_dir:
                file_barrier(barrier_dir, f"client{index}", clients, max(1.0, end - time.monotonic()))
            times: list[float] = []
            started = None
            while len(times) < warmup + 1 + trips or started is None or time.perf_counter() - started < seconds:
                if len(echo(payload)) != nbytes:
                    raise BenchmarkError(f"client {index}: sent {nbytes} bytes, got another size back")
                times.append(time.perf_counter())
                if len(times) == warmup + 1:  # the first timed record: the timed window opens here
                    started = times[-1]
        finally:
            echo.close()
    timed = timed_windows(times, range(1, len(times) + 1), warmup + 1)
    return {
        "task": f"client{index}",
        "payload_bytes": nbytes,
        **timed,
        "trip_times": [round(t, 6) for t in times[warmup:]],
    }


def run_raw_benchmarks(settings: Settings, timeout: float = 900.0) -> list[dict]:
    """Measure unary and streaming echo round trips at every size of ``settings``.

    Returns:
        One row per (mode, payload): ``system`` ("raw gRPC"), ``mode``
        ("unary"/"stream"), ``payload_bytes``, ``round_trips_per_sec``,
        ``gb_per_sec_each_way``, ``spread`` (relative range of the repeats),
        ``calls_per_repeat``, ``repeats``.
    """
    deadline = Deadline(timeout, "raw gRPC benchmark")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-raw-") as logs, Children(logs) as children:
        address = start_server(children, deadline)
        with grpc.insecure_channel(address, options=OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=min(30.0, deadline.remaining()))
            for mode in ("unary", "stream"):
                echo = UnaryEcho(channel) if mode == "unary" else StreamEcho(channel, deadline.remaining())
                try:
                    for nbytes in settings.sizes:
                        rate = measure_echo(echo, nbytes, settings, deadline, f"raw {mode} {nbytes} B")
                        rows.append(
                            {
                                "system": "raw gRPC",
                                "mode": mode,
                                "payload_bytes": nbytes,
                                "round_trips_per_sec": rate.per_second,
                                "gb_per_sec_each_way": gb_per_second(nbytes, rate.per_second),
                                "spread": rate.spread,
                                "calls_per_repeat": rate.calls_per_repeat,
                                "repeats": len(rate.samples),
                            }
                        )
                finally:
                    echo.close()
    return rows


def raw_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_raw_benchmarks` rows."""
    return markdown_table(
        ["system", "mode", "payload", "round trips/s", "GB/s each way", "spread"],
        [
            [
                r["system"],
                r["mode"],
                format_bytes(r["payload_bytes"]),
                format_number(r["round_trips_per_sec"]),
                format_number(r["gb_per_sec_each_way"]),
                format_percent(r["spread"]),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the echo server (a child process)")
    parser.add_argument(
        "--client",
        default=None,
        metavar="HOST:PORT",
        help="be one echo client of a running server; print one JSON line",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="--serve: the port (0: chosen by the OS)")
    parser.add_argument(
        "--clients",
        type=int,
        default=None,
        help="--serve: exit once this many streams ended; --client: clients at the barrier",
    )
    parser.add_argument("--bytes", type=int, default=4096, help="--client: payload each way")
    parser.add_argument("--trips", type=int, default=1000, help="--client: timed round trips at least")
    parser.add_argument("--seconds", type=float, default=0.0, help="--client: timed seconds at least")
    parser.add_argument("--warmup", type=int, default=100, help="--client: untimed round trips first")
    parser.add_argument("--barrier_dir", default=None, help="--client: meet the other clients here first")
    parser.add_argument("--index", type=int, default=0, help="--client: this client's number")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to serve or measure at most")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.host, args.timeout, args.port, args.clients)
    if args.client:
        result = run_client(
            args.client,
            args.bytes,
            args.trips,
            args.warmup,
            seconds=args.seconds,
            barrier_dir=args.barrier_dir,
            index=args.index,
            clients=args.clients or 1,
            timeout=args.timeout,
        )
        print(json.dumps(result), flush=True)
        return 0
    print(raw_table(run_raw_benchmarks(Settings.for_mode(args.quick), args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ceiling: raw gRPC round trips with no psframe code at all.

A bytes-in, bytes-out echo server (generic handlers, no serializers, no
message size limit) runs in a child process; this process calls it

- **unary**: one call per round trip, and
- **stream**: one long-lived bidirectional stream on which request i is
  answered by response i (one request in flight at a time),

with requests and responses of the same size. Whatever psframe adds on top
of gRPC in Python (encode, decode, the store, the optimizer) can only make
it slower than this.

    python -m benchmarks.raw_grpc [--quick]      # measure and print the table
    python -m benchmarks.raw_grpc --serve        # the server (started by the above)
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
from concurrent import futures

import grpc

from benchmarks.common import (
    BenchmarkError,
    Children,
    Deadline,
    Settings,
    gb_per_second,
    measure_rate,
)

SERVICE = "bench.Echo"
# No limit on message size either way (gRPC's default receive limit is 4 MiB).
OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
)
READY_PATTERN = r"raw-grpc echo serving at (\S+)"
CALL_TIMEOUT_S = 60.0
_END = object()  # ends the request stream


# ----------------------------------------------------------------------- server


def _echo_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _echo_stream(requests, context: grpc.ServicerContext):
    for request in requests:
        yield request


def serve(host: str = "127.0.0.1", timeout: float = 3600.0) -> int:
    """Serve the echo service on an OS-chosen port of ``host`` for at most ``timeout`` s.

    Prints ``raw-grpc echo serving at HOST:PORT`` once it accepts calls.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="echo"),
        handlers=(grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
            "Stream": grpc.stream_stream_rpc_method_handler(_echo_stream),
        }),),
        options=OPTIONS + (("grpc.so_reuseport", 0),),
    )
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    loaded = [m for m in ("psframe", "torch") if m in sys.modules]
    print(f"raw-grpc echo serving at {host}:{port} (pid {os.getpid()}"
          f"{', loaded: ' + ', '.join(loaded) if loaded else ''})", flush=True)
    # The parent kills this process by PID; the timeout is a backstop only.
    server.wait_for_termination(timeout=timeout)
    server.stop(0)
    return 0


def start_server(children: Children, deadline: Deadline, name: str = "raw-echo") -> str:
    """Start the echo server as a child process; its ``host:port`` once it serves."""
    children.start(name, [sys.executable, "-m", "benchmarks.raw_grpc", "--serve",
                          f"--timeout={deadline.remaining() + 60:.0f}"])
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
                        rows.append({
                            "system": "raw gRPC",
                            "mode": mode,
                            "payload_bytes": nbytes,
                            "round_trips_per_sec": rate.per_second,
                            "gb_per_sec_each_way": gb_per_second(nbytes, rate.per_second),
                            "spread": rate.spread,
                            "calls_per_repeat": rate.calls_per_repeat,
                            "repeats": len(rate.samples),
                        })
                finally:
                    echo.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="run the echo server (a child process)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to serve or measure at most")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args.host, args.timeout)
    from benchmarks import report

    print(report.raw_table(run_raw_benchmarks(Settings.for_mode(args.quick), args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes copied per byte sent on the gRPC path: a raw gRPC echo (the floor), and psframe's own share.

    python -m benchmarks.suite.copies [--mib 64]

Copies are counted as the Python heap sees them (``tracemalloc``): every
``bytes`` or ``bytearray`` made of a message's bytes is allocated there,
and its peak, divided by the message's length, is the copies held at once.
gRPC's C core allocates outside that heap: its copies are named from its
source and shown by elimination (a raw echo of ``bytes``, where the
application copies nothing, against psframe's encoding and decoding of the
same bytes as tensors).

Rows:

- ``grpc receive``: what a received message costs the receiving process
  (its own process, the sender in another): gRPC's Python layer makes a
  ``bytes`` of each slice and joins them, so the peak is two copies and one
  is kept;
- ``grpc send``: what sending costs the sender's Python heap: nothing (the
  core copies the ``bytes`` into a slice of its own, outside the heap);
- ``psframe encode`` and ``decode``: a gradient of the given size as
  psframe's encoding makes it into the message and reads it back as a tensor
  (a view: no copy), through :func:`benchmarks.suite.psframe_internals.gradient_message`.

:mod:`benchmarks.suite.transport` prints this table below its own, for its largest payload.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tracemalloc
from concurrent import futures

import grpc
import torch

from benchmarks.suite.psframe_internals import gradient_message

_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _serve(length: int, port_out, stop) -> None:
    """A server in its own process: a short request is answered with ``length`` zero bytes, a long
    one with two bytes (so that receiving and sending are measured apart)."""
    reply = bytes(length)

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        return reply if len(request) < 16 else b"ok"

    server = grpc.server(futures.ThreadPoolExecutor(2), options=_OPTIONS)
    handler = grpc.method_handlers_generic_handler("copies.Echo", {"Call": grpc.unary_unary_rpc_method_handler(answer)})
    server.add_generic_rpc_handlers((handler,))
    port_out.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait(300)
    server.stop(0)


def peak_per_byte(action, length: int) -> tuple[float, float]:
    """The Python heap's peak and kept growth over ``action()``, per byte of ``length``."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        kept = action()
        now, peak = tracemalloc.get_traced_memory()
        del kept
    finally:
        tracemalloc.stop()
    return (peak - before) / length, (now - before) / length


def psframe_rows(length: int) -> list[tuple[str, float, float]]:
    """psframe's own copies of a float32 gradient of ``length`` bytes: made into a message, and read
    back from one (``(row, peak, kept)`` per byte)."""
    encode, decode = gradient_message(torch.zeros(length // 4))
    message = encode()
    return [
        ("psframe encode", *peak_per_byte(encode, length)),
        ("psframe decode", *peak_per_byte(lambda: decode(message), length)),
    ]


def measure(length: int) -> list[tuple[str, float, float]]:
    """Every row of the module's table for a message of ``length`` bytes: ``(row, peak, kept)`` per byte
    (a gRPC server in a child process for the gRPC rows)."""
    context = multiprocessing.get_context("spawn")
    ports, stop = context.Queue(), context.Event()
    server = context.Process(target=_serve, args=(length, ports, stop), daemon=True)
    server.start()
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=60)}", options=_OPTIONS)
        call = channel.unary_unary("/copies.Echo/Call")
        request = b"x"
        call(request, timeout=60)  # connected, warm
        rows = [("grpc receive", *peak_per_byte(lambda: call(request, timeout=60), length))]
        big = bytes(length)
        rows.append(("grpc send", *peak_per_byte(lambda: call(big, timeout=60) and None, length)))
        channel.close()
    finally:
        stop.set()
        server.join(10)
    return rows + psframe_rows(length)


def copies_table(rows: list[tuple[str, float, float]], length: int) -> str:
    """The rows of :func:`measure` as the text the module prints."""
    lines = [f"copies of a {length / 2**20:g} MiB message, in the Python heap (bytes allocated per byte)"]
    lines.append(f"{'':16} {'peak':>6} {'kept':>6}")
    lines += [f"{name:16} {peak:6.2f} {kept:6.2f}" for name, peak, kept in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="the message's size in MiB")
    length = parser.parse_args().mib << 20
    print(copies_table(measure(length), length))


if __name__ == "__main__":
    main()

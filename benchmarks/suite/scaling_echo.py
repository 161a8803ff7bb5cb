"""The scaling section's raw gRPC echo: its server and clients run as processes, their round trips counted.

:func:`run_echo_processes` runs the echo server of :mod:`benchmarks.baselines.raw_grpc`
and N clients, each one stream with one request in flight, and returns a row
in the shape of the scaling section's (:class:`benchmarks.suite.scaling.System`):
round trips/s of all clients together, and the server's CPU over the trips
that ended in the window every client was timing (:func:`common_window`,
:func:`trips_in_window`).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks.suite.processes import cpu_in_window, run_processes
from psframe.launch import pick_free_ports


def run_echo_processes(clients: int, payload: int, trips: int, warmup: int, seconds: float, deadline: float) -> dict:
    """The echo server (child ``server``) and ``clients`` clients (``client0``...) echoing ``payload``
    bytes: each times at least ``trips`` round trips and ``seconds`` after ``warmup`` trips."""
    (port,) = pick_free_ports(1, "127.0.0.1")
    timeout = max(10.0, deadline - time.monotonic())
    with tempfile.TemporaryDirectory(prefix="psframe-barrier-") as barrier:
        tasks = [
            (
                "server",
                [
                    sys.executable,
                    "-m",
                    "benchmarks.baselines.raw_grpc",
                    "--serve",
                    f"--port={port}",
                    f"--clients={clients}",
                    f"--timeout={timeout:.0f}",
                ],
            )
        ]
        tasks += [
            (
                f"client{i}",
                [
                    sys.executable,
                    "-m",
                    "benchmarks.baselines.raw_grpc",
                    f"--client=127.0.0.1:{port}",
                    f"--bytes={payload}",
                    f"--trips={trips}",
                    f"--warmup={warmup}",
                    f"--seconds={seconds}",
                    f"--barrier_dir={barrier}",
                    f"--index={i}",
                    f"--clients={clients}",
                    f"--timeout={timeout:.0f}",
                ],
            )
            for i in range(clients)
        ]
        results = run_processes(tasks, deadline)
    answers = [results[f"client{i}"] for i in range(clients)]
    window = common_window([c["window"] for c in answers])
    timed_trips = sum(trips_in_window(c["trip_times"], window) for c in answers) if window else 0
    cpu = cpu_in_window(results["server"]["cpu_trace"], window) if window else None
    return {
        # Every client waits for its own reply only: their rates add up.
        "global_steps_per_sec": sum(c["steps_per_sec"] for c in answers),
        "per_worker_steps_per_sec": [c["steps_per_sec"] for c in answers],
        "steps": timed_trips,
        "seconds": window[1] - window[0] if window else math.nan,
        "window_rates": answers[0]["window_rates"],
        "requests_per_step": 1,
        "request_bytes": payload,
        "requests": timed_trips,
        "server_cpu_seconds": cpu if timed_trips else None,
        "processes": 1 + clients,
    }


def common_window(windows: Sequence[Sequence[float]]) -> list[float] | None:
    """The time every one of ``windows`` (``[start, end]``) covers; None if they do not overlap."""
    start, end = max(w[0] for w in windows), min(w[1] for w in windows)
    return [start, end] if end > start else None


def trips_in_window(times: Sequence[float], window: Sequence[float]) -> int:
    """Round trips that ended inside ``window``, after its start."""
    return sum(1 for t in times if window[0] < t <= window[1])

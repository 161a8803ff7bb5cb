"""What the auth token and TLS cost per step: push+pull round trips with each setting.

The transport benchmark's step (:mod:`benchmarks.suite.transport`: the trainer's
planned requests through ``PsClient.push_pull``, SGD with lr 0 on the ps,
the same tensors back), one float32 tensor on one ps task (``psframe
server --serving_processes=1``, started with the security flags; the worker
is this process, every byte through gRPC), once per setting:

- **none**: no token, plaintext;
- **token**: ``--auth_token_file`` (plaintext: the token travels in clear);
- **TLS + token**: the ps task has a certificate; the worker checks it against the CA;
- **mutual TLS + token**: both have certificates, and each checks the other's.

The certificates are made for this run (``trustme``) and deleted after it.
All the settings' ps tasks run at once (idle but for the one timed), and
the repeats are interleaved (each setting once, then each again...), so
that load coming and going on the machine weighs on every setting alike;
a row is the median of its repeats. Besides the wall time, each row gives the CPU time
the worker and the ps process spent per step, which other work on the
machine disturbs less. A row's *µs/step over
none* is its step time minus the step time without security at that payload.

    python -m benchmarks.suite.security [--quick]
"""

from __future__ import annotations

import functools
import math
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
import torch

from benchmarks.children import Children
from benchmarks.common import BenchmarkError, Deadline, Settings, single_thread, table_main
from benchmarks.formatting import (
    format_bytes,
    format_number,
    format_percent,
    format_ratio,
    format_signed,
    markdown_table,
)
from benchmarks.suite.ps_cluster import PsCluster, finish_clusters, in_parallel
from benchmarks.suite.psframe_internals import push_pull
from benchmarks.suite.transport import Case, prepare_case
from psframe import Security
from psframe.launch import pick_free_ports

SETTINGS = ("none", "token", "TLS + token", "mutual TLS + token")
# ps processes started at once (idle but for the one timed): payload sizes are
# grouped so that each group's settings fit.
MAX_PROCESSES_AT_ONCE = 12


def write_secrets(folder: Path) -> dict[str, str]:
    """A token file, a throwaway CA and a certificate it signed for loopback, in ``folder``.

    Returns:
        The paths: ``token``, ``ca``, ``cert``, ``key``.
    """
    import trustme  # the bench and test extras install it

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(folder / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    leaf.cert_chain_pems[0].write_to_path(paths["cert"])
    leaf.private_key_pem.write_to_path(paths["key"])
    paths["token"] = str(folder / "token")
    with open(paths["token"], "w") as f:
        f.write(secrets.token_urlsafe(32))  # 256 random bits, as `psframe launch` makes a token
    for path in paths.values():
        Path(path).chmod(0o600)
    return paths


def setting(name: str, paths: dict[str, str]) -> tuple[list[str], Security]:
    """The ps task's flags and the worker's :class:`Security` for one of :data:`SETTINGS`."""
    if name == "none":
        return [], Security()
    token = Path(paths["token"]).read_text().strip()  # what `--auth_token_file` gives the ps task
    flags = [f"--auth_token_file={paths['token']}"]
    if name == "token":
        return flags, Security(auth_token=token)
    flags += [f"--tls_cert_file={paths['cert']}", f"--tls_key_file={paths['key']}"]
    if name == "TLS + token":
        return flags, Security(auth_token=token, tls_ca_file=paths["ca"])
    return flags + [f"--tls_ca_file={paths['ca']}"], Security(
        auth_token=token, tls_cert_file=paths["cert"], tls_key_file=paths["key"], tls_ca_file=paths["ca"]
    )


def run_security_benchmarks(settings: Settings, timeout: float = 1200.0, names: Sequence[str] = SETTINGS) -> list[dict]:
    """Time one worker step at every payload size of ``settings``, with each security setting.

    Returns:
        One row per payload and setting: ``security``, ``payload_bytes``,
        ``round_trips_per_sec``, ``us_per_step``, ``cpu_us_per_step`` (worker
        and ps together), ``us_over_none``, ``cpu_us_over_none`` and
        ``vs_none`` (against the row without security; None where there is
        no such row), ``spread``, ``repeats``, ``calls_per_repeat``.
    """
    single_thread()
    torch.set_num_threads(1)
    deadline = Deadline(timeout, "security benchmark")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="psframe-bench-security-") as folder:
        paths = write_secrets(Path(folder))
        per_group = max(1, MAX_PROCESSES_AT_ONCE // len(names))
        for first in range(0, len(settings.sizes), per_group):
            cases = [Case(1, "one", nbytes) for nbytes in settings.sizes[first : first + per_group]]
            with Children(Path(folder) / "logs") as children:
                ports = iter(pick_free_ports(2 * len(names) * len(cases)))  # all distinct
                clusters = {}
                for case in cases:
                    for name in names:
                        flags, security = setting(name, paths)
                        clusters[case, name] = PsCluster(
                            children,
                            1,
                            f"{name.replace(' ', '')}-{case.payload_bytes}",
                            deadline.remaining() + 60,
                            [next(ports), next(ports)],
                            ["--serving_processes=1", *flags],
                            security,
                        )
                for cluster in clusters.values():  # all up (done importing torch) before anything is timed
                    cluster.connect(deadline)
                requests = dict(
                    zip(
                        clusters,
                        in_parallel(
                            [functools.partial(prepare_case, cluster, case) for (case, _), cluster in clusters.items()],
                            deadline,
                        ),
                    )
                )
                for case in cases:
                    rows += measure_interleaved(case, names, clusters, requests, settings, deadline)
                finish_clusters(list(clusters.values()))
    return add_costs(rows)


def measure_interleaved(
    case: Case, names: Sequence[str], clusters: dict, requests: dict, settings: Settings, deadline: Deadline
) -> list[dict]:
    """Time ``case`` with every setting, the repeats interleaved (every setting once, then
    again...), so that load coming and going on the machine weighs on all alike. Besides the
    wall time, the CPU time of the worker (this process) and of the ps process per step:
    what the settings cost whatever else the machine runs."""
    steps = {name: functools.partial(push_pull, clusters[case, name].client, requests[case, name]) for name in names}
    calls = {name: _calls_per_repeat(steps[name], settings, deadline) for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(settings.repeats):
        for name in names:
            deadline.check(f"timing {name} at {case.payload_bytes} bytes")
            ps = psutil.Process(clusters[case, name].procs[0].pid)
            cpu, start = _cpu_seconds(ps), time.perf_counter()
            for _ in range(calls[name]):
                steps[name]()
            walls[name].append((time.perf_counter() - start) / calls[name])
            cpus[name].append((_cpu_seconds(ps) - cpu) / calls[name])
    rows = []
    for name in names:
        pulled = steps[name]()
        if not all(torch.isfinite(t).all() for batch in pulled for t in batch):
            raise BenchmarkError(f"{name} at {case.payload_bytes} bytes: the ps returned non-finite values")
        wall = statistics.median(walls[name])
        rows.append(
            {
                "security": name,
                "payload_bytes": case.payload_bytes,
                "round_trips_per_sec": 1 / wall,
                "us_per_step": 1e6 * wall,
                "cpu_us_per_step": 1e6 * statistics.median(cpus[name]),
                "spread": (max(walls[name]) - min(walls[name])) / wall,
                "repeats": len(walls[name]),
                "calls_per_repeat": calls[name],
            }
        )
    return rows


def _calls_per_repeat(step, settings: Settings, deadline: Deadline) -> int:
    """Warm ``step`` up; how many calls make a repeat of about ``settings.target_seconds``."""
    durations: list[float] = []
    start = time.perf_counter()
    while len(durations) < settings.warmup_calls or time.perf_counter() - start < settings.warmup_seconds:
        deadline.check("warming up")
        t = time.perf_counter()
        step()
        durations.append(time.perf_counter() - t)
    per_call = statistics.median(durations[len(durations) // 2 :]) or 1e-6
    return int(min(settings.max_calls, max(settings.min_calls, math.ceil(settings.target_seconds / per_call))))


def _cpu_seconds(ps: psutil.Process) -> float:
    """CPU time (user + system, all threads) of this process and of ``ps`` so far."""
    times = ps.cpu_times()
    return time.process_time() + times.user + times.system


def add_costs(rows: list[dict]) -> list[dict]:
    """Add ``us_over_none``, ``cpu_us_over_none`` and ``vs_none`` (round trips/s over):
    each row against the row without security at its payload (None where there is none)."""
    none = {r["payload_bytes"]: r for r in rows if r["security"] == "none"}
    for row in rows:
        base = none.get(row["payload_bytes"])
        row["us_over_none"] = None if base is None else row["us_per_step"] - base["us_per_step"]
        row["cpu_us_over_none"] = (
            None if base is None or "cpu_us_per_step" not in row else row["cpu_us_per_step"] - base["cpu_us_per_step"]
        )
        row["vs_none"] = None if base is None else row["round_trips_per_sec"] / base["round_trips_per_sec"]
    return rows


def security_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_security_benchmarks` rows."""
    return markdown_table(
        [
            "payload",
            "security",
            "round trips/s",
            "µs/step",
            "µs/step over none",
            "CPU µs/step",
            "CPU µs/step over none",
            "vs none",
            "spread",
        ],
        [
            [
                format_bytes(r["payload_bytes"]),
                r["security"],
                format_number(r["round_trips_per_sec"]),
                format_number(r["us_per_step"]),
                format_signed(r.get("us_over_none")),
                format_number(r.get("cpu_us_per_step")),
                format_signed(r.get("cpu_us_over_none")),
                format_ratio(r.get("vs_none")),
                format_percent(r["spread"]),
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    return table_main(
        argv,
        __doc__,
        "small sizes, few repeats",
        lambda quick: security_table(run_security_benchmarks(Settings.for_mode(quick))),
    )


if __name__ == "__main__":
    sys.exit(main())

"""The scaling benchmark's table: each row's ratios to torch_rpc_ps and to the raw echo, as markdown.

Reads the rows :func:`benchmarks.suite.scaling.run_scaling_benchmarks` makes,
comparing rows of the same model and worker count only: :func:`add_ratios`
adds the ratios, :func:`scaling_table` prints the rows with them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks.common import ratio
from benchmarks.formatting import format_bytes, format_number, format_ratio, markdown_table

BASELINE = "torch_rpc_ps"  # throughput is compared with this system's
CEILING = "raw_echo"  # CPU per request is compared with this system's


def add_ratios(rows: Sequence[dict]) -> list[dict]:
    """Each row with ``vs_torch_rpc_ps`` and ``cpu_vs_raw_echo`` (None where not comparable).

    ``vs_torch_rpc_ps``: global steps/s over torch_rpc_ps's at the same model
    and workers (rows of other training systems only).

    ``cpu_vs_raw_echo``: the server CPU per request over the echo server's
    CPU per round trip at the same model and workers, both per byte of their
    requests: where the mean request has the echo's payload (psframe with 1
    ps task; torch_rpc_ps on the MNIST MLP) this is the CPU per request over
    the CPU per round trip; where it differs (2 ps tasks share a step's bytes;
    torch_rpc_ps sends the large MLP in one request of 80 MB) the echo's CPU
    per trip is scaled to the request's bytes. Rows other than the echo's.
    """

    def key(row: dict) -> tuple[str, int]:
        return row["model"], row["workers"]

    baseline = {key(r): r for r in rows if r["system"] == BASELINE}
    ceiling = {key(r): r for r in rows if r["system"] == CEILING}
    out = []
    for row in rows:
        base, echo = baseline.get(key(row), {}), ceiling.get(key(row), {})
        out.append(
            {
                **row,
                "vs_torch_rpc_ps": None
                if row["system"] in (BASELINE, CEILING)
                else ratio(row.get("global_steps_per_sec"), base.get("global_steps_per_sec")),
                "cpu_vs_raw_echo": None if row["system"] == CEILING else ratio(_per_byte(row), _per_byte(echo)),
            }
        )
    return out


def _per_byte(row: dict) -> float | None:
    return ratio(row.get("server_cpu_ms_per_request"), row.get("request_bytes"))


def scaling_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_scaling_benchmarks` rows, with ratios."""
    rows = add_ratios(rows)
    notes = any("error" in r or "unavailable" in r for r in rows)
    last = "error" if any("error" in r for r in rows) else "note"
    return markdown_table(
        [
            "model",
            "system",
            "ps tasks",
            "workers",
            "global steps/s (echo: trips/s)",
            "vs torch_rpc_ps",
            "per-worker steps/s: median (min-max)",
            "requests/step",
            "request size",
            "server CPU ms/request",
            "CPU/request vs raw_echo",
            "other load",
            *([last] if notes else []),
        ],
        [
            [
                r["model"],
                r["system"],
                r["ps_tasks"],
                r["workers"],
                format_number(r["global_steps_per_sec"]),
                format_ratio(r.get("vs_torch_rpc_ps")),
                _spread_of(r.get("per_worker_steps_per_sec", ())),
                r.get("requests_per_step", "-"),
                format_bytes(r["request_bytes"]) if r.get("request_bytes") else "-",
                format_number(r.get("server_cpu_ms_per_request")),
                format_ratio(r.get("cpu_vs_raw_echo")),
                "-" if r.get("other_cpu_load") is None else f"{r['other_cpu_load']:.2f}",
                *([r.get("error") or _unavailable(r)] if notes else []),
            ]
            for r in rows
        ],
    )


def _unavailable(row: dict) -> str:
    return f"unavailable: {row['unavailable']}" if "unavailable" in row else ""


def _spread_of(values: Sequence[float]) -> str:
    """``median (min-max)`` of the workers' rates; the one rate of a single worker."""
    values = [v for v in values if v == v]  # NaN: a worker with too few timed steps
    if not values:
        return "-"
    if len(values) == 1:
        return format_number(values[0])
    return f"{format_number(statistics.median(values))} ({format_number(min(values))}-{format_number(max(values))})"

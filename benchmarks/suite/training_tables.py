"""The training benchmark's tables: each row's ratios against the baselines of the same run, as markdown and text.

Split from :mod:`benchmarks.suite.training` (which runs the systems): this
module only reads its rows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from benchmarks.common import ratio
from benchmarks.formatting import format_number, format_ratio, markdown_table


def training_ratios(rows: Sequence[dict]) -> list[dict]:
    """Each training row with ``vs_torch_rpc_ps`` (its samples/s over torch_rpc_ps's,
    same model and mode), ``vs_ddp_gloo`` (over ddp_gloo's, same model),
    ``cpu_vs_torch_rpc_ps`` (CPU time per sample over torch_rpc_ps's, same model
    and mode: below 1 is less work) and ``vs_tf_ps`` (samples/s over TensorFlow's
    parameter server's, same model and mode: async only); None where there is no
    such row or number.
    Computed from the rows of one run only.

    Where the rows hold every repeat's rate (``run_rates``), a throughput ratio
    is the median of the ratios between the runs of the same repeat, which ran
    close together in time (see :func:`paired_ratio`).
    """
    by_rpc = {(r["model"], r["mode"]): r for r in rows if r["system"] == "torch_rpc_ps"}
    by_ddp = {r["model"]: r for r in rows if r["system"] == "ddp_gloo"}
    by_tf = {(r["model"], r["mode"]): r for r in rows if r["system"] == "tf_ps"}
    out = []
    for row in rows:
        rpc = by_rpc.get((row["model"], row["mode"]), {})
        out.append(
            {
                **row,
                "vs_torch_rpc_ps": paired_ratio(row, rpc),
                "vs_ddp_gloo": paired_ratio(row, by_ddp.get(row["model"], {})),
                "cpu_vs_torch_rpc_ps": ratio(_cpu_per_sample(row), _cpu_per_sample(rpc)),
                "vs_tf_ps": paired_ratio(row, by_tf.get((row["model"], row["mode"]), {})),
            }
        )
    return out


def paired_ratio(row: dict, base: dict) -> float | None:
    """``row``'s samples/s over ``base``'s, repeat by repeat.

    The systems run interleaved, so the i-th runs of two systems lie close
    together in time: their ratio is little moved by load on the machine that
    comes and goes over minutes, which moves the medians of the two rows
    independently. Returns the median of those ratios over the repeats both
    completed; the ratio of the rows' samples/s where repeats are not known.
    """
    per_step, base_per_step = _samples_per_step(row), _samples_per_step(base)
    runs, base_runs = row.get("run_rates", ()), base.get("run_rates", ())
    if per_step is None or base_per_step is None or len(runs) != len(base_runs) or len(runs) < 2:
        return ratio(row.get("samples_per_sec"), base.get("samples_per_sec"))
    ratios = [r for r in (ratio(a * per_step, b * base_per_step) for a, b in zip(runs, base_runs)) if r is not None]
    return statistics.median(ratios) if ratios else None


def _samples_per_step(row: dict) -> float | None:
    """Examples one global step of the row's system consumes (100 async, 200 sync and DDP)."""
    return ratio(row.get("samples_per_sec"), row.get("global_steps_per_sec"))


def _cpu_per_sample(row: dict) -> float | None:
    return ratio(row.get("cpu_ms_per_step"), _samples_per_step(row))


def training_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_training_benchmarks` rows, with ratios."""
    rows = training_ratios(rows)
    extra = [k for k in ("note", "unavailable", "error") if any(k in r for r in rows)]
    runs = any(len(r.get("run_rates", ())) > 1 for r in rows)
    return markdown_table(
        [
            "system",
            "model",
            "mode",
            "global steps/s",
            "samples/s",
            "steps",
            "seconds",
            "samples/s vs torch_rpc_ps",
            "samples/s vs ddp_gloo",
            "CPU ms/step",
            "CPU/sample vs torch_rpc_ps",
            "samples/s vs tf_ps",
            *(["every run (global steps/s)"] if runs else []),
            *extra,
        ],
        [
            [
                r["system"],
                r["model"],
                r["mode"],
                format_number(r["global_steps_per_sec"]),
                format_number(r["samples_per_sec"]),
                r["steps"],
                format_number(r["seconds"]),
                format_ratio(r["vs_torch_rpc_ps"]),
                format_ratio(r["vs_ddp_gloo"]),
                format_number(r.get("cpu_ms_per_step")),
                format_ratio(r["cpu_vs_torch_rpc_ps"]),
                format_ratio(r["vs_tf_ps"]),
                *([" / ".join(format_number(v) for v in r.get("run_rates", ()))] if runs else []),
                *(str(r.get(k, "")) for k in extra),
            ]
            for r in rows
        ],
    )


def training_summary(rows: Sequence[dict]) -> str:
    """The line the TF baseline is there for: psframe async against tf_ps on the large
    MLP (samples/s, repeat by repeat); empty where either row is missing or not measured."""
    ratios = training_ratios(rows)
    lines = []
    for system, how in (
        ("psframe", "tensors through shared memory, psframe's default on one host"),
        ("psframe_grpc", "every byte through gRPC, as between hosts"),
    ):
        row = next((r for r in ratios if (r["system"], r["mode"], r["model"]) == (system, "async", "large_mlp")), None)
        if row is not None and row.get("vs_tf_ps") is not None:
            lines.append(
                f"**Large MLP, async: {system}'s samples/s over tf_ps's (TensorFlow's parameter server): "
                f"{format_ratio(row['vs_tf_ps'])}** ({how}; the median of the ratios repeat by repeat)."
            )
    return "\n\n".join(lines)


def format_table(rows: Sequence[dict]) -> str:
    """The rows as a fixed-width text table."""
    header = (
        "system",
        "model",
        "mode",
        "global steps/s",
        "samples/s",
        "per-worker steps/s",
        "timed steps",
        "seconds",
        "CPU ms/step",
        "other load",
    )
    lines = [header]
    for r in rows:
        per_worker = "/".join(f"{v:.0f}" if v >= 10 else f"{v:.2f}" for v in r.get("per_worker_steps_per_sec", []))
        lines.append(
            (
                r["system"],
                r["model"],
                r["mode"],
                _num(r["global_steps_per_sec"]),
                _num(r["samples_per_sec"]),
                per_worker or "-",
                str(r["steps"]),
                "ERROR" if "error" in r else "n/a" if "unavailable" in r else _num(r["seconds"]),
                _num(r.get("cpu_ms_per_step")),
                "-" if r.get("other_cpu_load") is None else f"{r['other_cpu_load']:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(text)


def _num(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"

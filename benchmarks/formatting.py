"""Numbers, markdown tables and plots made from result rows: what every table of the suite is built from.

A leaf: it imports no benchmark module (every benchmark may import it), and
matplotlib only when a plot is drawn. Each section's own table function (in
its module) turns its rows into cells with these helpers, so stdout and
``docs/benchmarks.md`` show the same numbers in the same form.

Units: sizes are binary (``4 KiB``, ``64 MiB``), throughput decimal (GB/s).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

_KiB = 1024
_MiB = 1024 * _KiB

# ----------------------------------------------------------------------- cells


def format_bytes(nbytes: float) -> str:
    """``4 KiB``, ``320 KiB``, ``4 MiB``, ``1.5 GiB`` (binary units)."""
    for unit, size in (("GiB", 1024**3), ("MiB", _MiB), ("KiB", _KiB)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


def format_number(value: float | None, digits: int = 3) -> str:
    """A readable number with about ``digits`` significant digits; ``-`` for None."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:,.{decimals}f}"


def format_ratio(value: float | None) -> str:
    """``1.23x``; ``-`` for None."""
    return "-" if value is None else f"{value:.2f}x"


def format_percent(value: float) -> str:
    """``0.123`` as ``12%``."""
    return f"{100 * value:.0f}%"


def format_signed(value: float | None) -> str:
    """A difference with its sign, ``+1,234`` or ``-5``; ``-`` for None."""
    return "-" if value is None else f"{value:+,.0f}"


# ----------------------------------------------------------------------- tables


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table (numbers right-aligned)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_looks_numeric(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def _looks_numeric(text: str) -> bool:
    return bool(re.fullmatch(r"(\*\*)?[-+]?[\d,]*\.?\d+(x|%)?(\*\*)?|-", text))


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table under a ``## heading``
    containing ``heading``, in markdown text such as the output of :mod:`benchmarks.run`."""
    rows: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("## "):
            if inside and rows:
                break
            inside = heading in line
        elif inside and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not re.fullmatch(r"[-: |]+", line):
                rows.append(cells)
        elif inside and rows:  # the first table ended
            break
    return rows[1:]  # without the header row


# ----------------------------------------------------------------------- plots


def plot_throughput_and_training(results: dict, path: Path, system_order: Sequence[str] = ()) -> None:
    """Write the report's two-panel PNG (matplotlib, Agg backend): GB/s each way against payload size
    (``results["raw"]`` and ``results["transport"]`` rows) on the left, training global steps/s per
    system and model (``results["training"]`` rows, systems in ``system_order`` first) on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    lines = []
    for r in results.get("raw") or ():
        lines.append((f"raw gRPC {r['mode']}", "-", r))
    for r in results.get("transport") or ():
        lines.append((f"psframe {r['num_ps']}ps ({r['layout']})", "-" if r["layout"] == "one" else "--", r))
    for label in dict.fromkeys(label for label, _, _ in lines):
        points = sorted((r["payload_bytes"], r["gb_per_sec_each_way"]) for lab, _, r in lines if lab == label)
        style = next(s for lab, s, _ in lines if lab == label)
        left.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
    left.set_xscale("log", base=2)
    sizes = sorted({r["payload_bytes"] for _, _, r in lines})
    left.set_xticks(sizes, [format_bytes(s) for s in sizes])
    left.set_yscale("log")  # 4 KiB and 64 MiB payloads differ by 1000x in GB/s
    left.set_xlabel("payload per round trip (each way)")
    left.set_ylabel("GB/s each way")
    left.set_title("Throughput on loopback")
    left.grid(True, alpha=0.3)
    if lines:
        left.legend(fontsize=8)
    else:
        left.text(0.5, 0.5, "not run", ha="center", va="center", transform=left.transAxes)

    training = [r for r in results.get("training") or [] if "unavailable" not in r]
    models = list(dict.fromkeys(r["model"] for r in training))
    series = list(
        dict.fromkeys((r["system"], r["mode"]) for s in system_order for r in training if r["system"] == s)
    ) + list(dict.fromkeys((r["system"], r["mode"]) for r in training if r["system"] not in system_order))
    width = 0.8 / max(1, len(series))
    for i, (system, mode) in enumerate(series):
        values = [
            next(
                (
                    r["global_steps_per_sec"]
                    for r in training
                    if (r["system"], r["mode"], r["model"]) == (system, mode, m)
                ),
                0.0,
            )
            for m in models
        ]
        label = system if mode in ("-", "", None) else f"{system} ({mode})"
        bars = right.bar(
            [j + (i - (len(series) - 1) / 2) * width for j in range(len(models))], values, width, label=label
        )
        right.bar_label(bars, [format_number(v) if v else "" for v in values], fontsize=6, rotation=90, padding=2)
    right.set_xticks(range(len(models)), models)
    right.set_yscale("log")  # the two models differ by two orders of magnitude
    right.set_ylabel("global steps/s (log)")
    right.set_title("Training")
    if series:
        right.legend(fontsize=8)
        right.margins(y=0.15)
    else:
        right.text(0.5, 0.5, "not run", ha="center", va="center", transform=right.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scaling(rows: Sequence[dict], path: Path) -> None:
    """Write the scaling PNG from the scaling section's rows: global steps/s (echo: round trips/s)
    against workers, one line per system and ps count, one panel per model (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows)) or ["(not run)"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and r["global_steps_per_sec"] == r["global_steps_per_sec"]]
        for system, ps_tasks in dict.fromkeys((r["system"], r["ps_tasks"]) for r in mine):
            points = sorted(
                (r["workers"], r["global_steps_per_sec"])
                for r in mine
                if (r["system"], r["ps_tasks"]) == (system, ps_tasks)
            )
            label = f"{system} (trips/s)" if system == "raw_echo" else f"{system}, {ps_tasks} ps"
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "--" if system == "raw_echo" else "-",
                marker="o",
                label=label,
            )
        counts = sorted({r["workers"] for r in mine})
        if counts:
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(n) for n in counts])
            ax.set_yscale("log")  # the echo's trips/s and a large model's steps/s differ by 100x
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("workers (echo: clients)")
        ax.set_ylabel("global steps/s (echo: round trips/s)")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

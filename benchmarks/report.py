"""Tables, the markdown report (``docs/benchmarks.md``) and its plot.

Every table printed by :mod:`benchmarks.run` comes from here, so stdout and
the report show the same numbers. :func:`write_report` writes the report and
a PNG beside it (same name, ``.png``): throughput against payload size on the
left, training global steps/s per system on the right; and, when the scaling
section ran, a second PNG (``<name>-scaling.png``): throughput against workers.

The section "Copies on the hot path" is written by hand: whatever stands
between its two marker comments in an existing report is kept when the
report is written again.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import MB, format_bytes, format_number, format_ratio, markdown_table

COPIES_MARKER = "<!-- copies: filled in by maintainers -->"
COPIES_END = "<!-- /copies -->"
COPIES_PLACEHOLDER = (
    "TODO (maintainers): list every copy of tensor bytes on the push+pull path, worker to ps and "
    "back (encode, gRPC send and receive buffers, decode, optimizer, the reply), and which of them "
    "the numbers above suggest removing first."
)

TRAINING_SYSTEMS = ("psframe", "psframe_grpc", "psframe_bf16", "torch_rpc_ps", "tf_ps", "ddp_gloo", "single_process")

TITLES = {
    "raw": "Raw gRPC ceiling",
    "transport": "psframe transport (push+pull)",
    "security": "Auth token and TLS: cost per step",
    "training": "Training",
    "scaling": "Scaling with workers",
    "memory": "ps memory",
    "sparse": "Embedding tables",
    "hosts": "Across hosts, at the link's limit",
}
# The order of the sections in the report.
REPORT_SECTIONS = ("raw", "transport", "security", "training", "scaling", "memory", "sparse", "hosts")


# ----------------------------------------------------------------------- tables


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"


def raw_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.raw_grpc.run_raw_benchmarks` rows."""
    return markdown_table(
        ["system", "mode", "payload", "round trips/s", "GB/s each way", "spread"],
        [
            [
                r["system"],
                r["mode"],
                format_bytes(r["payload_bytes"]),
                format_number(r["round_trips_per_sec"]),
                format_number(r["gb_per_sec_each_way"]),
                _pct(r["spread"]),
            ]
            for r in rows
        ],
    )


def transport_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.transport.run_transport_benchmarks` rows
    (with the ratios of :func:`benchmarks.transport.add_ratios` where present)."""

    def ratio(row: dict, mode: str) -> str:
        text = format_ratio(row.get(f"vs_raw_{mode}"))
        return f"**{text}**" if row.get("rpc") == mode and text != "-" else text

    return markdown_table(
        [
            "system",
            "ps tasks",
            "tensors",
            "payload",
            "PushPull rpc",
            "round trips/s",
            "GB/s each way",
            "vs raw unary",
            "vs raw stream",
            "spread",
        ],
        [
            [
                r["system"],
                r["num_ps"],
                f"{r['num_tensors']} ({r['layout']})",
                format_bytes(r["payload_bytes"]),
                r.get("rpc", "?"),
                format_number(r["round_trips_per_sec"]),
                format_number(r["gb_per_sec_each_way"]),
                ratio(r, "unary"),
                ratio(r, "stream"),
                _pct(r["spread"]),
            ]
            for r in rows
        ],
    )


def memory_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.memory.run_memory_benchmarks` rows (MB = 10**6 bytes)."""
    return markdown_table(
        [
            "system",
            "variables",
            "optimizer",
            "bytes held (MB)",
            "baseline (MB)",
            "idle ps (MB)",
            "peak after init (MB)",
            "peak (MB)",
            "limit (MB)",
            "peak <= 1.3 x held + idle ps",
            "s/step",
        ],
        [
            [
                r["system"],
                r["variables"],
                r["optimizer"],
                format_number(r["bytes_held"] / MB, 4),
                format_number(r["baseline_rss"] / MB, 4),
                format_number(r["idle_rss"] / MB, 4),
                format_number(None if r.get("peak_rss_after_init") is None else r["peak_rss_after_init"] / MB, 4),
                format_number(r["peak_rss"] / MB, 4),
                format_number(r["limit"] / MB, 4),
                "yes" if r["within_limit"] else "NO",
                format_number(r["seconds_per_step"]),
            ]
            for r in rows
        ],
    )


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
                "cpu_vs_torch_rpc_ps": _ratio(_cpu_per_sample(row), _cpu_per_sample(rpc)),
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
        return _ratio(row.get("samples_per_sec"), base.get("samples_per_sec"))
    ratios = [r for r in (_ratio(a * per_step, b * base_per_step) for a, b in zip(runs, base_runs)) if r is not None]
    return statistics.median(ratios) if ratios else None


def _samples_per_step(row: dict) -> float | None:
    """Examples one global step of the row's system consumes (100 async, 200 sync and DDP)."""
    return _ratio(row.get("samples_per_sec"), row.get("global_steps_per_sec"))


def _cpu_per_sample(row: dict) -> float | None:
    return _ratio(row.get("cpu_ms_per_step"), _samples_per_step(row))


def _ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None where either is missing or not a number, or base is 0."""
    if value is None or not base or math.isnan(value) or math.isnan(base):
        return None
    return value / base


def training_table(rows: Sequence[dict]) -> str:
    """Markdown table of ``benchmarks.training.run_training_benchmarks`` rows, with ratios."""
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


def scaling_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.scaling.run_scaling_benchmarks` rows, with ratios."""
    from benchmarks.scaling import add_ratios

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


SPARSE_MEMORY_CAPTION = "ps memory of an embedding table with Adagrad on 2 ps tasks"
SPARSE_CTR_CAPTION = "The CTR example (examples/ctr_dist.py), async and sync, against one process"


def sparse_table(rows: Sequence[dict]) -> str:
    """Markdown tables of :func:`benchmarks.sparse.run_sparse_benchmarks` rows: steps, then the ps
    tasks' memory, the CTR example and partition balance (each where it has rows)."""
    from benchmarks.ctr import ctr_table
    from benchmarks.sparse import IDLE_ROWS, balance_table, memory_table
    from benchmarks.sparse import sparse_table as table

    steps = [r for r in rows if r.get("kind") not in ("memory", "ctr", "balance")]
    memory, ctr, balance = ([r for r in rows if r.get("kind") == kind] for kind in ("memory", "ctr", "balance"))
    parts = [table(steps)] if steps else []
    if memory:
        parts.append(
            f"{SPARSE_MEMORY_CAPTION} (each ps task's peak resident memory, VmHWM, after "
            f"{memory[0]['steps']} steps, against 1.3 x the table rows and optimizer state it "
            f"holds plus the peak of the same ps task of a {IDLE_ROWS:,}-row table after the same "
            "steps, measured in the same run; MB = 10^6 bytes):\n\n" + memory_table(memory)
        )
    if ctr:
        parts.append(
            f"{SPARSE_CTR_CAPTION} (from `benchmarks.ctr`: the same samples in every mode; "
            "samples/s as the example's chief prints it, over its training loop; *run s* the "
            "whole run with start-up and evaluation):\n\n" + ctr_table(ctr)
        )
    if balance:
        parts.append(
            "How evenly a table's parts share a batch's lookups (no cluster: psframe's placement "
            "and id split over 20 power-law batches of a 10^6-row table):\n\n" + balance_table(balance)
        )
    return "\n\n".join(parts)


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+,.0f}"


def security_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.security.run_security_benchmarks` rows."""
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
                _signed(r.get("us_over_none")),
                format_number(r.get("cpu_us_per_step")),
                _signed(r.get("cpu_us_over_none")),
                format_ratio(r.get("vs_none")),
                _pct(r["spread"]),
            ]
            for r in rows
        ],
    )


def hosts_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`benchmarks.hosts.run_hosts_benchmark` rows."""
    from benchmarks.hosts import format_table

    return format_table(rows)


TABLES = {
    "raw": raw_table,
    "transport": transport_table,
    "security": security_table,
    "training": training_table,
    "scaling": scaling_table,
    "memory": memory_table,
    "sparse": sparse_table,
    "hosts": hosts_table,
}


def section_text(section: str, rows: Sequence[dict]) -> str:
    """A section's heading and table, as printed and as written in the report."""
    summary = training_summary(rows) if section == "training" else ""
    return f"## {TITLES[section]}\n\n{TABLES[section](rows)}\n" + (f"\n{summary}\n" if summary else "")


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


# ---------------------------------------------------------------- machine info


def machine() -> dict[str, str]:
    """CPU model, cores, memory and OS of this machine."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import psutil

    physical = psutil.cpu_count(logical=False)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "CPU": cpu,
        "cores": f"{os.cpu_count()} logical ({physical or '?'} physical), {usable} usable by this process",
        "RAM": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "OS": platform.platform(),
    }


def versions() -> dict[str, str]:
    """Versions of python and of the packages measured."""
    import google.protobuf
    import grpc
    import torch

    import psframe
    from benchmarks import tf_env

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "psframe": psframe.__version__,
        **({"tensorflow-cpu (tf_ps)": tf} if (tf := tf_env.tf_version()) else {}),
    }


# ----------------------------------------------------------------------- report


_INTROS = {
    "raw": (
        "A bytes-in, bytes-out gRPC echo server with no psframe code (generic handlers, no message "
        "size limit) in its own process. **unary**: one call per round trip; **stream**: one "
        "long-lived bidirectional stream, request i answered by response i, one in flight. Request "
        "and response have the same size; GB/s (10^9 bytes/s) is each way."
    ),
    "transport": (
        "One worker (this process) and 1 or 2 `psframe server` ps processes per configuration. A "
        "round trip is the trainer's planned requests through `PsClient.push_pull`: encoded, sent "
        "to every ps task in parallel (SGD with lr 0 is applied), and the replies decoded, "
        "which carry the same tensors back. **one**: one float32 tensor per ps task (the payload "
        "halved with 2 ps); **many**: tensors of max(4 KiB, payload/256), half on each ps with 2 ps "
        "(at 4 KiB this is the same as one, so it is not run). Ratios are round trips/s over the raw "
        "ceiling's at the same payload; the like-for-like one, against the raw RPC of the same kind as "
        "psframe's PushPull (column *PushPull rpc*), is in bold."
    ),
    "security": (
        "What issue 17's protections cost a worker step. The transport section's step (one float32 "
        "tensor pushed and pulled back through `PsClient.push_pull`, every byte through gRPC), to one "
        "`psframe server --serving_processes=1` ps task started with each setting's flags: **none**; "
        "**token** (`--auth_token_file`: one metadata entry per call, checked by the ps's interceptor; "
        "plaintext); **TLS + token** (the ps has a certificate, the worker checks it); **mutual TLS + "
        "token** (both have certificates). Certificates are made for the run (trustme, ECDSA P-256). "
        "*µs/step over none* is the step time minus the step time without security at that payload; "
        "*CPU µs/step* the CPU time (user + system, all threads) the worker and the ps process spent "
        "per step in the timed repeats, which other work on the machine disturbs less than the wall "
        "time, and *CPU µs/step over none* its difference from the row without security; "
        "*vs none* divides round trips/s by the row without security's. Repeats are interleaved "
        "(each setting once, then each again), each row the median of its repeats. The trainer's default on one "
        "host moves tensor bytes through shared memory, and gRPC (so TLS) carries only the headers."
    ),
    "training": (
        "From `benchmarks.training` (same run). Every system ran several times, interleaved (each "
        "system once, then each again...), so that other load on the machine weighs on all alike; a "
        "row is the run with the median rate (every run's rate in the last column), itself the median "
        "of 5 windows after warm-up. Ratios compare samples/s with torch_rpc_ps in the same mode and "
        "with ddp_gloo on the same model, repeat by repeat: each is the median over the repeats of the "
        "ratio between the two systems' runs of one repeat, which ran minutes apart at most (a psframe "
        "row runs right before its torch_rpc_ps row); `-` where there is nothing to compare with. "
        "*CPU ms/step* is "
        "the CPU time (user + system, all threads) of all the system's processes inside the timed "
        "window, per global step, sampled every 50 ms; *CPU/sample vs torch_rpc_ps* divides CPU time "
        "per sample by torch_rpc_ps's (below 1: less work per sample). **tf_ps** is TensorFlow's "
        "parameter server as TF 1.x users ran it (`tf.compat.v1.train.Server`, "
        "`replica_device_setter`, `GradientDescentOptimizer`, one `session.run` per step; "
        "1 ps + 2 workers, async, oneDNN kernels on) on the same model, initial values and data, "
        "in its own environment (`scripts/env_tf.sh`); *samples/s vs tf_ps* divides samples/s by "
        "its, same model and mode, repeat by repeat. Where its environment is missing its rows say "
        "*unavailable*."
    ),
    "sparse": (
        "From `benchmarks.sparse` (same run). One worker (`psframe.Trainer`) and 2 ps tasks train a "
        "CTR-shaped model: 26 categorical features looked up in one `nn.Embedding(rows, 64)`, summed "
        "per sample, and a linear head, with Adagrad; batches of 512 samples (13,312 lookups), the "
        "same for every table size: ids of a power-law frequency (Zipf over 10^4 ids) scattered over "
        "the table by a multiplicative hash, about 3,500 distinct rows a batch. **rows**: "
        "`sparse=True`, an embedding table: a step pulls the batch's distinct rows before the forward "
        "pass and pushes their gradients after backward. **rows+prefetch** (1 ps task, at the RPC "
        "baseline's sizes): the same with `Trainer.prefetch`, each step also pulling the next batch's rows "
        "right behind its push. **dense**: `sparse=False`, the whole table "
        "each way every step (run up to 10^5 rows). **rpc**: a torch.distributed.rpc parameter server "
        "(`benchmarks.baseline_rpc_sparse`, one ps process) with the same model and Adagrad, the trainer "
        "pulling the batch's rows and pushing a `torch.sparse` gradient, two `rpc_sync` calls a step; "
        "*vs rpc* divides psframe's steps/s on 1 ps task by its at the same table size. *rows/s each "
        "way* counts distinct rows (dense: the table's rows) moved per second; *step time vs smallest "
        "table* divides the step time by the smallest table's, moved the same way on as many ps tasks; "
        "*start-up s* is the trainer's connect (the chief sends the table's initial values). "
        "Below it: the ps tasks' memory with a 10^7 x 64 table and Adagrad (10^6 rows in quick mode; "
        "`benchmarks.sparse.table_memory`), and the CTR example's samples/s and AUC (`benchmarks.ctr`)."
    ),
    "hosts": (
        "From `benchmarks.hosts` (same run). One ps host and two worker hosts made of network "
        "namespaces on a bridge (`tests/hosts.py`), each with its own `/dev/shm`, so every byte crosses "
        "the network; every host's link capped with `tc tbf` (both ways) or uncapped. Async, 1 ps + 2 "
        "workers, the training section's models and data. *link limit* is the link's rate over the "
        "model's float32 bytes, which each global step moves each way through the ps host's link (full "
        "duplex); *of the limit* divides global steps/s by it (bfloat16 on the wire may pass 1); *vs best "
        "peer* divides psframe's global steps/s by the faster of torch_rpc_ps and tf_ps on the same link and "
        "model; a row is *link-bound* when its limit is below what the same system reached uncapped."
    ),
    "scaling": (
        "From `benchmarks.scaling` (same run). Each model, at each worker count N, with every system "
        "run once, async, back to back: **psframe** with 1 and 2 ps tasks and N workers; "
        "**torch_rpc_ps**, the RPC parameter server of the training section, with N trainers; "
        "**tf_ps**, TensorFlow's parameter server of the training section, with N workers; "
        "**raw_echo**, the raw gRPC echo server with N client processes, each one stream with one "
        "request in flight (as a worker's PushPull stream), at the payload of psframe's mean request "
        "on that model with 1 ps task. *global steps/s* is model updates per second (raw_echo: round "
        "trips per second of all clients together, the sum of their rates); *vs torch_rpc_ps* divides "
        "it by torch_rpc_ps's at the same model and N. *server CPU ms/request* is the CPU time (user + "
        "system, all threads) of the serving processes only (psframe: its ps task(s); torch_rpc_ps "
        "and tf_ps: their ps; raw_echo: its server), sampled every 50 ms, inside the timed window, per request "
        "answered in it. A psframe request is one PushPull message to one ps task: a step sends each "
        "ps task its variables in messages of at most 4 MiB (psframe's `max_shard_bytes`), counted by "
        "psframe's own step plan (*requests/step*; the messages are listed below the table), so "
        "requests = timed global steps x requests/step. A torch_rpc_ps request is one `rpc_sync`, "
        "the whole model each way; a tf_ps request is one worker step, the whole model each way, "
        "which TF sends as one `RunGraph` call to the ps and a `RecvTensor` transfer per variable "
        "and per gradient (the ps's CPU for all of them counts); a raw_echo request is one round trip, "
        "counted in the window all clients timed together. *CPU/request vs raw_echo* divides the CPU "
        "per request by the echo "
        "server's CPU per round trip at the same model and N, both per byte of their mean request "
        "(*request size*): where the sizes are equal (psframe with 1 ps task; torch_rpc_ps on the "
        "MNIST MLP) this is the CPU per request over the CPU per round trip at the same payload and "
        "client count; where they differ (2 ps tasks share a step's bytes; torch_rpc_ps sends the large "
        "MLP as one 80 MB request) the echo's CPU is scaled to the request's bytes: for psframe with 2 "
        "ps tasks it is the CPU both ps tasks spent per step over the echo's per round trip carrying "
        "the same bytes, so each message's fixed cost counts against it. *other load*: "
        "cores kept busy by work outside the benchmark while the row ran."
    ),
    "memory": (
        "One ps task per row: float32 variables in parts of 4 MiB (the trainer's), an optimizer "
        "with state, a few push+pull steps of every variable (requests of at most 4 MiB on one "
        "stream, as the trainer sends them). *bytes held* is the ps's own count of variables plus optimizer state "
        "(`TaskInfo.bytes_held`); *peak* the process's high-water mark of resident memory (VmHWM) at the "
        "end, or for a task served from several processes (`--serving_processes`), whose variables and "
        "optimizer state every process maps from shared memory, the largest sum of their proportional "
        "set sizes (PSS) sampled every 10 ms; *peak after init* the high-water mark once the variables "
        "exist, before the first step (one process only); *baseline* the task's memory once serving, "
        "before any variable; *idle ps* the peak of a ps task of the same optimizer and processes "
        "holding one 4 KiB variable after the same steps, measured in the same run: what any ps task "
        "costs (the code torch, gRPC and the optimizer page in on first use is not in the baseline). "
        "MB = 10^6 bytes."
    ),
}


def _load(load: Sequence[float] | None) -> str:
    return "unknown" if not load else " / ".join(f"{x:.2f}" for x in load)


def _copies_section(previous: str | None) -> str:
    kept = COPIES_PLACEHOLDER
    if previous and COPIES_MARKER in previous and COPIES_END in previous:
        inner = previous.split(COPIES_MARKER, 1)[1].split(COPIES_END, 1)[0].strip()
        if inner:
            kept = inner
    return f"## Copies on the hot path\n\n{COPIES_MARKER}\n{kept}\n{COPIES_END}\n"


def scaling_png_name(png_name: str) -> str:
    """The scaling plot's file name, beside the report's plot ``png_name``."""
    path = Path(png_name)
    return str(path.with_name(f"{path.stem}-scaling{path.suffix}"))


def _scaling_machine(rows: Sequence[dict]) -> str:
    cores = next((r["cores"] for r in rows if r.get("cores")), None)
    counts = ", ".join(str(n) for n in dict.fromkeys(r["workers"] for r in rows))
    where = f"this machine had {cores} usable cores" if cores else "the machine's cores were not recorded"
    return (
        f"Worker counts: {counts} ({where}; the counts go 1, 2, 4, 8... up to the usable cores "
        f"less 2, left to the ps tasks, so 1 and 2 on 2 cores and up to 14 on 16). With more "
        f"processes than cores, they share the cores: rates then say how the systems degrade, not "
        f"how they scale."
    )


def _psframe_messages(rows: Sequence[dict]) -> str:
    """The bytes of each message of a psframe step, per model and ps count in ``rows``."""
    from benchmarks.scaling import request_plan

    cases = dict.fromkeys((r["model"], r["ps_tasks"]) for r in rows if r["system"] == "psframe")
    lines = []
    for model, ps_tasks in cases:
        plan = request_plan(model, ps_tasks)
        sizes = ", ".join(f"{count} x {n:,}" for n, count in _runs(plan))
        lines.append(f"- {model}, {ps_tasks} ps: {len(plan)} message(s) per step, bytes each way: {sizes}")
    return "psframe's messages per async step (from its step plan):\n\n" + "\n".join(lines) if lines else ""


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """``(value, count)`` of each run of equal neighbours, in order."""
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return [(v, n) for v, n in runs]


def render_markdown(results: dict, png_name: str, previous: str | None = None) -> str:
    """The report's markdown.

    Args:
        results: what :func:`benchmarks.run.run_all` returns: a row list (or None)
            per section, plus ``errors``, ``skipped``, ``command``, ``date``,
            ``seconds``, ``quick`` and ``settings``.
        png_name: the plot's file name, relative to the report.
        previous: the report being replaced, if any (its copies section is kept).
    """
    parts = [
        "# psframe benchmarks\n",
        f"Generated by `{results['command']}` on {results['date']} in {results['seconds']:.0f} s"
        + (
            " (**quick mode**: small sizes and few repeats, a smoke test, not a measurement)."
            if results.get("quick")
            else "."
        ),
        "",
        "All on one machine over loopback (127.0.0.1, ports chosen by the OS), one compute thread "
        "per process (`OMP_NUM_THREADS=1`, `torch.set_num_threads(1)`), servers in processes "
        f"separate from their clients; warm-up excluded; {results['settings']}. *spread* is "
        "(max - min) / median of the repeats.\n",
        "## Machine\n",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- load average (1/5/15 min) before the run: {_load(results.get('load_before'))}, after: "
        f"{_load(results.get('load_after'))} (other work on the machine lowers and scatters the numbers)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        "",
    ]
    for section in REPORT_SECTIONS:
        rows = results.get(section)
        parts.append(f"## {TITLES[section]}\n")
        if section in results.get("errors", {}):
            parts.append(f"**Failed:** {results['errors'][section]}\n")
        if rows and section == "scaling":
            parts += [
                _INTROS[section],
                "",
                _scaling_machine(rows),
                "",
                TABLES[section](rows),
                "",
                _psframe_messages(rows),
                "",
                f"![throughput against workers]({scaling_png_name(png_name)})\n",
                "Global steps/s (raw_echo: round trips/s) against workers, one line per system "
                "and ps count, one panel per model (both axes logarithmic).\n",
            ]
        elif rows:
            parts += [_INTROS[section], "", TABLES[section](rows), ""]
            if section == "training" and training_summary(rows):
                parts += [training_summary(rows), ""]
        elif section in results.get("skipped", ()):
            parts.append("Skipped (`--skip`).\n")
        elif section not in results.get("errors", {}):
            parts.append("No rows.\n")
    parts += [
        "## Plot\n",
        f"![throughput against payload size, and training steps/s]({png_name})\n",
        "Left: GB/s each way against payload size (raw gRPC unary and stream; psframe with 1 and 2 ps "
        "tasks, one tensor per ps solid, many small tensors dashed). Right: training global steps/s "
        "per system and model.\n",
        _copies_section(previous),
    ]
    return "\n".join(parts)


def plot(results: dict, path: Path) -> None:
    """Write the two-panel PNG (matplotlib, Agg backend)."""
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
        dict.fromkeys((r["system"], r["mode"]) for s in TRAINING_SYSTEMS for r in training if r["system"] == s)
    ) + list(dict.fromkeys((r["system"], r["mode"]) for r in training if r["system"] not in TRAINING_SYSTEMS))
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
    """Write the scaling PNG: global steps/s (echo: round trips/s) against workers,
    one line per system and ps count, one panel per model (matplotlib, Agg backend)."""
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


def write_report(results: dict, out: Path) -> tuple[Path, Path]:
    """Write the markdown report to ``out`` and its plot beside it, and the
    scaling plot (:func:`scaling_png_name`) when the scaling section has rows.

    Returns:
        The paths of the report and of the (first) PNG.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    previous = out.read_text() if out.exists() else None
    plot(results, png)
    if results.get("scaling"):
        plot_scaling(results["scaling"], out.parent / scaling_png_name(png.name))
    out.write_text(render_markdown(results, png.name, previous))
    return out, png


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first table under a ``## heading``
    containing ``heading``, in markdown text such as :mod:`benchmarks.run`'s output."""
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

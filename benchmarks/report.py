"""The report of :mod:`benchmarks.run`: ``docs/benchmarks.md``, its plots, and each section's text.

Every table printed by :mod:`benchmarks.run` comes from its section's own
table function (``raw_table``, ``transport_table``... in the section's
module), through :func:`section_text`, so stdout and the report show the same
numbers. This module adds what is around the tables: titles, the paragraph
that says how each section measures, the machine and versions.
:func:`write_report` writes the report and a PNG beside it (same name,
``.png``): throughput against payload size on the left, training global
steps/s per system on the right; and, when the scaling section ran, a second
PNG (``<name>-scaling.png``): throughput against workers.

The section "Copies on the hot path" is written by hand: whatever stands
between its two marker comments in an existing report is kept when the
report is written again.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.baselines import tf_env
from benchmarks.baselines.raw_grpc import raw_table
from benchmarks.formatting import plot_scaling, plot_throughput_and_training
from benchmarks.suite.hosts import hosts_table
from benchmarks.suite.memory import memory_table
from benchmarks.suite.scaling import step_plan_sizes
from benchmarks.suite.scaling_tables import scaling_table
from benchmarks.suite.security import security_table
from benchmarks.suite.sparse import sparse_table
from benchmarks.suite.training import PLOT_ORDER
from benchmarks.suite.training_tables import training_summary, training_table
from benchmarks.suite.transport import transport_table

COPIES_MARKER = "<!-- copies: filled in by maintainers -->"
COPIES_END = "<!-- /copies -->"
COPIES_PLACEHOLDER = (
    "TODO (maintainers): list every copy of tensor bytes on the push+pull path, worker to ps and "
    "back (encode, gRPC send and receive buffers, decode, optimizer, the reply), and which of them "
    "the numbers above suggest removing first."
)

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


# Each section's table, from the module that measures it.
TABLES: dict[str, Callable[[Sequence[dict]], str]] = {
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
        "What the auth token and TLS cost a worker step. The transport section's step (one float32 "
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
        "From `benchmarks.suite.training` (same run). Every system ran several times, interleaved (each "
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
        "From `benchmarks.suite.sparse` (same run). One worker (`psframe.Trainer`) and 2 ps tasks train a "
        "CTR-shaped model: 26 categorical features looked up in one `nn.Embedding(rows, 64)`, summed "
        "per sample, and a linear head, with Adagrad; batches of 512 samples (13,312 lookups), the "
        "same for every table size: ids of a power-law frequency (Zipf over 10^4 ids) scattered over "
        "the table by a multiplicative hash, about 3,500 distinct rows a batch. **rows**: "
        "`sparse=True`, an embedding table: a step pulls the batch's distinct rows before the forward "
        "pass and pushes their gradients after backward. **rows+prefetch** (1 ps task, at the RPC "
        "baseline's sizes): the same with `Trainer.prefetch`, each step also pulling the next batch's rows "
        "right behind its push. **dense**: `sparse=False`, the whole table "
        "each way every step (run up to 10^5 rows). **rpc**: a torch.distributed.rpc parameter server "
        "(`benchmarks.baselines.rpc_sparse`, one ps process) with the same model and Adagrad, the trainer "
        "pulling the batch's rows and pushing a `torch.sparse` gradient, two `rpc_sync` calls a step; "
        "*vs rpc* divides psframe's steps/s on 1 ps task by its at the same table size. *rows/s each "
        "way* counts distinct rows (dense: the table's rows) moved per second; *step time vs smallest "
        "table* divides the step time by the smallest table's, moved the same way on as many ps tasks; "
        "*start-up s* is the trainer's connect (the chief sends the table's initial values). "
        "Below it: the ps tasks' memory with a 10^7 x 64 table and Adagrad (10^6 rows in quick mode; "
        "`benchmarks.suite.sparse.table_memory`), and the CTR example's samples/s and AUC (`benchmarks.suite.ctr`)."
    ),
    "hosts": (
        "From `benchmarks.suite.hosts` (same run). One ps host and two worker hosts made of network "
        "namespaces on a bridge (`tests/support/hosts.py`), each with its own `/dev/shm`, so every byte crosses "
        "the network; every host's link capped with `tc tbf` (both ways) or uncapped. Async, 1 ps + 2 "
        "workers, the training section's models and data. *link limit* is the link's rate over the "
        "model's float32 bytes, which each global step moves each way through the ps host's link (full "
        "duplex); *of the limit* divides global steps/s by it (bfloat16 on the wire may pass 1); *vs best "
        "peer* divides psframe's global steps/s by the faster of torch_rpc_ps and tf_ps on the same link and "
        "model; a row is *link-bound* when its limit is below what the same system reached uncapped."
    ),
    "scaling": (
        "From `benchmarks.suite.scaling` (same run). Each model, at each worker count N, with every system "
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
    cases = dict.fromkeys((r["model"], r["ps_tasks"]) for r in rows if r["system"] == "psframe")
    lines = []
    for model, ps_tasks in cases:
        plan = step_plan_sizes(model, ps_tasks)
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
    plot_throughput_and_training(results, png, PLOT_ORDER)
    if results.get("scaling"):
        plot_scaling(results["scaling"], out.parent / scaling_png_name(png.name))
    out.write_text(render_markdown(results, png.name, previous))
    return out, png

"""Training across hosts: psframe and its peers on test hosts, at the limit of their links.

One ps host and two worker hosts (network namespaces on a bridge, each with
its own ``/dev/shm``: every byte crosses the network; :mod:`tests.support.hosts`),
every host's link capped at 100 Mbit/s, 1 Gbit/s (``tc tbf``, both ways) or
left uncapped. On each, the models of :mod:`benchmarks.suite.training` (the MNIST
MLP, 0.32 MB of float32, and the large MLP, 80 MB) train asynchronously with:

=================  ==========================================================
psframe            float32 on the wire (psframe's default)
psframe_bf16       ``wire_dtype="bfloat16"``: half the bytes each way
torch_rpc_ps       the torch.distributed.rpc parameter server (TensorPipe over TCP)
tf_ps              TensorFlow 1.x's between-graph parameter server, where its
                   environment exists (:mod:`benchmarks.baselines.tf_env`)
=================  ==========================================================

Each async global step is one worker's step: its gradients go into the ps
host and the parameters come out, so the ps host's link carries the model's
bytes each way per global step, full duplex. The **link limit** is the link's
rate over those bytes (float32 for every system: compression counts as a gain
beyond it), in global steps/s; each row prints its fraction of it, and psframe's
ratio to the best peer on the same link and model. A row is *link-bound* when
the limit is below what the same system reached uncapped.

Run it::

    python -m benchmarks.suite.hosts [--quick] [--models mnist_mlp large_mlp] [--links 100 1000 0] [--device cuda]

(0: uncapped); ``--systems psframe psframe_overlap`` gives the A/B of sending a
step's messages during backward (``Trainer(overlap_backward=True)``);
``--device cuda`` has psframe's workers compute on the GPU (both worker hosts
share it; the peers stay on the CPU). It needs root (network namespaces);
without, it says so and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import time
from collections.abc import Sequence

from benchmarks.children import ForkServer
from benchmarks.mlp_workload import MODELS, model_bytes
from benchmarks.suite.processes import Placement
from benchmarks.suite.training_systems import (
    SystemUnavailable,
    run_psframe_processes,
    run_rpc_processes,
    run_tf_processes,
)

HOST_NAMES = ("ps0", "w0", "w1")
# Each process of every system, by the name the training section gives it (ps0, worker1, trainer0...), on its host.
TASK_HOSTS = {"ps0": "ps0", "ps": "ps0", "worker0": "w0", "worker1": "w1", "trainer0": "w0", "trainer1": "w1"}
LINKS_MBIT = (100, 1000, 0)  # 0: uncapped
SYSTEMS = ("psframe", "psframe_bf16", "torch_rpc_ps", "tf_ps")
# Rows that only --systems asks for: the A/B of sending during backward.
EXTRA_SYSTEMS = ("psframe_overlap",)
PEERS = ("torch_rpc_ps", "tf_ps")
# About this many seconds of timed steps per row, at the link limit (or at the
# uncapped rate measured first); never fewer steps than these.
TARGET_SECONDS = {"full": 12.0, "quick": 0.5}
MIN_STEPS = {"mnist_mlp": (200, 20), "large_mlp": (4, 1)}
QUICK_MIN_STEPS = {"mnist_mlp": (20, 5), "large_mlp": (2, 1)}
ROW_TIMEOUT_S = 600.0
# Global steps/s to size an uncapped row by, before it is measured (2 cores, 1 ps + 2 workers).
UNCAPPED_GUESS = {"mnist_mlp": 300.0, "large_mlp": 2.0}


def link_limit(model: str, link_mbit: float) -> float:
    """Global steps/s at which the ps host's link is full: its rate over the model's bytes each way."""
    return link_mbit * 1e6 / 8 / model_bytes(model) if link_mbit else math.inf


def _steps(model: str, rate_guess: float, quick: bool) -> tuple[int, int]:
    timed_min, warmup_min = (QUICK_MIN_STEPS if quick else MIN_STEPS)[model]
    target = TARGET_SECONDS["quick" if quick else "full"]
    timed = max(timed_min, int(rate_guess * target))
    return timed, max(warmup_min, timed // 10)


def run_row(placement: Placement, system: str, model: str, steps: int, warmup: int, device: str = "cpu") -> dict:
    """One system training ``model`` on the hosts; its row of measurements.

    ``device`` is where psframe's workers compute (the peers' always on the CPU).
    """
    deadline = time.monotonic() + ROW_TIMEOUT_S
    psframe_flags = {"psframe": [], "psframe_bf16": ["--wire_dtype=bfloat16"], "psframe_overlap": ["--overlap"]}
    if system in psframe_flags:
        return run_psframe_processes(
            model, False, steps, warmup, deadline, [*psframe_flags[system], f"--device={device}"], placement=placement
        )
    if system == "torch_rpc_ps":
        return run_rpc_processes(model, False, steps, warmup, deadline, placement=placement)
    if system == "tf_ps":
        return run_tf_processes(model, steps, warmup, deadline, placement=placement)
    raise ValueError(f"unknown system {system!r}; expected one of {SYSTEMS}")


def run_hosts_benchmark(
    models: Sequence[str] = ("mnist_mlp", "large_mlp"),
    links: Sequence[int] = LINKS_MBIT,
    systems: Sequence[str] = SYSTEMS,
    quick: bool = False,
    device: str = "cpu",
) -> list[dict]:
    """Every system on every model and link; the rows, with their link limit and ratios
    (psframe's workers computing on ``device``).

    Raises:
        tests.support.hosts.HostsError: the hosts cannot be made (not root, no netns support).
    """
    from tests.support.hosts import HostSet

    rows: list[dict] = []
    with HostSet(list(HOST_NAMES)) as hosts, contextlib.ExitStack() as stack:
        # --quick: one fork server on each host (benchmarks.children.ForkServer), its children on that host.
        servers = {
            name: stack.enter_context(ForkServer(popen=functools.partial(hosts.popen, name)))
            for name in (HOST_NAMES if quick else ())
        }

        def popen(task: str, argv: list[str], **kwargs):
            host = TASK_HOSTS[task]
            forked = servers[host].start(argv, **kwargs) if host in servers else None
            return forked or hosts.popen(host, argv, **kwargs)

        placement = Placement(address=lambda task: hosts.address(TASK_HOSTS[task]), popen=popen, interface="eth0")
        uncapped: dict[tuple[str, str], float] = {}
        # Uncapped first: it says which capped rows are link-bound, and how many steps fit the time.
        for link in sorted(links, key=lambda mbit: mbit != 0):
            for name in HOST_NAMES:
                if link:
                    hosts.cap(name, link)
                else:
                    hosts.uncap(name)
            for model in models:
                limit = link_limit(model, link)
                for system in systems:
                    guess = min(limit, uncapped.get((system, model), UNCAPPED_GUESS[model]))
                    steps, warmup = _steps(model, guess, quick)
                    row = {"link_mbit": link, "model": model, "system": system, "link_limit": limit, "steps": steps}
                    try:
                        row.update(run_row(placement, system, model, steps, warmup, device))
                    except SystemUnavailable as e:
                        row["unavailable"] = str(e)
                    except Exception as e:  # noqa: BLE001 - a failed row is reported, the rest still run
                        row["error"] = f"{type(e).__name__}: {e}"
                    rate = row.get("global_steps_per_sec")
                    if link == 0 and rate:
                        uncapped[(system, model)] = rate
                    rows.append(row)
                    print(_line(row), flush=True)
    _add_ratios(rows, uncapped)
    return rows


def _add_ratios(rows: list[dict], uncapped: dict[tuple[str, str], float]) -> None:
    for row in rows:
        rate, limit = row.get("global_steps_per_sec"), row["link_limit"]
        row["fraction_of_limit"] = rate / limit if rate and math.isfinite(limit) else None
        free = uncapped.get((row["system"], row["model"]))
        row["link_bound"] = bool(math.isfinite(limit) and free and limit < free)
        peers = [
            r.get("global_steps_per_sec")
            for r in rows
            if r["system"] in PEERS and (r["link_mbit"], r["model"]) == (row["link_mbit"], row["model"])
        ]
        best = max((p for p in peers if p), default=None)
        row["vs_best_peer"] = rate / best if rate and best and row["system"] not in PEERS else None


def _line(row: dict) -> str:
    link = f"{row['link_mbit']} Mbit/s" if row["link_mbit"] else "uncapped"
    if "global_steps_per_sec" not in row:
        return (
            f"[hosts] {link:>12} {row['model']:>10} {row['system']:>13}: {row.get('unavailable') or row.get('error')}"
        )
    return (
        f"[hosts] {link:>12} {row['model']:>10} {row['system']:>13}: "
        f"{row['global_steps_per_sec']:.2f} global steps/s (limit {row['link_limit']:.2f})"
    )


def hosts_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`run_hosts_benchmark` rows."""
    lines = [
        "| link | model | system | global steps/s | link limit | of the limit | vs best peer | "
        "CPU ms/step | link-bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        link = f"{row['link_mbit']} Mbit/s" if row["link_mbit"] else "uncapped"
        limit = f"{row['link_limit']:.2f}" if math.isfinite(row["link_limit"]) else "-"
        if "global_steps_per_sec" not in row:
            why = row.get("unavailable") or row.get("error") or "?"
            lines.append(f"| {link} | {row['model']} | {row['system']} | {why} | {limit} | | | | |")
            continue
        fraction = "-" if row["fraction_of_limit"] is None else f"{row['fraction_of_limit']:.2f}"
        versus = "-" if row["vs_best_peer"] is None else f"{row['vs_best_peer']:.2f}x"
        cpu = row.get("cpu_ms_per_step", math.nan)
        lines.append(
            f"| {link} | {row['model']} | {row['system']} | {row['global_steps_per_sec']:.2f} | {limit} | "
            f"{fraction} | {versus} | {'-' if math.isnan(cpu) else f'{cpu:.1f}'} | "
            f"{'yes' if row['link_bound'] else 'no'} |"
        )
    mb = {model: model_bytes(model) / 1e6 for model in sorted({r["model"] for r in rows})}
    lines.append("")
    lines.append(
        "Link limit: the link's rate over the model's float32 bytes, which every global step moves "
        "each way through the ps host's link (" + ", ".join(f"{m}: {b:.2f} MB" for m, b in mb.items()) + ")."
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per row (a smoke test)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    parser.add_argument(
        "--links", nargs="+", type=int, default=list(LINKS_MBIT), help="link caps in Mbit/s; 0 is uncapped"
    )
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS + EXTRA_SYSTEMS)
    parser.add_argument(
        "--device", default="cpu", help="where psframe's workers compute (cuda: one GPU shared by both worker hosts)"
    )
    args = parser.parse_args(argv)
    from tests.support.hosts import hosts_unavailable

    reason = hosts_unavailable()
    if reason:
        print(f"benchmarks.suite.hosts cannot make test hosts here: {reason}", file=sys.stderr)
        return 1
    rows = run_hosts_benchmark(args.models, args.links, args.systems, args.quick, args.device)
    print(hosts_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

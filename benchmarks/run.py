"""Run every benchmark, print each table as it completes, write the report.

    python -m benchmarks.run [--quick] [--skip training,memory,...] [--out docs/benchmarks.md] [--json rows.json]

Sections, in the order they run: ``raw`` (the raw gRPC ceiling; from
:mod:`benchmarks.baselines.raw_grpc`), ``transport`` (psframe push+pull; from
:mod:`benchmarks.suite.transport`), ``security`` (what the auth token and TLS
cost per step; from :mod:`benchmarks.suite.security`), ``memory`` (ps memory;
from :mod:`benchmarks.suite.memory`), ``training`` (psframe against
torch.distributed.rpc, TensorFlow's parameter server, DDP and one process; from
:mod:`benchmarks.suite.training`),
``scaling`` (throughput and the servers' CPU per request against the number of
workers; from :mod:`benchmarks.suite.scaling`), ``sparse`` (embedding tables: step
time against table size, rows against moving the table whole, the ps tasks'
memory of a 10^7-row table with Adagrad; from :mod:`benchmarks.suite.sparse`; and
the CTR example's samples/s and AUC, from :mod:`benchmarks.suite.ctr`), ``hosts`` (psframe and its
peers on test hosts made of network namespaces, links capped at 100 Mbit/s and 1 Gbit/s
and uncapped, against each link's limit; from :mod:`benchmarks.suite.hosts`; needs root).
A section that fails is reported (in the report and on stderr) and the others
still run; the exit code is then 1. ``--quick`` is a smoke test: 4 KiB and
320 KiB only, few repeats, one small memory case, training's and scaling's
quick modes on ``mnist_mlp`` only (scaling with 1 and 2 workers), the CTR
example's tasks started without ``psframe launch``, and every Python child
forked from one process that imported torch and psframe once
(:func:`benchmarks.children.forked_children`), not started afresh.
"""

from __future__ import annotations

import os

# One compute thread per process, set before torch is imported (children inherit it).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse
import datetime
import faulthandler
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

from benchmarks.children import forked_children
from benchmarks.common import ROOT, Settings, single_thread

SECTIONS = ("raw", "transport", "security", "memory", "training", "scaling", "sparse", "hosts")
TRAINING_MODELS = ("mnist_mlp", "large_mlp")
# Training runs every system this many times per model, interleaved (the
# median run is reported): other work on the machine that comes and goes then
# weighs on all. An MNIST run takes seconds, and on a shared 2-core machine two
# systems' runs minutes apart differ by 15% either way for no reason of their
# own: five pairs steady the median ratio that three do not.
TRAINING_REPEATS = {"mnist_mlp": 5, "large_mlp": 3}
BACKSTOP_S = 120.0  # beyond a section's --timeout, before the run is aborted
# Sections given more than --timeout (outside quick mode): training runs its nine
# rows 5 + 3 times, and each tf_ps run starts three TensorFlow processes.
TIMEOUT_SCALE = {"training": 1.7}
BUSY_LOAD_PER_CORE = 0.25  # warn when other work already loads the machine this much


def run_training(quick: bool, timeout: float) -> list[dict]:
    """:func:`benchmarks.suite.training.run_training_benchmarks`: every model, or the first in quick mode."""
    from benchmarks.suite.training import run_training_benchmarks

    models = TRAINING_MODELS[:1] if quick else TRAINING_MODELS
    return list(
        run_training_benchmarks(models=models, quick=quick, timeout=timeout, repeats=1 if quick else TRAINING_REPEATS)
    )


def run_scaling(quick: bool, timeout: float) -> list[dict]:
    """:func:`benchmarks.suite.scaling.run_scaling_benchmarks`: every model, or the first in quick mode."""
    from benchmarks.suite import scaling

    models = scaling.MODEL_NAMES[:1] if quick else scaling.MODEL_NAMES
    return scaling.run_scaling_benchmarks(models, quick=quick, timeout=timeout)


def run_all(quick: bool, skip: set[str], timeout: float, command: str) -> dict:
    """Run the sections not in ``skip``; print each table as soon as it is done.

    Returns:
        The results for :func:`benchmarks.report.write_report`: ``raw``,
        ``transport``, ``security``, ``memory``, ``training``, ``scaling`` (row lists, None if not run),
        ``errors`` (section -> message), ``skipped``, ``command``, ``date``,
        ``seconds``, ``quick``, ``settings``, ``load_before``, ``load_after``
        (the 1/5/15-minute load averages: other work on the machine skews the numbers).
    """
    from benchmarks import report

    settings = Settings.for_mode(quick)
    results: dict = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": quick,
        "settings": settings.describe(),
        "errors": {},
        "skipped": sorted(skip),
        **{section: None for section in SECTIONS},
    }
    results["load_before"] = _load_average()
    cores = os.cpu_count() or 1
    if results["load_before"] and results["load_before"][0] > BUSY_LOAD_PER_CORE * cores:
        print(
            f"[bench] warning: the machine is busy (load average {results['load_before'][0]:.1f} on "
            f"{cores} cores); numbers will be lower and noisier than on a quiet machine",
            file=sys.stderr,
            flush=True,
        )
    start = time.monotonic()

    def raw() -> list[dict]:
        from benchmarks.baselines.raw_grpc import run_raw_benchmarks

        return run_raw_benchmarks(settings, timeout=timeout)

    def transport() -> list[dict]:
        from benchmarks.suite.transport import add_ratios, run_transport_benchmarks

        return add_ratios(run_transport_benchmarks(settings, timeout=timeout), results["raw"] or [])

    def security() -> list[dict]:
        from benchmarks.suite.security import run_security_benchmarks

        return run_security_benchmarks(settings, timeout=timeout)

    def memory() -> list[dict]:
        from benchmarks.suite.memory import run_memory_benchmarks

        return run_memory_benchmarks(quick=quick, timeout=timeout)

    def section_timeout(section: str) -> float:
        return timeout if quick else timeout * TIMEOUT_SCALE.get(section, 1.0)

    def training() -> list[dict]:
        return run_training(quick, section_timeout("training"))

    def scaling() -> list[dict]:
        return run_scaling(quick, timeout)

    def sparse() -> list[dict]:
        from benchmarks.suite.sparse import run_sparse_benchmarks

        return run_sparse_benchmarks(quick=quick, timeout=timeout)

    def hosts() -> list[dict]:
        from benchmarks.suite.hosts import run_hosts_benchmark

        models = ("mnist_mlp",) if quick else ("mnist_mlp", "large_mlp")
        links = (100,) if quick else (100, 1000, 0)
        return run_hosts_benchmark(models, links, quick=quick)

    # --quick forks each Python child from one process that imported torch and psframe once
    # (benchmarks.children.forked_children): their start-up was most of a quick run's CPU.
    with forked_children(quick):
        for section, run in (
            ("raw", raw),
            ("transport", transport),
            ("security", security),
            ("memory", memory),
            ("training", training),
            ("scaling", scaling),
            ("sparse", sparse),
            ("hosts", hosts),
        ):
            if section in skip:
                continue
            t = time.monotonic()
            print(f"[bench] {section}...", file=sys.stderr, flush=True)
            # Backstop: every wait inside has a deadline, but should one not hold,
            # print where it hangs and exit (children stop on their own --timeout).
            faulthandler.dump_traceback_later(section_timeout(section) + BACKSTOP_S, exit=True)
            try:
                results[section] = run()
            except Exception as e:  # noqa: BLE001 - a failed section is reported, the rest still run
                traceback.print_exc()
                results["errors"][section] = f"{type(e).__name__}: {e}".splitlines()[0]
                print(f"[bench] {section} FAILED: {e}", file=sys.stderr, flush=True)
                continue
            finally:
                faulthandler.cancel_dump_traceback_later()
            print(report.section_text(section, results[section]), flush=True)
            print(f"[bench] {section} took {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    results["seconds"] = time.monotonic() - start
    results["load_after"] = _load_average()
    return results


def _load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def parse_skip(text: str) -> set[str]:
    skip = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(skip - set(SECTIONS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; expected some of {', '.join(SECTIONS)}")
    return skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; 0 if every section that ran succeeded, else 1."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: small sizes, few repeats, training and scaling quick modes on mnist_mlp, "
        "children forked from one process that imported torch and psframe",
    )
    parser.add_argument(
        "--skip", type=parse_skip, default=set(), help=f"comma-separated sections not to run: {','.join(SECTIONS)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "benchmarks.md",
        help="the report to write (the plots go beside it: .png and -scaling.png)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1200.0,
        help="deadline of each section in seconds (training's timeout too; "
        "training gets 1.7 times this outside --quick)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write every section's rows (and the run's details) to this file"
    )
    args = parser.parse_args(argv)
    single_thread()
    command = "OMP_NUM_THREADS=1 python -m benchmarks.run" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )
    results = run_all(args.quick, args.skip, args.timeout, command)

    from benchmarks import report

    md, png = report.write_report(results, args.out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    scaling_png = f" and {md.parent / report.scaling_png_name(png.name)}" if results.get("scaling") else ""
    print(f"[bench] wrote {md}, {png}{scaling_png} in {results['seconds']:.0f} s", file=sys.stderr)
    if results["errors"]:
        print(f"[bench] failed sections: {', '.join(results['errors'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CTR example's throughput in DeepRec's published shape, and a ps task's row rate against raw torch.

    python -m benchmarks.ctr [--quick] [--profile]

Prints, in one run on this machine:

1. the cores: ``os.cpu_count()``, those usable here, and the compute threads
   each process is given (one);
2. :mod:`benchmarks.suite.ctr_throughput`'s table: samples/s and held-out
   AUC of ``examples/ctr_dist.py`` at batch 512 (13 dense and 26
   categorical features), one process against 1 ps + 1 and 1 ps + 2
   workers, with fixed (hashed) and dynamic tables;
3. :mod:`benchmarks.suite.row_rate`'s table: a ps task's rows per
   core-second reading rows and updating them with Adagrad, in process and
   over gRPC (ps CPU per row), against raw torch's; with ``--profile``,
   cProfile's view of psframe's in-process paths.

``--quick`` is a smoke test: 40 global steps per run, short repeats.
"""

from __future__ import annotations

import os

# One compute thread per process, set before torch is imported (children inherit it).
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse
import sys

import psframe
from benchmarks.children import forked_children
from benchmarks.suite.ctr_throughput import cores_note, ctr_throughput_table, run_ctr_throughput
from benchmarks.suite.row_rate import profile_paths, row_rate_table, run_row_rate_benchmarks

# The captions above the two tables (tests find the tables by them).
THROUGHPUT_CAPTION = "The CTR example at batch 512: samples/s and held-out AUC"
ROW_RATE_CAPTION = "A ps task's rows per core-second against raw torch's"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ctr", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 40 global steps per run, short repeats")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's view of psframe's row paths")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline of each of the two parts, in seconds")
    args = parser.parse_args(argv)
    psframe.tune_process()  # as psframe's own entry points do: this process is the row rate's worker
    print(cores_note(), flush=True)
    with forked_children(args.quick):  # --quick: children forked from one that imported torch and psframe
        throughput = run_ctr_throughput(args.quick, args.timeout)
        print(f"\n{THROUGHPUT_CAPTION}:\n\n" + ctr_throughput_table(throughput), flush=True)
        rows = run_row_rate_benchmarks(args.quick, args.timeout)
    print(f"\n{ROW_RATE_CAPTION}:\n\n" + row_rate_table(rows), flush=True)
    if args.profile:
        print("\n" + profile_paths(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

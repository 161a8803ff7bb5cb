"""What counting steps ahead costs each asynchronous step-ending push, with no staleness bound set.

    python -m benchmarks.experiments.staleness_count [--workers 2] [--number 200000]

A ps task counts, at every push that ends a worker's step, how far ahead of the
slowest other live worker it finds that worker (``StalenessGate.count``, the
histogram of ``psframe status``), bound or not, under the store's lock. This
times that call on a gate of ``--workers`` live workers, in one process, and
prints it in microseconds and as a ratio against two baselines timed in the
same run: an empty Python call, and the push ledger's ``record`` (which every
push makes under the same lock).
"""

from __future__ import annotations

import argparse
import timeit

from psframe.ps.protocol.ledger import PushLedger
from psframe.ps.protocol.roster import WorkerRoster
from psframe.ps.protocol.staleness import StalenessGate


def _nothing(worker: int) -> int:
    return worker


def per_call_us(call, number: int) -> float:
    """Microseconds one call takes (the best of five timings of ``number`` calls)."""
    return min(timeit.repeat(lambda: call(1), number=number, repeat=5)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args(argv)
    ledger = PushLedger(args.workers)
    gate = StalenessGate(ledger, WorkerRoster(args.workers, worker_timeout=60.0), "/job:ps/task:0")
    push_ids = iter(range(1, 1 << 62))
    empty = per_call_us(_nothing, args.number)
    record = per_call_us(lambda w: ledger.record(w, next(push_ids), True), args.number)
    count = per_call_us(gate.count, args.number)
    print(f"{args.workers} live workers, no bound")
    print(f"empty call      {empty:7.3f} us")
    print(f"ledger.record   {record:7.3f} us")
    print(f"gate.count      {count:7.3f} us  ({count / empty:.1f}x an empty call, {count / record:.2f}x a record)")


if __name__ == "__main__":
    main()

"""A ps task's own CPU per PushPull request, without gRPC: what psframe adds above the transport.

    python -m benchmarks.experiments.handler_cpu [--requests 3000]
    python -m benchmarks.experiments.handler_cpu --before /tmp/before [--pairs 30] [--block 100]

One ps service in this process holds the MNIST MLP's four variables with SGD;
its data plane (:class:`psframe.ps.service.push_pull_handler.PushPullHandler`)
answers requests given as bytes, as its gRPC stream hands them over:

- **async**: one worker's dense step requests, one at a time, on one stream
  (the cached path from the second request on);
- **sync**: two workers' threads, each sending its step's request, in rounds
  of two (the barrier, the round's sum and step, the shared reply).

It prints the CPU (``time.thread_time``) per request, the request's encoding
by the test's "worker" excluded, and the thread CPU of a plain copy of the
request's bytes for scale. The scaling benchmark's *server CPU ms/request*
(:mod:`benchmarks.suite.scaling`) is this plus gRPC's own work on the ps.

With ``--before TREE`` it compares a source tree before a change (``git
worktree add /tmp/before <commit>``) with this one, on a machine other work
shares: each tree's handler runs in a child process of its own (the tree's
``psframe`` first on ``sys.path``), and the two answer blocks of
``--block`` requests in turn, ``--pairs`` times, so that a slow spell falls
on both alike. It prints each tree's median CPU per request and the median of
the pairs' ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import psframe
from psframe.cluster import ClusterSpec
from psframe.ps.service import ParameterServerService
from psframe.ps.service.push_pull_handler import StreamCache
from psframe.wire import codec, encoding
from psframe.wire import psframe_pb2 as pb

SHAPES = {"0.weight": (100, 784), "0.bias": (100,), "2.weight": (10, 100), "2.bias": (10,)}
CLUSTER = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]})
WARMUP = 200


def _service(sync: bool) -> ParameterServerService:
    service = ParameterServerService(CLUSTER, 0)
    service.store.create({n: torch.zeros(s) for n, s in SHAPES.items()}, psframe.optim.SGD(lr=0.01))
    if sync:
        service._start_sync(pb.SyncDef(replicas_to_aggregate=2, total_num_replicas=2, timeout_seconds=60.0))
    return service


def _requests(worker: int, count: int, sync: bool, first: int = 1) -> list[bytes]:
    """Pushes ``first`` .. ``first + count - 1`` of a worker (a sync push of step ``push_id - 1``)."""
    caller = pb.Caller(job_name="worker", task_index=worker, cluster_fingerprint=CLUSTER.fingerprint)
    grads = [(n, torch.full(s, 1e-3)) for n, s in SHAPES.items()]
    return [
        codec.encode(
            pb.PushPullHeader(caller=caller, push_id=i, step=i - 1 if sync else 0, pull=list(SHAPES), end_of_step=True),
            grads,
        )
        for i in range(first, first + count)
    ]


class Handler:
    """One ps service and its workers' streams, answering blocks of requests; the steps go on
    from one block to the next."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.service = _service(sync)
        self.workers = (0, 1) if sync else (0,)
        self._caches = {w: StreamCache() for w in self.workers}
        self._sent = 0  # requests each worker sent

    def block(self, count: int) -> float:
        """Thread CPU per request answered, in microseconds (the mean over the workers), for
        ``count`` requests of each worker encoded beforehand.

        Raises:
            RuntimeError: a request was refused, or a round not applied.
        """
        requests = {w: _requests(w, count, self.sync, first=self._sent + 1) for w in self.workers}
        self._sent += count
        expected = self._sent * (1 if self.sync else len(self.workers))
        start_together = threading.Barrier(len(self.workers))
        spent: dict[int, float] = {}
        errors: list[str] = []

        def worker(index: int) -> None:
            cache = self._caches[index]
            start_together.wait(60)
            start = time.thread_time()
            for data in requests[index]:
                reply = self.service.push_pulls.reply(data, cache)
            spent[index] = time.thread_time() - start
            header = encoding.parse(reply, pb.PushPullReplyHeader).header
            if header.error_class or header.global_step != expected:
                what = f"{header.error_class} {header.error_message}" if header.error_class else header.global_step
                errors.append(f"worker {index}: {what} (global step {expected} expected)")

        threads = [threading.Thread(target=worker, args=(w,)) for w in self.workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        if len(spent) != len(self.workers) or errors:
            raise RuntimeError(
                f"not every request was answered as the experiment expects: {errors or 'a thread ran out of time'}"
            )
        return sum(spent.values()) / (len(self.workers) * count) * 1e6


def cpu_per_request_us(sync: bool, count: int) -> float:
    """Thread CPU per request answered after the warm-up, in microseconds (the mean over the workers)."""
    handler = Handler(sync)
    handler.block(WARMUP)
    return handler.block(count)


def copy_us(count: int) -> float:
    """Thread CPU of one copy of a request's bytes, in microseconds (for scale)."""
    data = _requests(0, 1, False)[0]
    start = time.thread_time()
    for _ in range(count):
        bytes(bytearray(data))
    return (time.thread_time() - start) / count * 1e6 / 2  # two copies a round


# One tree's handler in a child process: this file, loaded with the tree's psframe first on
# sys.path, answers a block of requests for every line it reads, and prints its CPU per request.
_CHILD = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("handler_cpu", sys.argv[2])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.torch.set_num_threads(1)
handler = module.Handler(sys.argv[3] == "sync")
handler.block(module.WARMUP)
print("ready", flush=True)
for line in sys.stdin:
    print(handler.block(int(line)), flush=True)
"""


def compare(before: Path, after: Path, sync: bool, pairs: int, block: int) -> dict[str, list[float]]:
    """CPU per request of each tree's handler, block by block, the two trees in turn (in a random
    order each pair): ``{"before": [...], "after": [...]}``."""
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tree.resolve()), __file__, "sync" if sync else "async"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        for name, tree in (("before", before), ("after", after))
    }
    runs: dict[str, list[float]] = {name: [] for name in children}
    try:
        for child in children.values():
            if child.stdout is None or child.stdout.readline().strip() != "ready":
                raise RuntimeError("a tree's handler did not start")
        for _ in range(pairs):
            for name in random.sample(list(children), len(children)):
                child = children[name]
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{block}\n")
                child.stdin.flush()
                runs[name].append(float(child.stdout.readline()))
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per worker")
    parser.add_argument("--before", type=Path, help="compare with this source tree (see the module)")
    parser.add_argument("--pairs", type=int, default=30, help="with --before: blocks of each tree, taken in turn")
    parser.add_argument("--block", type=int, default=100, help="with --before: requests per worker in a block")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = len(_requests(0, 1, False)[0])
    print(f"the MNIST MLP's request: {size / 1024:.1f} KiB each way; CPU per request, in process, no gRPC")
    if args.before is None:
        print(f"async (cached path)  {cpu_per_request_us(False, args.requests):7.1f} us")
        print(f"sync (rounds of 2)   {cpu_per_request_us(True, args.requests):7.1f} us")
        print(f"one copy of it       {copy_us(args.requests):7.1f} us")
        return
    here = Path(__file__).resolve().parents[2]
    print(f"before: {args.before}, after: {here}; medians of {args.pairs} blocks of {args.block} requests each")
    for sync, what in ((False, "async (cached path)"), (True, "sync (rounds of 2)  ")):
        runs = compare(args.before, here, sync, args.pairs, args.block)
        ratio = statistics.median(a / b for a, b in zip(runs["after"], runs["before"]))
        print(
            f"{what}  before {statistics.median(runs['before']):7.1f} us  after "
            f"{statistics.median(runs['after']):7.1f} us  after/before {ratio:.2f}"
        )


if __name__ == "__main__":
    main()

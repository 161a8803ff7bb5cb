"""A ps task's own CPU per PushPull request, without gRPC: what psframe adds above the transport.

    python -m benchmarks.experiments.handler_cpu [--requests 3000]

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
"""

from __future__ import annotations

import argparse
import threading
import time

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


def _requests(worker: int, count: int, sync: bool) -> list[bytes]:
    caller = pb.Caller(job_name="worker", task_index=worker, cluster_fingerprint=CLUSTER.fingerprint)
    grads = [(n, torch.full(s, 1e-3)) for n, s in SHAPES.items()]
    return [
        codec.encode(
            pb.PushPullHeader(caller=caller, push_id=i, step=i - 1 if sync else 0, pull=list(SHAPES), end_of_step=True),
            grads,
        )
        for i in range(1, count + 1)
    ]


def cpu_per_request_us(sync: bool, count: int) -> float:
    """Thread CPU per request answered after the warm-up, in microseconds (the mean over the workers)."""
    service = _service(sync)
    workers = (0, 1) if sync else (0,)
    spent: dict[int, float] = {}
    errors: list[str] = []

    def worker(index: int, requests: list[bytes]) -> None:
        cache = StreamCache()
        for data in requests[:WARMUP]:
            service.push_pulls.reply(data, cache)
        start = time.thread_time()
        for data in requests[WARMUP:]:
            reply = service.push_pulls.reply(data, cache)
        spent[index] = time.thread_time() - start
        header = encoding.parse(reply, pb.PushPullReplyHeader).header
        if header.error_class or header.global_step != len(requests) * (1 if sync else len(workers)):
            errors.append(
                f"worker {index}: {header.error_class or 'global step'} {header.error_message or header.global_step}"
            )

    threads = [threading.Thread(target=worker, args=(w, _requests(w, count + WARMUP, sync))) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    if len(spent) != len(workers) or errors:
        raise RuntimeError(
            f"not every request was answered as the experiment expects: {errors or 'a thread ran out of time'}"
        )
    return sum(spent.values()) / (len(workers) * count) * 1e6


def copy_us(count: int) -> float:
    """Thread CPU of one copy of a request's bytes, in microseconds (for scale)."""
    data = _requests(0, 1, False)[0]
    start = time.thread_time()
    for _ in range(count):
        bytes(bytearray(data))
    return (time.thread_time() - start) / count * 1e6 / 2  # two copies a round


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per worker")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    size = len(_requests(0, 1, False)[0])
    print(f"the MNIST MLP's request: {size / 1024:.1f} KiB each way; CPU per request, in process, no gRPC")
    print(f"async (cached path)  {cpu_per_request_us(False, args.requests):7.1f} us")
    print(f"sync (rounds of 2)   {cpu_per_request_us(True, args.requests):7.1f} us")
    print(f"one copy of it       {copy_us(args.requests):7.1f} us")


if __name__ == "__main__":
    main()

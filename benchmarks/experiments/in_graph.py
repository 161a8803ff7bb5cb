"""In-graph against between-graph replication: the same synchronous training, two ways.

    python -m benchmarks.experiments.in_graph [--steps 300] [--batch 100] [--replicas 2] [--runs 3]

One ps task (``psframe server``, a process of its own) and the MNIST MLP on
synthetic data, synchronous, each update averaging ``--replicas`` batches of
``--batch`` examples:

- **between-graph**: ``--replicas`` worker processes, one replica each
  (``SyncReplicas(replicas_to_aggregate=N)``);
- **in-graph**: one worker process driving ``--replicas`` CPU replicas
  (``Trainer(replica_devices=["cpu"] * N)``), their gradients averaged in the
  process and pushed once;
- **one replica**: one worker, one replica, batches of ``N x --batch`` (the
  same examples an update, no replication at all): the baseline.

It prints, for each, global steps/s and the CPU every process used per
global step between the chief's warm-up and its end (the workers' own
count, the ps task's from ``/proc``), and the ratios against one replica, as
the median of ``--runs`` runs taken in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.children import start_process
from psframe.launch import pick_free_ports

_WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
import psframe
spec, index, replicas, batch, steps, workers = sys.argv[1], *map(int, sys.argv[2:7])
cluster = psframe.ClusterSpec.from_string(spec)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
trainer = psframe.Trainer(model, cluster, task_index=index, optimizer=psframe.optim.SGD(lr=0.1),
                          sync=psframe.SyncReplicas(replicas_to_aggregate=workers, timeout=120.0),
                          replica_devices=["cpu"] * replicas if replicas > 1 else None)
g = torch.Generator().manual_seed(index)
xs = [torch.randn(batch, 784, generator=g) for _ in range(replicas)]
ys = [torch.randint(0, 10, (batch,), generator=g) for _ in range(replicas)]
with trainer:
    start = None
    while trainer.global_step < steps:
        if trainer.global_step >= WARMUP and start is None:
            print("START", flush=True)
            start, cpu, first = time.perf_counter(), time.process_time(), trainer.global_step
        losses = [torch.nn.functional.cross_entropy(r(x), y) for r, x, y in zip(trainer.replicas, xs, ys)]
        trainer.step(losses if replicas > 1 else losses[0])
    result = {"steps": trainer.global_step - first, "seconds": time.perf_counter() - start,
              "cpu": time.process_time() - cpu}
    print("END " + json.dumps(result), flush=True)
""".replace("WARMUP", "20")


def _process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) process ``pid`` has used, from ``/proc``."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(kind: str, replicas: int, batch: int, steps: int) -> dict[str, float]:
    """One run of ``kind``: global steps/s (the chief's) and CPU ms a global step, over every process,
    both between the chief's warm-up and its last step."""
    workers = replicas if kind == "between-graph" else 1
    in_process = replicas if kind == "in-graph" else 1
    per_replica = batch * replicas if kind == "one replica" else batch
    ports = pick_free_ports(1 + workers)
    spec = f"ps|127.0.0.1:{ports[0]},worker|{';'.join(f'127.0.0.1:{p}' for p in ports[1:])}"
    env = {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    server = [sys.executable, "-m", "psframe.cli", "server", f"--cluster_spec={spec}", "--job_name=ps"]
    ps = start_process(
        [*server, "--task_index=0", "--serving_processes=1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    procs = [
        start_process(
            [sys.executable, "-c", _WORKER, spec, str(i), str(in_process), str(per_replica), str(steps), str(workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        ends = []
        ps_cpu = 0.0
        for proc in procs:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("START") and proc is procs[0]:
                    ps_cpu = -_process_cpu(ps.pid)
                elif line.startswith("END "):
                    if proc is procs[0]:
                        ps_cpu += _process_cpu(ps.pid)
                    ends.append(json.loads(line[4:]))
                    break
        for proc in [*procs, ps]:
            proc.wait(timeout=120)
    finally:
        for proc in [*procs, ps]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    chief = ends[0]
    cpu = ps_cpu + sum(end["cpu"] for end in ends)
    return {"steps_per_s": chief["steps"] / chief["seconds"], "cpu_ms_per_step": 1e3 * cpu / chief["steps"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    kinds = ("one replica", "between-graph", "in-graph")
    results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind in kinds:
            results[kind].append(run(kind, args.replicas, args.batch, args.steps))
    base = statistics.median(r["steps_per_s"] for r in results["one replica"])
    print(
        f"sync MNIST MLP, {args.replicas} x {args.batch} examples an update, {args.steps} global steps, "
        f"median of {args.runs} ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})"
    )
    print(f"{'how':<14} {'steps/s':>8} {'vs one replica':>15} {'CPU ms/step':>12}")
    for kind in kinds:
        rate = statistics.median(r["steps_per_s"] for r in results[kind])
        cpu = statistics.median(r["cpu_ms_per_step"] for r in results[kind])
        print(f"{kind:<14} {rate:>8.1f} {rate / base:>14.2f}x {cpu:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

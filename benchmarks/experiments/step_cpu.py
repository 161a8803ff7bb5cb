"""Process CPU per training step, before and after a change: two source trees, in alternating pairs.

    git worktree add /tmp/before <commit>
    python -m benchmarks.experiments.step_cpu /tmp/before . [--pairs 5] [--steps 4000]

Each run is one process holding a ps task (``psframe.Server`` on a free
loopback port) and a worker (``psframe.Trainer``) training the MNIST MLP on
one fixed batch, single-threaded: the whole step path in one process (the
worker's encoding, the transport, the ps's decoding, its optimizer step and
its reply), with nothing else to share the CPU with. It reports the process
CPU (``time.process_time``) per step after a warm-up, for each tree, as the
median of ``--pairs`` runs taken in turn (before, after, before, ...), so
that a slow spell of the machine falls on both alike.

Each tree's ``psframe`` is imported from the tree itself (it goes first on
``sys.path``); both must have ``psframe.Trainer``, ``psframe.Server`` and
``psframe.optim.SGD``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# One run, in a child process of its own (the tree's psframe goes first on sys.path).
_RUN = r"""
import json, os, socket, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import psframe
if hasattr(psframe, "tune_process"):
    psframe.tune_process()
steps = int(sys.argv[2])
ports = []
for _ in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); ports.append(s.getsockname()[1]); s.close()
cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"]})
server = psframe.Server(cluster, "ps", 0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
x, y = torch.rand(64, 784), torch.randint(0, 10, (64,))
with psframe.Trainer(model, cluster, task_index=0, optimizer=psframe.optim.SGD(lr=0.01)) as trainer:
    for _ in range(200):
        trainer.step(torch.nn.functional.cross_entropy(model(x), y))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        trainer.step(torch.nn.functional.cross_entropy(model(x), y))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
server.stop(grace=0.5)
print(json.dumps({"cpu_ms_per_step": 1000 * cpu / steps, "wall_ms_per_step": 1000 * wall / steps}))
"""


def run_once(tree: Path, steps: int, timeout: float) -> dict:
    """One run of the step path with ``tree``'s psframe: its CPU and wall ms per step."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", _RUN, str(tree.resolve()), str(steps)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the source tree before the change")
    parser.add_argument("after", type=Path, help="the source tree after it")
    parser.add_argument("--pairs", type=int, default=5, help="runs of each tree, taken in turn")
    parser.add_argument("--steps", type=int, default=4000, help="timed steps per run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.pairs):
        for name, tree in (("before", args.before), ("after", args.after)):
            runs[name].append(run_once(tree, args.steps, args.timeout)["cpu_ms_per_step"])
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    for name, values in runs.items():
        print(f"{name:>6}: {statistics.median(values):.3f} ms CPU/step (runs: {', '.join(f'{v:.3f}' for v in values)})")
    print(f" ratio: {after / before:.3f} (after / before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

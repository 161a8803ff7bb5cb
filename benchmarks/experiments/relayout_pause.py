"""How long a live re-layout pauses training, against a checkpoint of the same model.

    python -m benchmarks.experiments.relayout_pause [--sizes 4,32,128] [--runs 3]

For each model size (MB of float32 values; Adam keeps twice as much state), two
ps tasks in this process train it with one worker; a third ps task is added
(``Trainer.reshard``) and then drained again. Each re-layout reports the
seconds training paused: from the cut until the new layout held the model.
The baseline, measured in the same run on the same ps tasks: the chief saving a
checkpoint of the model (``Trainer.save_checkpoint`` into a local folder). A
re-layout through a checkpoint (the way without this: save, stop, start with
the new ps tasks, restore) costs at least that save and as long a restore,
plus the restart.

It prints, per size, the median of ``--runs`` adds, drains and saves, the
ratio of each pause to the save, and the add's pause against one step per
part of the grown layout (the step: the median of a few before the add).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import psframe
from psframe.launch import pick_free_ports

MiB = 1 << 20


class Wide(torch.nn.Module):
    """One weight of about ``mb`` MB, partitioned among the ps tasks, and a loss of known gradient."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(max(1, mb * MiB // (4 * 1024)), 1024))

    def loss(self) -> torch.Tensor:
        return 1e-3 * self.w.sum()


def measure(mb: int, folder: str) -> tuple[float, float, float, float, int]:
    """One run: the pause of an add, of a drain, the seconds of a checkpoint save, of a step
    (the median of a few), and the parts the grown layout holds."""
    ports = pick_free_ports(4)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:2]], "worker": [f"127.0.0.1:{ports[3]}"]})
    grown = psframe.ClusterSpec(
        {"ps": [*cluster.job_tasks("ps"), f"127.0.0.1:{ports[2]}"], "worker": cluster.job_tasks("worker")}
    )
    servers = [psframe.Server(cluster, "ps", k, serving_processes=1, checkpoint_dir=folder) for k in range(2)]
    servers.append(psframe.Server(grown, "ps", 2, serving_processes=1, checkpoint_dir=folder))
    try:
        with psframe.Trainer(
            Wide(mb),
            cluster,
            optimizer=psframe.optim.Adam(lr=1e-3),
            placement=psframe.Placement(min_partition_bytes=MiB),
            checkpointing=psframe.Checkpointing(folder, save_steps=10**9),
        ) as t:
            steps = []
            for _ in range(5):
                begun = time.monotonic()
                t.step(t.model.loss())
                steps.append(time.monotonic() - begun)
            added = t.reshard(grown)
            parts = len(t.placement.shards)
            t.step(t.model.loss())
            drained = t.reshard(cluster)
            t.step(t.model.loss())
            start = time.monotonic()
            t.save_checkpoint()
            saved = time.monotonic() - start
    finally:
        for server in servers:
            server.stop(grace=0.1)
    return added, drained, saved, statistics.median(steps[1:]), parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,32,128", help="model sizes in MB (values; Adam state is twice that)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{'model':>8} {'add (s)':>9} {'drain (s)':>10} {'save (s)':>9} {'add/save':>9} {'drain/save':>11}"
        f" {'parts':>6} {'step (s)':>9} {'add/(parts x step)':>19}"
    )
    for mb in (int(s) for s in args.sizes.split(",")):
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as folder:
                runs.append(measure(mb, folder))
        added, drained, saved, step = (statistics.median(r[i] for r in runs) for i in range(4))
        parts = runs[0][4]
        print(
            f"{mb:>6}MB {added:>9.3f} {drained:>10.3f} {saved:>9.3f} {added / saved:>8.2f}x {drained / saved:>10.2f}x"
            f" {parts:>6} {step:>9.4f} {added / (parts * step):>18.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

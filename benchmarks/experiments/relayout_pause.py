"""How long a live re-layout pauses training, against a checkpoint of the same model.

    python -m benchmarks.experiments.relayout_pause [--sizes 4,32,128] [--runs 3]
    python -m benchmarks.experiments.relayout_pause --model table --table_parts 48
    python -m benchmarks.experiments.relayout_pause --dense_parts 12

``--model table``: the model is an embedding table of the size (Adagrad: its
state is as large), cut into ``--table_parts`` parts, and a step looks up a
batch of 1,024 ids: a step moves little, a re-layout the whole table.
``--dense_parts``: the dense weight is cut into that many parts whatever the
number of ps tasks (``Placement(dense_parts=...)``): a re-layout moves some
of them whole; without, it is cut into one part per ps task, and every part
is cut anew.

For each model size (MB of float32 values; Adam keeps twice as much state), two
ps tasks (``psframe server`` processes) train it with this process as their one
worker; a third ps task is added and then drained again, each asked as
``psframe reshard`` asks (``relayout_calls.ask_reshard``) while the worker trains. A
re-layout moves the parts in stages (:mod:`psframe.cluster.moves`), each
readied while training goes on (the table parts it moves copied ahead,
:mod:`psframe.ps.elastic.precopy`) and then cut; each stage reports the seconds
training paused, from its cut until the layout after it held the model
(``Trainer.stats.relayout_pauses``).
The baseline, measured in the same run on the same ps tasks: the chief saving a
checkpoint of the model (``Trainer.save_checkpoint`` into a local folder). A
re-layout through a checkpoint (the way without this: save, stop, start with
the new ps tasks, restore) costs at least that save and as long a restore,
plus the restart.

It prints, per size, the medians over ``--runs`` of: the stages of an add and
their pauses together, the same for a drain, the save, the ratio of each
total to the save; then the longest pause of one stage against one step (the
median of a few before the add), and the same per part the stage moved
(``Trainer.stats.relayout_parts_moved``): the bound is one step per moved part, a
ratio of at most 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import psframe
from benchmarks.children import Children
from psframe.launch import pick_free_ports
from psframe.worker.client import relayout_calls
from psframe.worker.client.ps_client import PsClient

MiB = 1 << 20
TIMEOUT_S = 300  # every wait of a run: the ps tasks give up after it too


class Wide(torch.nn.Module):
    """One weight of about ``mb`` MB, partitioned among the ps tasks, and a loss of known gradient."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(max(1, mb * MiB // (4 * 1024)), 1024))

    def loss(self) -> torch.Tensor:
        return 1e-3 * self.w.sum()


class Table(torch.nn.Module):
    """An embedding table of about ``mb`` MB (rows of 64 floats); a loss that looks up a random batch."""

    def __init__(self, mb: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(max(1, mb * MiB // (4 * 64)), 64, sparse=True)
        self.ids = torch.Generator().manual_seed(0)

    def loss(self) -> torch.Tensor:
        return self.emb(torch.randint(0, self.emb.num_embeddings, (1024,), generator=self.ids)).sum()


@dataclass(frozen=True)
class Run:
    """What one run measured (seconds)."""

    added: float  # the pauses of the add's stages together
    drained: float  # of the drain's
    saved: float  # a checkpoint's save of the same model
    step: float  # one step (the median of a few before the add)
    pauses: tuple[float, ...]  # of every stage, the add's then the drain's
    parts: tuple[int, ...]  # the parts each of those stages moved
    add_stages: int

    @property
    def longest(self) -> float:
        return max(self.pauses)

    @property
    def per_part(self) -> float:
        """The longest pause of a stage divided by the parts it moved."""
        return max(p / max(1, n) for p, n in zip(self.pauses, self.parts))


def relayout(t: psframe.Trainer, to: psframe.ClusterSpec) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """Move ``t``'s model to the ps tasks of ``to`` as ``psframe reshard`` asks it: the chief takes
    it at its steps, training on (each stage readied, its table parts copied ahead, while it trains;
    cut at a step after). The pauses of its stages together, each, and the parts each moved."""
    with PsClient(t.cluster, 0, job_name="tool") as tool:
        relayout_calls.ask_reshard(tool, to)
    deadline = time.monotonic() + TIMEOUT_S
    taken = t.stats.relayouts
    while t.stats.relayouts == taken:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the chief did not take the re-layout to {to.job_tasks('ps')} in {TIMEOUT_S} s")
        t.step(t.model.loss())
    return sum(t.stats.relayout_pauses), t.stats.relayout_pauses, t.stats.relayout_parts_moved


def measure(mb: int, folder: str, table_parts: int | None = None, dense_parts: int | None = None) -> Run:
    """One run on ps tasks in processes of their own (``psframe server``), this process their
    worker. ``table_parts``: the model is a :class:`Table` of so many parts; ``dense_parts``:
    the dense weight is cut into so many parts whatever the ps tasks (else one per task)."""
    ports = pick_free_ports(4)
    cluster = psframe.ClusterSpec({"ps": [f"127.0.0.1:{p}" for p in ports[:2]], "worker": [f"127.0.0.1:{ports[3]}"]})
    grown = psframe.ClusterSpec(
        {"ps": [*cluster.job_tasks("ps"), f"127.0.0.1:{ports[2]}"], "worker": cluster.job_tasks("worker")}
    )
    with Children(Path(folder) / "logs") as children:
        for k, spec in ((0, cluster), (1, cluster), (2, grown)):
            children.start(
                f"ps{k}",
                [
                    sys.executable,
                    "-m",
                    "psframe.cli",
                    "server",
                    f"--cluster_spec={spec.to_string()}",
                    "--job_name=ps",
                    f"--task_index={k}",
                    "--serving_processes=1",
                    f"--checkpoint_dir={folder}",
                    f"--timeout={TIMEOUT_S}",
                ],
            )
        with psframe.Trainer(
            Wide(mb) if table_parts is None else Table(mb),
            cluster,
            optimizer=psframe.optim.Adam(lr=1e-3) if table_parts is None else psframe.optim.Adagrad(lr=0.1),
            placement=psframe.Placement(min_partition_bytes=MiB, table_parts=table_parts, dense_parts=dense_parts),
            checkpointing=psframe.Checkpointing(folder, save_steps=10**9),
            transport=psframe.Transport(connect_timeout=TIMEOUT_S),
        ) as t:
            steps = []
            for _ in range(5):
                begun = time.monotonic()
                t.step(t.model.loss())
                steps.append(time.monotonic() - begun)
            added, pauses, parts = relayout(t, grown)
            add_stages = len(pauses)
            drained, drain_pauses, drain_parts = relayout(t, cluster)
            pauses, parts = pauses + drain_pauses, parts + drain_parts
            t.step(t.model.loss())
            start = time.monotonic()
            t.save_checkpoint()
            saved = time.monotonic() - start
        for k in range(3):  # the job is done: they stop (ps 2 was drained)
            children.wait_exit(f"ps{k}", 30)
    return Run(added, drained, saved, statistics.median(steps[1:]), pauses, parts, add_stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,32,128", help="model sizes in MB (values; Adam state is twice that)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", choices=["dense", "table"], default="dense", help="a dense weight, or a table")
    parser.add_argument("--table_parts", type=int, default=48, help="with --model table: the table's parts")
    parser.add_argument(
        "--dense_parts", type=int, default=None, help="with --model dense: its parts whatever the ps tasks"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"{'model':>8} {'add stages':>11} {'add (s)':>8} {'drain stages':>13} {'drain (s)':>10} {'save (s)':>9}"
        f" {'add/save':>9} {'drain/save':>11} {'step (s)':>9} {'longest stage (s)':>18} {'longest/step':>13}"
        f" {'per part/step':>14}"
    )
    for mb in (int(s) for s in args.sizes.split(",")):
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as folder:
                table = args.model == "table"
                runs.append(
                    measure(mb, folder, args.table_parts if table else None, None if table else args.dense_parts)
                )

        def median(of: Callable[[Run], float], runs: list[Run] = runs) -> float:
            return statistics.median(of(r) for r in runs)

        added, drained, saved, step = (
            median(lambda r, f=f: getattr(r, f)) for f in ("added", "drained", "saved", "step")
        )
        add_stages, stages = median(lambda r: r.add_stages), median(lambda r: len(r.pauses))
        longest, per_part = median(lambda r: r.longest / r.step), median(lambda r: r.per_part / r.step)
        print(
            f"{mb:>6}MB {add_stages:>11.0f} {added:>8.3f} {stages - add_stages:>13.0f} {drained:>10.3f} {saved:>9.3f}"
            f" {added / saved:>8.2f}x {drained / saved:>10.2f}x {step:>9.4f} {median(lambda r: r.longest):>18.3f}"
            f" {longest:>12.2f}x {per_part:>13.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

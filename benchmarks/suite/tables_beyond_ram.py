"""Tables beyond RAM: a dynamic table of ten times its ps task's RAM budget, against the same job
with the table all in RAM, in one run.

    python -m benchmarks.suite.tables_beyond_ram [--quick] [--rows N] [--steps T]

One ps task (``psframe server``, a process of its own) and one worker (this
process) train a model of one dynamic table (16 floats a row, Adagrad, rows
made constant: an initializer that draws would cost more than the job) whose
bags of 26 ids per sample feed a linear head, in batches of 512 samples:

1. *fill*: every one of ``--rows`` ids is looked up once, in order (a
   batch's 13,312 ids a step), so the table holds them all;
2. *train*: ``--steps`` steps of ids drawn from a power law (zipf(1.1) over
   the ids' ranks, the same draws in both jobs), each step prefetching the
   next batch's rows (``Trainer.prefetch``), as the CTR example does.

The two jobs: **in RAM** (no budget) and **disk tier**
(``DynamicEmbedding(ram_budget=...)``, a tenth of the table's bytes: each
row's 64 bytes, its 64 bytes of Adagrad sums and its bookkeeping). Columns:

- *samples/s*: of the train phase, and *vs in RAM*, its ratio to the in-RAM job's;
- *ps anon peak*, *ps file peak*: the ps task's largest anonymous memory (its own:
  tensors, Python) and file-backed memory (pages of LMDB's mapped file, the
  kernel's to drop) seen, sampled every 20 ms from ``/proc``; *fixed*: its
  anonymous memory once serving, before the model, the overhead the budget sits on;
- *on disk*: rows beyond the RAM tier at the end (``psframe status``'s count);
- *ps CPU s/s* and *disk busy*: the ps task's CPU seconds per second of the
  train phase, and the share of it the disk holding the rows was busy
  (``/proc/diskstats``), which tell what bounds the tiered job;
- *rows identical*: every row the train phase touched and a sample of the
  others, read back from both jobs (an evaluation's lookups), compared bit
  for bit, and the head too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy
import psutil
import torch
import torch.nn.functional as F

import psframe
from benchmarks.children import Children
from benchmarks.common import BenchmarkError, Deadline, single_thread
from benchmarks.formatting import format_bytes, format_number, format_ratio, markdown_table
from benchmarks.suite.ps_cluster import PsCluster
from benchmarks.suite.psframe_internals import control_calls, tool_client

DIM = 16
FEATURES = 26
BATCH = 512
SLOT_BYTES = DIM * 4 * 2 + 5 * 8 + 1 + 16  # a row, Adagrad's sums, bookkeeping, its id index entry
BUDGET_SHARE = 10  # the table is this many times its RAM budget
FULL = {"rows": 4_000_000, "steps": 300}
QUICK = {"rows": 100_000, "steps": 30}
SAMPLE = 20_000  # rows of the fill phase compared, besides every row the train phase touched
LEARNING_RATE = 0.05


class BagModel(torch.nn.Module):
    """A dynamic table's rows summed over each sample's ids, and a linear head."""

    def __init__(self, ram_budget: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        init = psframe.RowInitializer("constant", value=0.01)
        self.table = psframe.DynamicEmbedding(DIM, mode="sum", initializer=init, ram_budget=ram_budget)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(1)


def spread(ranks: numpy.ndarray) -> torch.Tensor:
    """Ids of ranks: spread over the int64 range, so that neighbours in rank are not in id."""
    return torch.from_numpy(
        ((ranks.astype(numpy.uint64) * numpy.uint64(2654435761)) % numpy.uint64(1 << 61)).astype(numpy.int64)
    )


def train_batches(rows: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The train phase's batches: (ids (BATCH, FEATURES), labels), power-law ranks, one seed."""
    generator = numpy.random.default_rng(7)
    out = []
    for _ in range(steps + 1):  # one more: the last step prefetches it
        ranks = numpy.minimum(generator.zipf(1.1, BATCH * FEATURES), rows) - 1
        ids = spread(ranks).reshape(BATCH, FEATURES)
        labels = torch.from_numpy((generator.random(BATCH) < 0.3).astype(numpy.float32))
        out.append((ids, labels))
    return out


class ProcessWatch:
    """The largest anonymous and file-backed memory of a process, sampled from ``/proc`` in a thread."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peak_anon = self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"watch-{pid}")
        self._thread.start()

    def sample(self) -> tuple[int, int]:
        fields = {}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields.get("RssAnon", 0), fields.get("RssFile", 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            anon, file = self.sample()
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def disk_busy_ms(folder: str) -> int | None:
    """Milliseconds the block device holding ``folder`` has been busy (``/proc/diskstats``' io_ticks)."""
    device = os.stat(folder).st_dev
    major, minor = os.major(device), os.minor(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/diskstats").read_text().splitlines():
            parts = line.split()
            if int(parts[0]) == major and int(parts[1]) in (minor, minor - minor % 16):
                return int(parts[12])
    return None


def run_job(
    children: Children, name: str, rows: int, steps: int, budget: int | None, folder: str, deadline: Deadline
) -> dict:
    """One job (fill, then train); its row, with the rows read back for the comparison."""
    os.environ["PSFRAME_TABLE_DISK_DIR"] = folder  # the ps task, a child, takes it
    cluster = PsCluster(children, 1, name, timeout=deadline.remaining() + 60)
    tool = tool_client(cluster.cluster, rpc_timeout=min(120.0, deadline.remaining(1.0)))
    watch = None
    try:
        (info,) = control_calls.wait_for_ps(tool, deadline.remaining())
        watch = ProcessWatch(info.pid)
        time.sleep(0.1)
        fixed = watch.sample()[0]
        model = BagModel(budget)
        trainer = psframe.Trainer(
            model,
            cluster.cluster,
            optimizer=psframe.optim.Adagrad(lr=LEARNING_RATE),
            transport=psframe.Transport(connect_timeout=min(120.0, deadline.remaining())),
        )
        data = train_batches(rows, steps)
        with trainer:
            # A batch of new ids a step, at most half the RAM tier (a request must fit it).
            per_step = max(FEATURES, min(BATCH * FEATURES, rows // BUDGET_SHARE // 2) // FEATURES * FEATURES)
            for start in range(0, rows, per_step):  # fill: every id once
                deadline.check(f"{name}: filling the table")
                ids = spread(numpy.arange(start, min(start + per_step, rows)))
                ids = torch.cat([ids, ids[: (-ids.numel()) % FEATURES]]).reshape(-1, FEATURES)
                trainer.step(F.binary_cross_entropy_with_logits(model(ids), torch.zeros(ids.shape[0])))
            process = psutil.Process(info.pid)
            cpu_before, busy_before, started = sum(process.cpu_times()[:2]), disk_busy_ms(folder), time.monotonic()
            for (ids, labels), (next_ids, _) in zip(data[:-1], data[1:]):
                deadline.check(f"{name}: training")
                loss = F.binary_cross_entropy_with_logits(model(ids), labels)
                trainer.prefetch(model.table, next_ids)
                trainer.step(loss)
            wall = time.monotonic() - started
            cpu, busy = sum(process.cpu_times()[:2]) - cpu_before, disk_busy_ms(folder)
            on_disk = sum(t.rows_on_disk for t in control_calls.get_info(tool, 0).dynamic_tables)
            touched = torch.unique(torch.cat([ids.flatten() for ids, _ in data]))
            sample = spread(numpy.random.default_rng(3).choice(rows, size=min(SAMPLE, rows), replace=False))
            checked = torch.unique(torch.cat([touched, sample]))
            model.eval()
            with torch.no_grad():
                read = torch.cat(
                    [model.table(checked[i : i + 8192].unsqueeze(1)) for i in range(0, checked.numel(), 8192)]
                )
            head = [p.detach().clone() for p in model.head.parameters()]
        watch.stop()
    finally:
        if watch is not None:
            watch.stop()
        tool.close()
    for task in cluster.names:
        children.wait_exit(task, 30.0)
    return {
        "job": "disk tier" if budget else "in RAM",
        "rows": rows,
        "budget": budget,
        "samples_per_s": steps * BATCH / wall,
        "fixed_anon": fixed,
        "peak_anon": watch.peak_anon,
        "peak_file": watch.peak_file,
        "on_disk": on_disk,
        "cpu_per_s": cpu / wall,
        "disk_busy": None if busy is None or busy_before is None else (busy - busy_before) / 1000 / wall,
        "checked_ids": checked,
        "read": read,
        "head": head,
    }


def run_tables_beyond_ram(rows: int, steps: int, timeout: float = 3600.0) -> list[dict]:
    """The in-RAM job and the disk-tier job; rows with ``vs_in_ram`` and ``identical``."""
    single_thread()
    deadline = Deadline(timeout, "tables beyond RAM benchmark")
    budget = rows * SLOT_BYTES // BUDGET_SHARE
    with tempfile.TemporaryDirectory(prefix="psframe-bench-tier-") as logs, Children(Path(logs)) as children:
        folder = tempfile.mkdtemp(prefix="psframe-bench-rows-", dir=os.environ.get("PSFRAME_TABLE_DISK_DIR"))
        try:
            in_ram = run_job(children, "tier-in-ram", rows, steps, None, folder, deadline)
            tiered = run_job(children, "tier-disk", rows, steps, budget, folder, deadline)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    identical = (
        torch.equal(in_ram["checked_ids"], tiered["checked_ids"])
        and torch.equal(in_ram["read"], tiered["read"])
        and all(torch.equal(a, b) for a, b in zip(in_ram["head"], tiered["head"]))
    )
    out = []
    for job in (in_ram, tiered):
        row = {k: v for k, v in job.items() if k not in ("read", "head", "checked_ids")}
        row["vs_in_ram"] = job["samples_per_s"] / in_ram["samples_per_s"]
        row["identical"] = identical
        row["rows_checked"] = job["checked_ids"].numel()
        out.append(row)
    return out


def tables_beyond_ram_table(rows: list[dict]) -> str:
    headers = [
        "job",
        "table rows",
        "RAM budget",
        "samples/s",
        "vs in RAM",
        "ps anon peak",
        "fixed",
        "ps file peak",
        "on disk",
        "ps CPU s/s",
        "disk busy",
        "rows identical",
    ]
    return markdown_table(
        headers,
        [
            [
                r["job"],
                f"{r['rows']:,}",
                "-" if r["budget"] is None else format_bytes(r["budget"]),
                format_number(r["samples_per_s"]),
                format_ratio(r["vs_in_ram"]),
                format_bytes(r["peak_anon"]),
                format_bytes(r["fixed_anon"]),
                format_bytes(r["peak_file"]),
                f"{r['on_disk']:,}",
                f"{r['cpu_per_s']:.2f}",
                "-" if r["disk_busy"] is None else f"{100 * r['disk_busy']:.0f}%",
                f"{'yes' if r['identical'] else 'NO'} ({r['rows_checked']:,})",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['rows']:,} rows, {QUICK['steps']} steps")
    parser.add_argument("--rows", type=int, default=None, help=f"ids in the table (default {FULL['rows']:,})")
    parser.add_argument("--steps", type=int, default=None, help=f"train steps (default {FULL['steps']})")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    rows = run_tables_beyond_ram(args.rows or size["rows"], args.steps or size["steps"])
    print(tables_beyond_ram_table(rows))
    if not rows[0]["identical"]:
        raise BenchmarkError("the disk tier's rows differ from the in-RAM job's")
    return 0


if __name__ == "__main__":
    sys.exit(main())

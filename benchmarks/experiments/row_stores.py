"""Which storage engine should hold an embedding table's rows beyond the ps host's RAM budget.

    python -m benchmarks.experiments.row_stores [--rows 2000000] [--dim 16] [--batch 4096] [--seconds 3] [--dir PATH]

A disk tier keeps a table's hot rows in RAM and the rest, with their optimizer
state, on the ps host's local disk, moving rows between the two in batches.
This measures the engines that could hold the rest
(:mod:`benchmarks.experiments.row_store_engines`: RocksDB without and with
LZ4, LMDB, a ``numpy.memmap`` slab) beside the in-RAM reference, torch
tensors, on the same work:

- **load**: the whole table written once, in id order;
- **read**: batches of ``batch`` distinct ids, each read in one call (the
  engine's multi-get where it has one);
- **write**: such batches written back modified;
- **step**: read a batch, apply an Adagrad step to it, write it back, as a
  training step does with its misses.

A batch's ids follow a power law: ranks drawn with
``numpy.random.Generator.zipf(1.1)`` (seeded: every engine gets the same
batches), the first ``batch`` distinct ranks below ``rows`` kept, mapped
through a fixed random permutation of the ids (hot ids lie all over the key
space, as hashed ids do), and sorted, as a ps's ``unique`` over a request's
ids leaves them. The table's values are random floats as after some training,
so that compression is tried on bits as incompressible as real weights'.

The memmap slab needs no index because the id is the row's slot, which fits a
fixed table only: a dynamic table's arbitrary int64 ids would need an
id-to-slot index in RAM, 16 bytes an id, 1.5 GiB for 10^8 ids, beyond a
1 GiB budget before a single row is cached. RocksDB and LMDB are keyed by the
id itself.

Every read is compared, bit for bit, with the rows the experiment last wrote
(its own copy of the table, outside the engines), and a difference stops the
run; after the write phase its last batch is read back, so that a write an
engine dropped or kept back shows.

Figures: rows/s of the engine's calls alone (the checks, the drawing of
batches and the update's arithmetic are outside the timing), each beside the
in-RAM reference's in the same run; CPU seconds per wall second of those calls
(the whole process's CPU, RocksDB's background threads included: about 1 is
CPU-bound, well under 1 waits on the disk); bytes on disk (allocated blocks)
over the rows' raw bytes, after the load and at the end; the peak RSS growth
over the engine's life (psutil, sampled after every call) and how much of it
is anonymous memory: pages of a mapped file (LMDB, memmap) count in RSS, yet
the kernel may drop them.

What this does not measure: at the defaults the table (272 MB) fits this
host's page cache, so the disk engines read memory through the kernel and
their figures are their CPU cost per row. A table beyond the host's free RAM
adds the disk's own latency to every miss.
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch

from benchmarks.common import single_thread
from benchmarks.experiments.row_store_engines import (
    ENGINES,
    FIELDS,
    REFERENCE,
    Engine,
    RowMismatch,
    pack,
    row_dtype,
)
from benchmarks.formatting import format_bytes, format_number, format_ratio, markdown_table

ZIPF_A = 1.1  # the power law's exponent: about the skew of CTR data sets' ids
LOAD_CHUNK = 65_536  # rows per load call
PHASES = ("load", "read", "write", "step")


@dataclass(frozen=True)
class Settings:
    rows: int = 2_000_000
    dim: int = 16
    batch: int = 4096
    seconds: float = 3.0  # per phase and engine
    directory: str | None = None  # where the temporary directory goes (None: the system's)


def make_table(rows: int, dim: int, seed: int = 0) -> np.ndarray:
    """The table as after some training: weights ~ N(0, 0.01²), sums above 0.1, stamps below 2^20."""
    rng = np.random.default_rng(seed)
    table = np.empty(rows, row_dtype(dim))
    table["weight"] = rng.standard_normal((rows, dim), dtype=np.float32) * np.float32(0.01)
    table["state"] = np.abs(rng.standard_normal((rows, dim), dtype=np.float32)) + np.float32(0.1)
    table["stamp"] = rng.integers(0, 1 << 20, rows)
    return table


def zipf_batches(rows: int, batch: int, seed: int) -> Iterator[np.ndarray]:
    """Endless sorted batches of ``batch`` distinct ids in [0, rows), drawn as the module says."""
    rng = np.random.default_rng(seed)
    id_of_rank = rng.permutation(rows)
    while True:
        draws = np.empty(0, np.int64)
        while True:
            ranks = rng.zipf(ZIPF_A, 8 * batch)
            draws = np.concatenate([draws, ranks[ranks <= rows] - 1])
            _, first = np.unique(draws, return_index=True)  # where each distinct rank was first drawn
            if len(first) >= batch:
                break
        yield np.sort(id_of_rank[draws[np.sort(first)[:batch]]])


def adagrad_step(weight: np.ndarray, state: np.ndarray, rng: np.random.Generator, stamp: int) -> tuple:
    """New columns for rows read: one Adagrad step (lr 0.05) with a random gradient, stamped ``stamp``."""
    grad = rng.standard_normal(weight.shape, dtype=np.float32) * np.float32(0.1)
    new_state = state + grad * grad
    new_weight = weight - np.float32(0.05) * grad / np.sqrt(new_state)
    return new_weight, new_state, np.full(len(weight), stamp, np.int64)


# ---------------------------------------------------------------------------- measuring


@dataclass
class Phase:
    """One phase's engine calls: rows and batches done, and the wall and CPU seconds of the calls alone."""

    rows: int = 0
    batches: int = 0
    seconds: float = 0.0
    cpu: float = 0.0

    def timed(self, call: Callable, *args):
        """``call(*args)``, its wall time and the whole process's CPU time meanwhile counted."""
        wall, cpu = time.perf_counter(), time.process_time()
        result = call(*args)
        self.seconds += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu
        return result

    @property
    def rate(self) -> float:
        return self.rows / self.seconds if self.seconds else float("nan")


@dataclass
class Memory:
    """The process's RSS and its anonymous part (RSS less mapped files' pages): at the start, and their peaks."""

    process: psutil.Process = field(default_factory=psutil.Process)
    start: tuple[int, int] = (0, 0)
    peak: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.start = self.peak = self.now()

    def now(self) -> tuple[int, int]:
        info = self.process.memory_info()
        return info.rss, info.rss - info.shared

    def sample(self) -> None:
        rss, anon = self.now()
        self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))


def check(engine: Engine, what: str, ids: np.ndarray, columns: tuple, truth: np.ndarray) -> None:
    """Fail unless ``columns`` are, bit for bit, the rows of ``ids`` in ``truth``."""
    expected = truth[ids]
    for name, column in zip(FIELDS, columns):
        got, want = np.asarray(column), expected[name]
        if got.shape != want.shape:
            raise RowMismatch(f"{engine.name}: {what} gave a {name} of shape {got.shape}, not {want.shape}")
        if got.tobytes() != want.tobytes():
            bits = [np.ascontiguousarray(c).reshape(len(ids), -1).view(np.uint8) for c in (got, want)]
            differ = (bits[0] != bits[1]).any(axis=1)
            raise RowMismatch(
                f"{engine.name}: {what} gave {differ.sum()} of {len(ids)} rows with another {name} than was "
                f"written (the first: id {ids[differ.argmax()]})"
            )


def measure(engine: Engine, truth: np.ndarray, settings: Settings, memory: Memory) -> dict:
    """Load ``truth`` into ``engine``, then run the read, write and step phases, ``settings.seconds``
    each. ``truth`` follows every write; every read is checked against it."""
    phases = {name: Phase() for name in PHASES}

    def batches(phase: Phase, seed: int) -> Iterator[np.ndarray]:
        """The phase's batches until its time is up, counted, and memory sampled after each."""
        ends = time.perf_counter() + settings.seconds
        for ids in zipf_batches(settings.rows, settings.batch, seed):
            yield ids
            phase.rows += len(ids)
            phase.batches += 1
            memory.sample()
            if time.perf_counter() >= ends:
                return

    load = phases["load"]
    for first in range(0, len(truth), LOAD_CHUNK):
        load.timed(engine.load, first, truth[first : first + LOAD_CHUNK])
        memory.sample()
    load.timed(engine.finish_load)
    load.rows = len(truth)
    disk_loaded = engine.disk_bytes()
    engine.warm()

    read = phases["read"]
    for ids in batches(read, seed=1):
        check(engine, "a read", ids, read.timed(engine.read, ids), truth)

    write, rng = phases["write"], np.random.default_rng(2)
    for ids in batches(write, seed=2):
        old = truth[ids]
        new = adagrad_step(old["weight"], old["state"], rng, stamp=write.batches + 1)
        write.timed(engine.write, ids, new)
        truth[ids] = pack(truth.dtype, new)
        last = ids
    check(engine, "reading the last batch written", last, engine.read(last), truth)

    step = phases["step"]
    for ids in batches(step, seed=3):
        columns = step.timed(engine.read, ids)
        check(engine, "a step's read", ids, columns, truth)
        # Stamps of their own (the write phase's count from 1), so that a row left from that phase shows.
        new = adagrad_step(np.asarray(columns[0]), np.asarray(columns[1]), rng, stamp=1_000_000 + step.batches)
        step.timed(engine.write, ids, new)
        truth[ids] = pack(truth.dtype, new)

    raw = len(truth) * truth.dtype.itemsize
    return {
        "engine": engine.name,
        "phases": phases,
        "disk_loaded": disk_loaded / raw,
        "disk_end": engine.disk_bytes() / raw,
        "rss_growth": memory.peak[0] - memory.start[0],
        "anon_growth": memory.peak[1] - memory.start[1],
    }


def release_freed_memory() -> None:
    """Hand the memory an engine freed back to the system (glibc keeps it otherwise), so that the next
    engine's RSS growth is its own, not the last one's reused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def run(settings: Settings, engines: Sequence[Callable[[Path, int, int], Engine]] = ENGINES) -> list[dict]:
    """Measure each engine in turn on a table of its own, in a temporary directory removed after."""
    single_thread()
    torch.set_num_threads(1)
    results = []
    workdir = Path(tempfile.mkdtemp(prefix="row_stores-", dir=settings.directory))
    try:
        for number, make in enumerate(engines):
            truth = make_table(settings.rows, settings.dim)
            directory = workdir / str(number)
            directory.mkdir()
            memory = Memory()  # from here on: the engine's memory, not the experiment's copy of the table
            engine = make(directory, settings.rows, settings.dim)
            print(f"measuring {engine.name}", file=sys.stderr, flush=True)
            try:
                results.append(measure(engine, truth, settings, memory))
            finally:
                engine.close()
                del engine, truth
                release_freed_memory()
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------- report


def rates_table(results: list[dict]) -> str:
    """A row per engine and phase: rows/s, beside the in-RAM reference's; ms per batch; CPU s per s."""
    reference = next((r["phases"] for r in results if r["engine"] == REFERENCE), None)
    headers = ["engine", "phase", "rows/s", "vs in RAM", "ms/batch", "CPU s/s"]
    rows = [
        [
            r["engine"],
            name,
            f"{phase.rate:,.0f}",
            format_ratio(phase.rate / reference[name].rate if reference else None),
            format_number(1e3 * phase.seconds / phase.batches) if phase.batches else "-",
            f"{phase.cpu / phase.seconds:.2f}",
        ]
        for r in results
        for name, phase in r["phases"].items()
    ]
    return markdown_table(headers, rows)


def costs_table(results: list[dict]) -> str:
    """A row per engine: bytes on disk over the rows' raw bytes, after the load and at the end; RSS growth."""
    headers = ["engine", "disk/raw loaded", "disk/raw at end", "peak RSS growth", "of it anonymous"]
    rows = [
        [
            r["engine"],
            f"{r['disk_loaded']:.2f}",
            f"{r['disk_end']:.2f}",
            format_bytes(max(0, r["rss_growth"])),
            format_bytes(max(0, r["anon_growth"])),
        ]
        for r in results
    ]
    return markdown_table(headers, rows)


def conclusion(results: list[dict]) -> str:
    """One paragraph from the figures: the fastest disk engine per phase, what each costs, LZ4's worth."""
    by_name = {r["engine"]: r for r in results}
    reference = by_name.get(REFERENCE)
    on_disk = [r for r in results if r["engine"] != REFERENCE]
    if not on_disk:
        return "No disk engine was measured."

    def rate(r: dict, phase: str) -> str:
        figure = r["phases"][phase].rate
        versus = f", {figure / reference['phases'][phase].rate:.2f}x in RAM's" if reference else ""
        return f"{figure:,.0f} rows/s{versus}"

    def fastest(phase: str, engines: list[dict]) -> dict:
        return max(engines, key=lambda r: r["phases"][phase].rate)

    sentences = [
        "Fastest disk engine: "
        + "; ".join(
            f"{what}, {fastest(phase, on_disk)['engine']} ({rate(fastest(phase, on_disk), phase)})"
            for phase, what in (("read", "to read"), ("write", "to write"), ("step", "to read and write back"))
        )
        + "."
    ]
    sentences.append(
        "Their costs: "
        + "; ".join(
            f"{r['engine']} {r['disk_end']:.2f}x the raw bytes on disk at the end, RSS "
            f"+{format_bytes(max(0, r['rss_growth']))} ({format_bytes(max(0, r['anon_growth']))} of it anonymous)"
            for r in on_disk
        )
        + (f"; in RAM, +{format_bytes(max(0, reference['rss_growth']))} RSS." if reference else ".")
    )
    busy = [r["phases"]["read"].cpu / r["phases"]["read"].seconds for r in on_disk]
    bound = "CPU-bound: the rows came from the page cache" if min(busy) >= 0.8 else "they waited on the disk"
    sentences.append(f"Their reads kept {min(busy):.2f}-{max(busy):.2f} CPU seconds busy a second: {bound}.")
    if "rocksdb" in by_name and "rocksdb+lz4" in by_name:
        plain, lz4 = by_name["rocksdb"], by_name["rocksdb+lz4"]
        saved = 1 - lz4["disk_loaded"] / plain["disk_loaded"]  # the end's figures depend on compactions' timing
        speed = lz4["phases"]["step"].rate / plain["phases"]["step"].rate
        worth = saved >= 0.1 and speed >= 0.9
        savings = f"saves {100 * saved:.0f}%" if saved >= 0.005 else "saves nothing"
        sentences.append(
            f"LZ4 {savings} of RocksDB's loaded bytes on these float rows, at {speed:.2f}x its step rate: "
            f"{'worth it' if worth else 'compression off is the better setting'}."
        )
    keyed = [r for r in on_disk if r["engine"] != "memmap"]
    if keyed:
        best = fastest("step", keyed)
        sentences.append(
            f"A dynamic table (arbitrary int64 ids) needs a keyed engine: {best['engine']} steps fastest of "
            f"those ({rate(best, 'step')})."
        )
    if "memmap" in by_name:
        sentences.append(
            f"A fixed table can use the memmap slab, id = slot, no index ({rate(by_name['memmap'], 'step')} "
            "in the step); a dynamic one would need a 16-byte-an-id index in RAM for it."
        )
    return textwrap.fill(" ".join(sentences), width=110)


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=defaults.rows, help="rows of the table")
    parser.add_argument("--dim", type=int, default=defaults.dim, help="floats a row (and as many of Adagrad's sum)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="distinct ids a batch")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="seconds a phase and engine")
    parser.add_argument("--dir", default=None, help="where the temporary directory goes (default: the system's)")
    args = parser.parse_args(argv)
    if not 0 < args.batch <= args.rows // 4 or args.dim < 1 or args.seconds <= 0:
        parser.error(
            "need 0 < batch <= rows / 4 (a power law draws a quarter of the ids slowly), dim >= 1, seconds > 0"
        )
    settings = Settings(args.rows, args.dim, args.batch, args.seconds, args.dir)
    # A kill (SIGTERM) unwinds as an exception does, so the temporary directory goes too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    row_bytes = row_dtype(args.dim).itemsize
    print(
        f"{args.rows:,} rows of {args.dim} + {args.dim} float32 and an int64 ({row_bytes} B, "
        f"{format_bytes(args.rows * row_bytes)} raw); batches of {args.batch} distinct ids, zipf({ZIPF_A}); "
        f"{args.seconds:g} s a phase"
    )
    results = run(settings)
    print(rates_table(results), costs_table(results), conclusion(results), sep="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

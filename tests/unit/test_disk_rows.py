"""The store under a dynamic table's disk tier: records by id in LMDB, and their layout.

The oracles: what was put is taken back bit for bit (every dtype a slot holds) and then is
gone; a scan gives every record once, sorted by id (negative ids and the extremes too);
a store that outgrows its map grows it and loses nothing; the folders of dead processes go.

This file holds the unit tier's tests of the subject; `tests/unit/test_disk_tier.py` holds the
table parts' tiering.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from psframe.memory.scratch import remove_orphans
from psframe.tables import disk_rows
from psframe.tables.disk_rows import DiskRows, RecordLayout


def columns(count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return {
        "row": torch.randn(count, 4, generator=generator).to(torch.bfloat16),
        "sum": torch.rand(count, 4, generator=generator),
        "updates": torch.randint(0, 1 << 40, (count,), generator=generator),
        "seen": torch.rand(count, dtype=torch.float64, generator=generator),
    }


@pytest.fixture
def store(tmp_path):
    rows = DiskRows("users/part_0", str(tmp_path))
    yield rows
    rows.close()


def test_records_read_back_hold_the_bits_put_and_deleted_ones_are_gone(store):
    held = columns(6)
    layout = RecordLayout(held)
    assert layout.width == 4 * 2 + 4 * 4 + 8 + 8
    ids = torch.tensor([5, -3, 2**62, -(2**63), 2**63 - 1, 0])
    store.put(ids, layout.pack(held, torch.arange(6)))
    assert len(store) == 6
    found, records = store.get(torch.tensor([2**63 - 1, 99, -3]))
    assert found.tolist() == [2**63 - 1, -3] and len(store) == 6
    assert store.delete(torch.tensor([2**63 - 1, 99, -3])) == 2 and len(store) == 4
    back = layout.unpack(records)
    for name, column in held.items():
        assert back[name].dtype == column.dtype
        assert torch.equal(back[name], column[[4, 1]]), name
    again, _ = store.get(torch.tensor([-3]))
    assert again.numel() == 0
    into = {name: torch.zeros_like(c) for name, c in held.items()}
    layout.unpack_into(into, torch.tensor([1, 0]), records)
    assert torch.equal(into["sum"][:2], held["sum"][[1, 4]])


def test_a_scan_gives_every_record_once_sorted_by_id(store):
    held = columns(300)
    layout = RecordLayout(held)
    ids = torch.randperm(300) * 7919 - 1_000_000
    store.put(ids, layout.pack(held, torch.arange(300)))
    seen, order = [], []
    for batch_ids, records in store.scan(64):
        assert batch_ids.numel() <= 64
        seen.append(batch_ids)
        order.append(layout.unpack(records)["updates"])
    all_ids = torch.cat(seen)
    assert torch.equal(all_ids, torch.sort(ids).values)
    assert torch.equal(torch.cat(order), held["updates"][torch.argsort(ids)])
    store.clear()
    assert len(store) == 0 and list(store.scan(64)) == []


def test_a_store_grows_its_map_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_rows, "_INITIAL_MAP_BYTES", 1 << 16)
    rows = DiskRows("t", str(tmp_path))
    try:
        held = {"row": torch.arange(20_000 * 16, dtype=torch.float32).reshape(20_000, 16)}
        layout = RecordLayout(held)
        rows.put(torch.arange(20_000), layout.pack(held, torch.arange(20_000)))
        assert len(rows) == 20_000 and rows.nbytes_on_disk() >= 20_000 * 64
        found, records = rows.get(torch.tensor([19_999, 0]))
        assert found.tolist() == [19_999, 0]
        assert torch.equal(layout.unpack(records)["row"], held["row"][[19_999, 0]])
    finally:
        rows.close()
    assert not rows.folder.exists()


def test_putting_an_id_held_replaces_its_record(store):
    held = columns(2)
    layout = RecordLayout(held)
    assert store.put(torch.tensor([1, 2]), layout.pack(held, torch.arange(2))) == 2
    assert store.put(torch.tensor([2, 3]), layout.pack(held, torch.tensor([0, 1]))) == 1
    found, records = store.get(torch.tensor([1, 2, 3]))
    assert found.tolist() == [1, 2, 3] and len(store) == 3
    assert torch.equal(layout.unpack(records)["sum"], held["sum"][[0, 0, 1]])


def test_the_folders_of_processes_no_longer_running_are_removed(tmp_path):
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    dead_folder = tmp_path / f"psframe-rows-{dead}-t_part_0-abc"
    live_folder = tmp_path / f"psframe-rows-{os.getpid()}-t_part_1-abc"
    other = tmp_path / "psframe-rows-notapid"
    for folder in (dead_folder, live_folder, other):
        folder.mkdir()
    remove_orphans(str(tmp_path), "psframe-rows-")
    assert not dead_folder.exists() and live_folder.exists() and other.exists()

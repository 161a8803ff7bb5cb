"""A dynamic table part with a RAM budget: rows beyond it on local disk, moved in batches.

The oracle is the same part without a budget, all its rows in RAM, given the same lookups and
updates: every read, every export (full and delta) and every row trained must hold its bits,
while the tiered part keeps at most its RAM tier's rows in slots and the rest on disk.

This file holds the unit tier's tests of the subject; `tests/unit/test_disk_rows.py` holds the
store under it, `tests/service/test_disk_tier.py` the ps tasks'.
"""

from __future__ import annotations

import pytest
import torch

import psframe
from psframe.errors import PlacementError, RowIdError
from psframe.optim import OptimizerSpec
from psframe.tables.disk_tier import SPILL_SHARE, slot_bytes
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.spec import Admission, DynamicTableSpec, Eviction, RowInitializer

DIM = 8
INIT = RowInitializer(std=0.1, seed=3)
OPTIMIZERS = [
    psframe.optim.Adagrad(lr=0.1),
    OptimizerSpec("Ftrl", {"lr": 0.1, "l1": 0.001}),
    OptimizerSpec("RowWiseAdagrad", {"lr": 0.1}),
    OptimizerSpec("SparseSGD", {"lr": 0.1, "momentum": 0.9}),
]


def part(budget_rows: int | None, optimizer: OptimizerSpec, tmp_path, **spec) -> DynamicRows:
    probe = DynamicRows("probe", (DIM,), torch.float32, DynamicTableSpec(INIT, **spec), optimizer)
    row_state = [v for v in probe.columns().values()][1:-4]  # the per-row state between row and ages
    budget = None if budget_rows is None else budget_rows * slot_bytes(probe.weight, row_state, True)
    table = DynamicTableSpec(INIT, ram_budget=budget, **spec)
    return DynamicRows(
        "users/part_0", (DIM,), torch.float32, table, optimizer, disk_folder=str(tmp_path), wall_clock=lambda: 1000.0
    )


def power_law_batches(count: int, seed: int, vocabulary: int = 2000, size: int = 60):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        ranks = (torch.rand(size, generator=generator) ** 3 * vocabulary).long()
        ids = ranks * 7919 - 10**9  # spread, negative ones too
        yield ids, torch.randn(size, DIM, generator=generator)


def assert_same_export(a: dict, b: dict) -> None:
    for key in ("ids", "rows", "updated", "updates", "seen"):
        assert torch.equal(a[key], b[key]), key
    assert sorted(a["state"]) == sorted(b["state"])
    for key, value in a["state"].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][key])), key


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_tiered_part_trains_bit_for_bit_as_one_all_in_ram(tmp_path, optimizer):
    in_ram, tiered = part(None, optimizer, tmp_path), part(100, optimizer, tmp_path)
    assert tiered.tier is not None and tiered.tier.ram_rows == 100
    for step, (ids, grads) in enumerate(power_law_batches(40, seed=1)):
        assert torch.equal(tiered.read(ids), in_ram.read(ids)), step
        tiered.apply(ids, grads)
        in_ram.apply(ids, grads)
        assert tiered.held_in_ram() <= 100 and len(tiered) == len(in_ram)
    assert tiered.tier.spilled > 0 and tiered.tier.brought_in > 0 and len(tiered.tier) > 0
    every = torch.unique(torch.cat([ids for ids, _ in power_law_batches(40, seed=1)]))
    assert torch.equal(tiered.read(every, create=False), in_ram.read(every, create=False))
    assert_same_export(tiered.export(), in_ram.export())


def test_a_delta_of_a_tiered_part_holds_its_rows_changed_on_disk_too(tmp_path):
    in_ram, tiered = part(None, OPTIMIZERS[0], tmp_path), part(64, OPTIMIZERS[0], tmp_path)
    batches = list(power_law_batches(30, seed=2))
    for ids, grads in batches[:15]:
        for table in (in_ram, tiered):
            table.read(ids)
            table.apply(ids, grads)
    for table in (in_ram, tiered):
        table.close_epoch(oldest=0)
    for ids, grads in batches[15:]:
        for table in (in_ram, tiered):
            table.read(ids)
            table.apply(ids, grads)
    assert len(tiered.tier) > 0
    one, other = tiered.export_changes(since=1), in_ram.export_changes(since=1)
    assert_same_export(one, other)
    assert 0 < one["ids"].numel() < len(in_ram)


def test_a_tiered_part_restores_an_export_larger_than_its_ram_tier_and_goes_on_bit_for_bit(tmp_path):
    trained = part(None, OPTIMIZERS[0], tmp_path)
    batches = list(power_law_batches(30, seed=3))
    for ids, grads in batches[:20]:
        trained.read(ids)
        trained.apply(ids, grads)
    saved = trained.export()
    restored = part(80, OPTIMIZERS[0], tmp_path)
    restored.load(saved)
    assert len(saved["ids"]) > 200 and restored.held_in_ram() <= 80 and len(restored) == len(saved["ids"])
    assert_same_export(restored.export(), saved)
    for ids, grads in batches[20:]:
        assert torch.equal(restored.read(ids), trained.read(ids))
        restored.apply(ids, grads)
        trained.apply(ids, grads)
    assert_same_export(restored.export(), trained.export())


def test_compact_rows_and_the_admission_go_with_the_disk_tier(tmp_path):
    spec = {"storage": "bfloat16", "admission": Admission(min_count=2)}
    in_ram, tiered = part(None, OPTIMIZERS[0], tmp_path, **spec), part(40, OPTIMIZERS[0], tmp_path, **spec)
    for ids, grads in power_law_batches(30, seed=4):
        assert torch.equal(tiered.read(ids), in_ram.read(ids))
        tiered.apply(ids, grads)
        in_ram.apply(ids, grads)
    assert tiered.filtered == in_ram.filtered > 0 and len(tiered.tier) > 0
    assert_same_export(tiered.export(), in_ram.export())


def test_rows_go_to_disk_in_batches_and_a_request_larger_than_the_ram_tier_is_refused(tmp_path):
    tiered = part(SPILL_SHARE * 8, OPTIMIZERS[0], tmp_path)
    ram_rows = tiered.tier.ram_rows
    tiered.read(torch.arange(ram_rows))
    tiered.read(torch.arange(ram_rows, ram_rows + 1))  # one more: a batch of ram_rows / SPILL_SHARE goes
    assert len(tiered.tier) == 1 + ram_rows // SPILL_SHARE and tiered.tier.spilled == len(tiered.tier)
    before = tiered.export()
    with pytest.raises(RowIdError, match="raise its ram_budget"):
        tiered.read(torch.arange(10**6, 10**6 + ram_rows + 1))
    assert_same_export(tiered.export(), before)  # nothing lost or changed


def test_a_ram_budget_with_rules_its_disk_rows_cannot_keep_is_refused():
    for eviction in (Eviction(max_rows=10), Eviction(max_age=5), Eviction(ttl_seconds=60.0)):
        with pytest.raises(PlacementError, match="takes no"):
            DynamicTableSpec(ram_budget=1 << 20, eviction=eviction)
    for budget in (0, -5, 1.5, True):
        with pytest.raises(PlacementError, match="ram_budget must be"):
            DynamicTableSpec(ram_budget=budget)
    table = psframe.DynamicEmbedding(DIM, ram_budget=1 << 30)
    assert table.spec.ram_budget == 1 << 30


def test_a_part_s_folder_goes_when_the_part_does(tmp_path):
    tiered = part(20, OPTIMIZERS[0], tmp_path)
    for start in range(0, 100, 10):
        tiered.read(torch.arange(start, start + 10))
    folder = tiered.tier.disk.folder
    assert folder.exists() and folder.parent == tmp_path
    del tiered
    import gc

    gc.collect()
    assert not folder.exists()


def test_a_row_evicted_by_its_norm_after_a_trip_to_disk_is_not_brought_back(tmp_path):
    """A row read back from disk leaves a stale copy there; evicting the row must delete the copy,
    or a later lookup would bring the evicted row back instead of making it anew."""
    spec = {"eviction": Eviction(min_norm=0.25)}
    in_ram, tiered = part(None, OPTIMIZERS[0], tmp_path, **spec), part(70, OPTIMIZERS[0], tmp_path, **spec)
    for ids, grads in power_law_batches(40, seed=5):
        assert torch.equal(tiered.read(ids), in_ram.read(ids))
        tiered.apply(ids, grads)
        in_ram.apply(ids, grads)
    assert tiered.evicted == in_ram.evicted > 0 and tiered.tier.brought_in > 0
    assert len(tiered) == len(in_ram)
    assert_same_export(tiered.export(), in_ram.export())


def test_under_a_lock_the_tier_spills_ahead_between_requests_and_still_trains_bit_for_bit(tmp_path):
    """With the lock it is used under, a part's tier spills in its own thread once the RAM tier is
    fuller than its free share allows, so that requests find room; the rows keep their bits."""
    import threading
    import time

    from psframe.tables.disk_tier import SPILL_SHARE

    lock = threading.RLock()
    in_ram = part(None, OPTIMIZERS[0], tmp_path)
    probe = part(None, OPTIMIZERS[0], tmp_path)
    row_state = [v for v in probe.columns().values()][1:-4]
    budget = 400 * slot_bytes(probe.weight, row_state, True)
    table = DynamicTableSpec(INIT, ram_budget=budget)
    tiered = DynamicRows(
        "users/part_0",
        (DIM,),
        torch.float32,
        table,
        OPTIMIZERS[0],
        disk_folder=str(tmp_path),
        wall_clock=lambda: 1000.0,
        lock=lock,
    )
    share = tiered.tier.ram_rows // SPILL_SHARE
    for ids, grads in power_law_batches(40, seed=6):
        with lock:
            assert torch.equal(tiered.read(ids), in_ram.read(ids))
            tiered.apply(ids, grads)
        in_ram.apply(ids, grads)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the spiller runs between requests
            with lock:
                if tiered.held_in_ram() <= tiered.tier.ram_rows - share:
                    break
            time.sleep(0.01)
    assert tiered.tier._spiller is not None and tiered.tier.spilled > 0
    with lock:
        assert tiered.held_in_ram() <= tiered.tier.ram_rows - share
        assert_same_export(tiered.export(), in_ram.export())
    with lock:  # as a store drops a part: under its lock
        tiered.tier.close()
    tiered.tier._spiller.join(timeout=30)
    assert not tiered.tier._spiller.is_alive()

"""Compact rows: stochastic rounding, the optimizer's step on gathered rows, bf16/fp16 dynamic tables, int8 rows.

The oracles: rounding is unbiased (the mean of many roundings of a value
approaches it where rounding to nearest stays half a unit off) and each
rounding lands on one of the value's two neighbours; the same arguments give
the same bits; a float32 table stepped on gathered rows has the bits of the
in-place step, for every table optimizer; a compact table keeps float32 state
and learns updates below half a unit of its storage, which rounding to nearest
loses.

This file holds the unit tier's tests of the subject; `tests/service/test_compact_rows.py` holds the
other tiers'.
"""

from __future__ import annotations

import pytest
import safetensors
import torch

import psframe
from psframe import export
from psframe.errors import PlacementError, SnapshotError
from psframe.optim import OptimizerSpec
from psframe.optim.gathered_step import step_gathered
from psframe.tables.compact import (
    bytes_per_row,
    dequantize_int8,
    quantize_int8,
    rounding_chances,
    stochastic_round,
    storage_dtype,
)
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.spec import DynamicTableSpec, RowInitializer
from psframe.wire import messages

COMPACT = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", COMPACT)
def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased(dtype):
    values = torch.randn(500, 8, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.arange(500)
    near = values.to(dtype)
    up = torch.nextafter(near, torch.full_like(near, torch.inf))
    down = torch.nextafter(near, torch.full_like(near, -torch.inf))
    draws = torch.stack(
        [stochastic_round(values, dtype, ids, torch.full_like(ids, step), seed=5) for step in range(400)]
    )
    assert draws.dtype == dtype
    assert bool(((draws == near) | (draws == up) | (draws == down)).all())
    mean_error = (draws.float().mean(0) - values).abs()
    nearest_error = (near.float() - values).abs()
    # 400 draws: the mean's error is about a twentieth of a unit, against nearest's quarter on average.
    assert mean_error.mean() < 0.3 * nearest_error.mean()


@pytest.mark.parametrize("dtype", COMPACT)
def test_stochastic_rounding_is_a_function_of_its_arguments(dtype):
    values = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(100, 164)
    steps = torch.arange(64) % 5
    once = stochastic_round(values, dtype, ids, steps, seed=3)
    assert torch.equal(once, stochastic_round(values.clone(), dtype, ids.clone(), steps.clone(), seed=3))
    # A row's rounding does not depend on the other rows rounded with it.
    assert torch.equal(once[10:20], stochastic_round(values[10:20], dtype, ids[10:20], steps[10:20], seed=3))
    chances = rounding_chances(ids, steps, 3, 4)
    assert not torch.equal(chances, rounding_chances(ids, steps + 1, 3, 4))
    assert not torch.equal(chances, rounding_chances(ids, steps, 4, 4))
    assert 0.0 <= float(chances.min()) and float(chances.max()) < 1.0


def test_values_a_compact_dtype_holds_and_values_out_of_its_range_round_to_nearest():
    values = torch.tensor([[1.0, -2.5, 0.0, float("inf"), float("-inf"), 1e38]])
    for step in range(20):
        rounded = stochastic_round(values, torch.bfloat16, torch.tensor([9]), torch.tensor([step]), 0)
        assert rounded[0, :5].tolist() == [1.0, -2.5, 0.0, float("inf"), float("-inf")]
    assert torch.isnan(
        stochastic_round(torch.tensor([[float("nan")]]), torch.float16, torch.tensor([0]), torch.tensor([0]), 0)
    ).all()
    assert torch.isinf(
        stochastic_round(torch.tensor([[1e6]]), torch.float16, torch.tensor([0]), torch.tensor([0]), 0)
    ).all()


def test_int8_rows_round_trip_within_half_a_step_of_their_scale():
    rows = torch.randn(300, 16, generator=torch.Generator().manual_seed(2))
    rows[7] = 0.0
    quantized, scales = quantize_int8(rows)
    assert quantized.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (300,)
    assert int(quantized.abs().max()) == 127
    back = dequantize_int8(quantized, scales)
    assert bool(((back - rows).abs() <= scales[:, None] / 2 + 1e-7).all())
    assert torch.equal(back[7], torch.zeros(16)) and float(scales[7]) == 0.0


def test_bytes_per_row():
    assert bytes_per_row((16,), torch.float32) == 64
    assert bytes_per_row((16,), torch.bfloat16, state_floats=16) == 32 + 64
    assert bytes_per_row((16,), torch.int8, state_floats=1) == 20
    with pytest.raises(ValueError, match="bfloat16"):
        storage_dtype("int4")


OPTIMIZERS = [
    OptimizerSpec("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),
    OptimizerSpec("SparseAdam", {"lr": 0.05}),
    OptimizerSpec("SGD", {"lr": 0.5}),
    OptimizerSpec("SparseSGD", {"lr": 0.1, "momentum": 0.9}),
    OptimizerSpec("Ftrl", {"lr": 0.1, "l1": 0.01, "l2": 0.01}),
    OptimizerSpec("RowWiseAdagrad", {"lr": 0.1}),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_step_on_gathered_rows_gives_the_bits_of_the_step_in_place(optimizer):
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(40, 6, generator=generator).requires_grad_(True)
    in_place = table.detach().clone().requires_grad_(True)
    gathered_opt, in_place_opt = optimizer.build([table]), optimizer.build([in_place])
    for step in range(4):
        rows = torch.sort(torch.randperm(40, generator=generator)[: 10 + step]).values
        grads = torch.randn(rows.numel(), 6, generator=generator)
        updated = step_gathered(gathered_opt, table, rows, grads, {}, lambda s, v, d: torch.full(s, v, dtype=d))
        with torch.no_grad():
            table.index_copy_(0, rows, updated)
        in_place.grad = torch.sparse_coo_tensor(rows.unsqueeze(0), grads, (40, 6)).coalesce()
        in_place_opt.step()
        in_place.grad = None
        assert torch.equal(table, in_place), f"step {step}"
    for key, value in in_place_opt.state[in_place].items():
        assert torch.equal(torch.as_tensor(gathered_opt.state[table][key]), torch.as_tensor(value)), key


def compact_part(storage: str | None, optimizer: OptimizerSpec) -> DynamicRows:
    spec = DynamicTableSpec(RowInitializer(std=0.1, seed=11), storage=storage)
    return DynamicRows("t", (8,), torch.float32, spec, optimizer)


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS[:1] + OPTIMIZERS[4:], ids=lambda o: o.name)
def test_a_compact_part_stores_rows_in_half_the_bytes_and_keeps_float32_state(storage, optimizer):
    part = compact_part(storage, optimizer)
    ids = torch.tensor([3, 5, 1 << 40])
    rows = part.read(ids)
    assert rows.dtype == torch.float32 and part.weight.dtype == storage_dtype(storage)
    assert torch.equal(rows, rows.to(storage_dtype(storage)).float())  # as stored
    part.apply(ids, torch.ones(3, 8))
    state = part.optimizer.state[part.weight]
    assert all(v.dtype == torch.float32 for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
    assert not torch.equal(part.read(ids), rows)
    full = compact_part(None, optimizer)
    full.read(ids)
    assert part.nbytes() < full.nbytes()


def test_compact_rows_learn_updates_below_half_a_unit_that_rounding_to_nearest_loses():
    # SGD steps of 1e-4 on rows near 1: a bf16 unit there is 2^-7, so nearest rounding keeps every row at 1.
    spec = DynamicTableSpec(RowInitializer("constant", value=1.0), storage="bfloat16")
    part = DynamicRows("t", (16,), torch.float32, spec, psframe.optim.SGD(lr=1e-4))
    ids = torch.arange(64)
    part.read(ids)
    for _ in range(200):
        part.apply(ids, -torch.ones(64, 16))
    mean = float(part.read(ids, create=False).mean())
    assert abs(mean - 1.02) < 0.004, mean  # 200 steps of 1e-4, in expectation
    assert float(torch.tensor(1.0).to(torch.bfloat16) + torch.tensor(1e-4).to(torch.bfloat16)) == 1.0


def test_two_compact_parts_given_the_same_updates_hold_the_same_bits():
    def trained() -> DynamicRows:
        part = compact_part("bfloat16", OPTIMIZERS[0])
        generator = torch.Generator().manual_seed(4)
        for _ in range(20):
            ids = torch.unique(torch.randint(0, 200, (30,), generator=generator))
            part.read(ids)
            part.apply(ids, torch.randn(ids.numel(), 8, generator=generator))
        return part

    one, two = trained().export(), trained().export()
    assert torch.equal(one["ids"], two["ids"]) and torch.equal(one["rows"], two["rows"])
    assert torch.equal(one["state"]["sum"], two["state"]["sum"])


def test_a_compact_part_checkpoints_in_the_table_s_dtype_and_restores_its_bits():
    part = compact_part("bfloat16", OPTIMIZERS[0])
    ids = torch.arange(50)
    part.read(ids)
    part.apply(ids, torch.randn(50, 8, generator=torch.Generator().manual_seed(5)))
    saved = part.export()
    assert saved["rows"].dtype == torch.float32
    copy = compact_part("bfloat16", OPTIMIZERS[0])
    copy.load(saved)
    assert torch.equal(copy.read(ids, create=False), part.read(ids, create=False))
    assert torch.equal(copy.weight[: len(copy)], part.weight[: len(part)])


def test_row_storage_travels_in_the_table_s_definition_and_a_bad_one_is_refused():
    table = psframe.DynamicEmbedding(8, row_storage=torch.bfloat16)
    assert table.spec.storage == "bfloat16"
    assert messages.dynamic_spec(messages.dynamic_def(table.spec)) == table.spec
    assert messages.dynamic_spec(messages.dynamic_def(DynamicTableSpec())).storage is None
    with pytest.raises(PlacementError, match="row storage"):
        psframe.DynamicEmbedding(8, row_storage="int4")


# ---- int8 rows for serving


def float_snapshot(step: int, rows: torch.Tensor, ids: torch.Tensor | None = None) -> export.Snapshot:
    ids = torch.arange(rows.shape[0], dtype=torch.int64) * 3 if ids is None else ids
    return export.Snapshot(step, {"head": torch.ones(2)}, {"users": export.TableRows(ids, rows)})


def test_an_int8_snapshot_and_update_round_trip_through_files_and_apply_as_the_newer_snapshot(tmp_path):
    generator = torch.Generator().manual_seed(6)
    old_rows = torch.randn(40, 8, generator=generator)
    new_rows = old_rows.clone()
    new_rows[5:9] += 1.0  # four rows change; ids 0 and 3 go; one comes
    new_ids = torch.cat([torch.arange(2, 40) * 3, torch.tensor([500])])
    old = export.quantized(float_snapshot(1, old_rows))
    new = export.quantized(float_snapshot(2, torch.cat([new_rows[2:], torch.ones(1, 8)]), new_ids))
    table = old.tables["users"]
    assert table.rows.dtype == torch.int8 and table.scales is not None
    assert bool(((table.values() - old_rows).abs() <= table.scales[:, None] / 2 + 1e-7).all())
    assert torch.equal(old.dense["head"], torch.ones(2))  # dense parameters as they are
    update = export.diff_snapshots(old, new)
    assert update.tables["users"].upsert.ids.tolist() == [15, 18, 21, 24, 500]
    assert update.tables["users"].delete.tolist() == [0, 3]
    export.write_snapshot(old, str(tmp_path / "old"))
    export.write_update(update, str(tmp_path / "update"))
    meta = safetensors.safe_open(str(tmp_path / "old"), "pt").metadata()
    assert meta["format_version"] == "2"
    applied = export.apply_update(
        export.read_snapshot(str(tmp_path / "old")), export.read_update(str(tmp_path / "update"))
    )
    got, want = applied.tables["users"], new.tables["users"]
    assert torch.equal(got.ids, want.ids) and torch.equal(got.rows, want.rows) and torch.equal(got.scales, want.scales)
    # A float32 snapshot's file stays version 1, readable by readers that know no scales.
    export.write_snapshot(float_snapshot(1, old_rows), str(tmp_path / "float"))
    assert safetensors.safe_open(str(tmp_path / "float"), "pt").metadata()["format_version"] == "1"


def test_int8_and_float_rows_do_not_mix_and_bad_scales_are_refused():
    rows = torch.randn(4, 8)
    old = export.quantized(float_snapshot(1, rows))
    float_update = export.diff_snapshots(float_snapshot(1, rows), float_snapshot(2, rows + 1))
    with pytest.raises(SnapshotError, match="int8 with scales"):
        export.apply_update(old, float_update)
    with pytest.raises(SnapshotError, match="scales go with int8 rows"):
        export.TableRows(torch.arange(4), rows, torch.ones(4))
    with pytest.raises(SnapshotError, match="scales go with int8 rows"):
        export.TableRows(torch.arange(4), rows.to(torch.int8), torch.ones(3))
    with pytest.raises(SnapshotError, match="only floating point rows"):
        export.quantized(
            export.Snapshot(1, {}, {"t": export.TableRows(torch.arange(2), torch.ones(2, 2, dtype=torch.int64))})
        )

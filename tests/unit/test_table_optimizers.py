"""FTRL-Proximal and row-wise Adagrad against references written from their published formulas.

The references below are plain Python loops over coordinates and rows, in
float64, written from TensorFlow's definition of ``ApplyFtrl``/``ApplyFtrlV2``
(with keras' ``beta``) and from fbgemm_gpu's ``EXACT_ROWWISE_ADAGRAD``; they
share no code with psframe's optimizers. Here the optimizers run alone and in
a dynamic table's part; `tests/service/test_table_optimizers.py` trains
through ps tasks.

This file holds the unit tier's tests of the subject; `tests/service/test_table_optimizers.py` holds the
other tiers'.
"""

from __future__ import annotations

import math

import pytest
import torch

import psframe
from psframe.errors import OptimizerConfigError
from psframe.optim import OptimizerSpec, lr_scheduler
from psframe.optim.ftrl import Ftrl
from psframe.optim.row_state import fresh_row_state, is_row_state
from psframe.optim.rowwise_adagrad import RowWiseAdagrad
from psframe.optim.schedule_clock import ScheduleClock
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.spec import DynamicTableSpec, Eviction, RowInitializer

# ---- the references


def ftrl_coordinate(w, n, z, g, *, lr, lr_power=-0.5, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0, **_):
    """One FTRL-Proximal step of one coordinate (TF's ApplyFtrlV2, keras' beta): new (w, n, z)."""
    p = -lr_power
    shrunk = g + 2 * l2_shrinkage * w
    n_new = n + g * g
    z = z + shrunk - (n_new**p - n**p) / lr * w
    if abs(z) <= l1:
        return 0.0, n_new, z
    quadratic = (n_new**p + beta) / lr + 2 * l2
    return (math.copysign(l1, z) - z) / quadratic, n_new, z


def summed_rows(ids: list[int], grads: list[list[float]]) -> dict[int, list[float]]:
    """Each row's gradient, repeats summed (both optimizers take a row once a step)."""
    rows: dict[int, list[float]] = {}
    for i, g in zip(ids, grads):
        rows[i] = [a + b for a, b in zip(rows.get(i, [0.0] * len(g)), g)]
    return rows


def ftrl_reference(weight, accum, linear, ids, grads, kwargs):
    """Lists of rows: the rows of ``ids`` stepped, coordinate by coordinate; the others unchanged."""
    for row, g in summed_rows(ids, grads).items():
        for j, gj in enumerate(g):
            weight[row][j], accum[row][j], linear[row][j] = ftrl_coordinate(
                weight[row][j], accum[row][j], linear[row][j], gj, **kwargs
            )


def rowwise_adagrad_reference(weight, sums, ids, grads, *, lr, eps=1e-10, weight_decay=0.0, **_):
    """FBGEMM's row-wise Adagrad (L2 weight decay: the gradient gains weight_decay * w): accumulate
    the mean squared gradient, then step the row."""
    for row, g in summed_rows(ids, grads).items():
        g = [x + weight_decay * w for x, w in zip(g, weight[row])]
        sums[row] += sum(x * x for x in g) / len(g)
        multiplier = lr / (math.sqrt(sums[row]) + eps)
        weight[row] = [w - multiplier * x for w, x in zip(weight[row], g)]


# ---- helpers


def sparse(ids: list[int], grads: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([ids]), grads, (rows, grads.shape[1]), check_invariants=True)


def steps(rows: int, dim: int, count: int, seed: int, *, dense: bool):
    """``count`` steps of (ids, gradient rows): repeated ids, some rows never touched; dense: every row once."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if dense:
            ids = list(range(rows))
        else:
            ids = torch.randint(0, rows - 3, (rows,), generator=g).tolist()  # the last 3 rows: never
        out.append((ids, torch.randn(len(ids), dim, generator=g, dtype=torch.float64) * 2))
    return out


def run(optimizer_class, kwargs, start: torch.Tensor, work, *, dense: bool):
    param = start.clone().requires_grad_()
    optimizer = optimizer_class([param], **kwargs)
    for ids, grads in work:
        param.grad = sparse(ids, grads, start.shape[0])
        if dense:
            param.grad = param.grad.to_dense()
        optimizer.step()
    return param.detach(), optimizer.state[param]


FTRL_CASES = [
    {"lr": 0.1},
    {"lr": 0.2, "l1": 0.05, "l2": 0.01},
    {"lr": 0.1, "lr_power": -0.3, "l2_shrinkage": 0.02},
    {"lr": 0.05, "lr_power": 0.0, "l1": 0.01, "beta": 1.0},
    {"lr": 0.1, "l1": 8.0, "l2": 0.5, "initial_accumulator_value": 0.5},  # l1 large: most weights exactly 0
]


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
@pytest.mark.parametrize("kwargs", FTRL_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_ftrl_steps_as_the_published_formula(kwargs, dense):
    rows, dim = 9, 3
    start = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    work = steps(rows, dim, 5, seed=2, dense=dense)
    weight, state = run(Ftrl, kwargs, start, work, dense=dense)
    initial = kwargs.get("initial_accumulator_value", 0.1)
    w, n, z = start.tolist(), [[initial] * dim for _ in range(rows)], [[0.0] * dim for _ in range(rows)]
    for ids, grads in work:
        ftrl_reference(w, n, z, ids, grads.tolist(), {"lr_power": -0.5, **kwargs})
    expected = torch.tensor(w, dtype=torch.float64)
    torch.testing.assert_close(weight, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["accum"], torch.tensor(n, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["linear"], torch.tensor(z, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert bool((weight[expected == 0] == 0).all())  # zeroed by l1: exactly
    if kwargs.get("l1", 0) >= 8.0:
        assert int((weight == 0).sum()) > rows * dim // 3  # a third at least, exactly 0
    if not dense:  # rows no gradient named: values and state as they started
        assert torch.equal(weight[-3:], start[-3:])
        assert bool((state["accum"][-3:] == initial).all()) and bool((state["linear"][-3:] == 0).all())


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "sparse"])
@pytest.mark.parametrize(
    "kwargs",
    [{"lr": 0.1}, {"lr": 0.3, "eps": 1e-3, "initial_accumulator_value": 0.2}, {"lr": 0.2, "weight_decay": 0.05}],
    ids=["plain", "eps-init", "weight-decay"],
)
def test_rowwise_adagrad_steps_as_fbgemm_defines_it(kwargs, dense):
    rows, dim = 9, 4
    start = torch.randn(rows, dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    work = steps(rows, dim, 5, seed=4, dense=dense)
    weight, state = run(RowWiseAdagrad, kwargs, start, work, dense=dense)
    w, sums = start.tolist(), [kwargs.get("initial_accumulator_value", 0.0)] * rows
    for ids, grads in work:
        rowwise_adagrad_reference(w, sums, ids, grads.tolist(), **kwargs)
    torch.testing.assert_close(weight, torch.tensor(w, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert state["sum"].shape == (rows,)  # one float per row
    torch.testing.assert_close(state["sum"], torch.tensor(sums, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    if not dense:
        assert torch.equal(weight[-3:], start[-3:]) and torch.equal(
            state["sum"][-3:], torch.tensor(sums[-3:], dtype=torch.float64)
        )


@pytest.mark.parametrize(
    ("optimizer_class", "kwargs"),
    [(Ftrl, {"lr": 0.1, "l1": 0.01, "l2": 0.01}), (RowWiseAdagrad, {"lr": 0.1})],
    ids=["ftrl", "rowwise-adagrad"],
)
def test_float32_tables_agree_with_the_reference(optimizer_class, kwargs):
    rows, dim = 12, 8
    start = torch.randn(rows, dim, generator=torch.Generator().manual_seed(5))
    work = steps(rows, dim, 6, seed=6, dense=False)
    weight, _ = run(optimizer_class, kwargs, start, [(i, g.float()) for i, g in work], dense=False)
    reference, _ = run(optimizer_class, kwargs, start.double(), work, dense=False)
    w = start.double().tolist()
    if optimizer_class is Ftrl:
        n, z = [[0.1] * dim for _ in range(rows)], [[0.0] * dim for _ in range(rows)]
        for ids, grads in work:
            ftrl_reference(w, n, z, ids, grads.float().double().tolist(), kwargs)
    else:
        sums = [0.0] * rows
        for ids, grads in work:
            rowwise_adagrad_reference(w, sums, ids, grads.float().double().tolist(), **kwargs)
    assert weight.dtype == torch.float32
    torch.testing.assert_close(weight, torch.tensor(w, dtype=torch.float32))
    torch.testing.assert_close(reference, torch.tensor(w, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: psframe.optim.Ftrl(lr=-0.1), "lr=-0.1: expected > 0"),
        (lambda: psframe.optim.Ftrl(lr=0.1, lr_power=0.5), "lr_power=0.5: expected <= 0"),
        (lambda: psframe.optim.Ftrl(lr=0.1, l1=-1.0), "l1=-1.0: expected >= 0"),
        (lambda: psframe.optim.Ftrl(lr=0.1, l2=-0.5), "l2=-0.5: expected >= 0"),
        (lambda: psframe.optim.Ftrl(lr=0.1, l2_shrinkage=-1e-3), "l2_shrinkage=-0.001: expected >= 0"),
        (lambda: psframe.optim.Ftrl(lr=0.1, initial_accumulator_value=-1), "initial_accumulator_value=-1"),
        (lambda: psframe.optim.RowWiseAdagrad(lr=-1.0), "lr=-1.0: expected >= 0"),
        (lambda: psframe.optim.RowWiseAdagrad(lr=0.1, eps=-1.0), "eps=-1.0: expected >= 0"),
        (lambda: psframe.optim.RowWiseAdagrad(lr=0.1, weight_decay=-0.1), "weight_decay=-0.1: expected >= 0"),
    ],
)
def test_bad_arguments_are_refused_up_front_saying_what_was_expected(make, expected):
    with pytest.raises(OptimizerConfigError, match=expected) as raised:
        make()
    assert "psframe.optim." in str(raised.value)


def test_both_are_table_optimizers_and_a_new_row_starts_as_a_new_table():
    for spec in (psframe.optim.Ftrl(lr=0.1), psframe.optim.RowWiseAdagrad(lr=0.1)):
        assert spec.for_tables() == spec
    assert fresh_row_state("Ftrl", {}) == {"accum": 0.1, "linear": 0.0}
    assert fresh_row_state("Ftrl", {"initial_accumulator_value": 0.5}) == {"accum": 0.5, "linear": 0.0}
    assert fresh_row_state("RowWiseAdagrad", {"initial_accumulator_value": 0.2}) == {"sum": 0.2}
    # What a new table gets, built: the same values.
    table = torch.zeros(3, 2, requires_grad=True)
    built = OptimizerSpec("Ftrl", {"initial_accumulator_value": 0.5}).build([table], per_parameter=True)
    assert bool((built.state[table]["accum"] == 0.5).all()) and bool((built.state[table]["linear"] == 0).all())


def test_row_state_is_told_from_whole_state():
    assert is_row_state(torch.zeros(5, 3), (5, 3)) and is_row_state(torch.zeros(5), (5, 3))
    assert not is_row_state(torch.zeros(()), (5, 3)) and not is_row_state(torch.zeros(3), (5, 3))
    assert not is_row_state(1.0, (5, 3)) and is_row_state(torch.zeros(5), (5,))


INIT = RowInitializer(std=0.3, seed=11)


@pytest.mark.parametrize("name", ["Ftrl", "RowWiseAdagrad"])
def test_a_dynamic_part_steps_as_the_reference_and_keeps_state_through_growth_eviction_and_export(name):
    kwargs = {"lr": 0.2, "l1": 0.01, "initial_accumulator_value": 0.3} if name == "Ftrl" else {"lr": 0.2}
    spec = OptimizerSpec(name, kwargs)
    part = DynamicRows("users", (4,), torch.float64, DynamicTableSpec(INIT, Eviction(max_rows=40)), spec, slots=2)
    g = torch.Generator().manual_seed(8)
    reference: dict[int, dict] = {}  # id -> its row and state, as the formulas step them
    for _ in range(6):
        ids = torch.randint(0, 20, (12,), generator=g) * 1009 - 5000  # repeats; the slots grow from 2
        grads = torch.randn(12, 4, generator=g, dtype=torch.float64)
        rows_before = part.read(ids)  # a lookup makes the rows, as a training batch's does
        for i, row in zip(ids.tolist(), rows_before):
            fresh = {"accum": [0.3] * 4, "linear": [0.0] * 4} if name == "Ftrl" else {"sum": 0.0}
            reference.setdefault(i, {"w": row.tolist(), **fresh})
        part.apply(ids, grads)
        for i, g_row in summed_rows(ids.tolist(), grads.tolist()).items():
            r = reference[i]
            if name == "Ftrl":
                w, n, z = [r["w"]], [r["accum"]], [r["linear"]]
                ftrl_reference(w, n, z, [0], [g_row], kwargs)
                r["w"], r["accum"], r["linear"] = w[0], n[0], z[0]
            else:
                w, s = [r["w"]], [r["sum"]]
                rowwise_adagrad_reference(w, s, [0], [g_row], **kwargs)
                r["w"], r["sum"] = w[0], s[0]
    assert part.slots > 2  # grown: the state moved with the rows
    saved = part.export()
    held = saved["ids"].tolist()
    assert held == sorted(reference)
    expected_rows = torch.tensor([reference[i]["w"] for i in held], dtype=torch.float64)
    torch.testing.assert_close(saved["rows"], expected_rows, rtol=1e-12, atol=1e-12)
    for key in ("accum", "linear") if name == "Ftrl" else ("sum",):
        expected = torch.tensor([reference[i][key] for i in held], dtype=torch.float64)
        torch.testing.assert_close(saved["state"][key], expected, rtol=1e-12, atol=1e-12)
    # Restored into a new part: the same rows and state; a new id there starts fresh.
    again = DynamicRows("users", (4,), torch.float64, DynamicTableSpec(INIT, Eviction(max_rows=40)), spec, slots=2)
    again.load(saved)
    restored = again.export()
    for key, value in saved["state"].items():
        assert torch.equal(restored["state"][key], value)
    assert torch.equal(restored["rows"], saved["rows"])
    again.read(torch.tensor([123456789]))
    fresh_state = again.export()["state"]
    at = again.export()["ids"].tolist().index(123456789)
    for key, start in fresh_row_state(name, kwargs).items():
        assert bool((fresh_state[key][at] == start).all())


@pytest.mark.parametrize("name", ["Ftrl", "RowWiseAdagrad"])
def test_an_evicted_row_comes_back_with_fresh_state(name):
    spec = OptimizerSpec(name, {"lr": 0.5})
    part = DynamicRows("t", (2,), torch.float32, DynamicTableSpec(INIT, Eviction(max_rows=2)), spec, slots=2)
    part.read(torch.tensor([1, 2]))
    part.apply(torch.tensor([1, 2]), torch.ones(2, 2))
    part.read(torch.tensor([3, 4]))  # the cap: 1 and 2 are evicted
    part.read(torch.tensor([1]))  # made again
    saved = part.export()
    at = saved["ids"].tolist().index(1)
    for key, start in fresh_row_state(name, {"lr": 0.5}).items():
        assert bool((saved["state"][key][at] == start).all()), key


@pytest.mark.parametrize("factory", [psframe.optim.Ftrl, psframe.optim.RowWiseAdagrad])
def test_a_learning_rate_schedule_sets_their_lr_by_global_step(factory):
    global_step = [0]
    spec = factory(lr=0.4, schedule=lr_scheduler.StepLR(step_size=2, gamma=0.5))
    clock = ScheduleClock(spec, lambda: global_step[0])
    table = torch.zeros(3, 2, requires_grad=True)
    optimizer = spec.build([table], per_parameter=True)
    seen, applied = [], -1
    for step in range(5):
        global_step[0] = step
        applied = clock.apply(optimizer, applied)
        seen.append(optimizer.param_groups[0]["lr"])
        table.grad = sparse([0, 2], torch.ones(2, 2), 3)
        optimizer.step()
    assert seen == pytest.approx([0.4, 0.4, 0.2, 0.2, 0.1], rel=1e-12)

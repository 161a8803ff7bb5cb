"""Adagrad on embedding tables by gathers and scatters of the rows (psframe.optim.rows_kernels.adagrad_rows_step):
torch.optim.Adagrad's bits, or torch's own step."""

from __future__ import annotations

import pytest
import torch

from psframe.optim import kernels, rows_kernels

ROWS = 97


@pytest.fixture
def fresh_rows_decisions():
    """Forget the per-process decisions before and after the test."""
    rows_kernels._decide_rows_kernel.cache_clear()
    yield
    rows_kernels._decide_rows_kernel.cache_clear()


def _sparse(rows: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=False)


def _gradients(shape: tuple[int, ...], dtype: torch.dtype, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Sparse gradients of some rows each: coalesced, repeating rows (uncoalesced), and none at all."""
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for step in range(steps):
        if step == 3:
            rows = torch.zeros(0, dtype=torch.int64)  # a batch that used the table: no rows, a step all the same
        elif step == 4:
            rows = torch.randint(0, shape[0], (ROWS,), generator=generator)  # repeats: summed, as backward's are
        else:
            rows = torch.unique(torch.randint(0, shape[0], (ROWS // 2,), generator=generator))
        scale = torch.exp(3 * torch.randn((rows.numel(),) + (1,) * (len(shape) - 1), dtype=dtype, generator=generator))
        values = torch.randn((rows.numel(), *shape[1:]), dtype=dtype, generator=generator) * scale
        grad = _sparse(rows, values, shape)
        grads.append(grad if step == 4 else grad.coalesce())
    return grads


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _step_both(kwargs: dict, shape: tuple[int, ...], dtype: torch.dtype, steps: int = 8):
    """torch.optim.Adagrad stepped by torch, and by kernels.step, from the same values and gradients."""
    start = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    theirs, ours = start.clone().requires_grad_(), start.clone().requires_grad_()
    torch_opt = torch.optim.Adagrad([theirs], foreach=False, **kwargs)
    psframe_opt = torch.optim.Adagrad([ours], foreach=False, **kwargs)
    took = []
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for grad in _gradients(shape, dtype, steps):
            theirs.grad, ours.grad = grad, grad.clone()
            torch_opt.step()
            took.append(rows_kernels.adagrad_rows_step(psframe_opt))
            if not took[-1]:
                kernels.step(psframe_opt)
    return (theirs, torch_opt.state[theirs]), (ours, psframe_opt.state[ours]), took


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("row_shape", [(), (1,), (8,), (2, 3)])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.05},
        {"lr": 0.3, "lr_decay": 0.01, "eps": 1e-6, "initial_accumulator_value": 0.1},
        {"lr": 0.1, "maximize": True},
    ],
)
def test_rows_step_gives_torch_optims_bits(fresh_rows_decisions, dtype, row_shape, kwargs):
    (theirs, their_state), (ours, our_state), took = _step_both(kwargs, (ROWS * 3, *row_shape), dtype)
    assert all(took)  # torch.optim.Adagrad makes its state when built: every step is the rows'
    assert _same_bits(theirs, ours)
    assert _same_bits(their_state["sum"], our_state["sum"])
    assert _same_bits(their_state["step"], our_state["step"])


def test_optimizer_kernels_step_takes_the_rows_step(fresh_rows_decisions, monkeypatch):
    taken = []
    rows_step = rows_kernels.adagrad_rows_step
    monkeypatch.setattr(rows_kernels, "adagrad_rows_step", lambda opt: taken.append(rows_step(opt)) or taken[-1])
    start = torch.randn(ROWS, 4)
    theirs, ours = start.clone().requires_grad_(), start.clone().requires_grad_()
    torch_opt = torch.optim.Adagrad([theirs], lr=0.1, foreach=False)
    psframe_opt = torch.optim.Adagrad([ours], lr=0.1, foreach=False)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for grad in _gradients((ROWS, 4), torch.float32, 5):
            theirs.grad, ours.grad = grad, grad.clone()
            torch_opt.step()
            kernels.step(psframe_opt, rows=True)
    assert taken == [True] * 5
    assert _same_bits(theirs, ours)


def test_a_dense_step_never_looks_for_the_rows_step(monkeypatch):
    """Off costs nothing: a dense variable's Adagrad step does not probe the row kernel."""
    probed = []
    monkeypatch.setattr(rows_kernels, "adagrad_rows_step", lambda opt: probed.append(opt) or False)
    start = torch.randn(ROWS, 4)
    theirs, ours = start.clone().requires_grad_(), start.clone().requires_grad_()
    torch_opt = torch.optim.Adagrad([theirs], lr=0.1)
    psframe_opt = torch.optim.Adagrad([ours], lr=0.1)
    for seed in range(3):
        grad = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(seed))
        theirs.grad, ours.grad = grad, grad.clone()
        torch_opt.step()
        kernels.step(psframe_opt)
    assert probed == []
    assert _same_bits(theirs, ours)


_TORCH_ORDER_ROWS = rows_kernels._adagrad_rows


def _one_ulp_off(param, grad, state, group):
    _TORCH_ORDER_ROWS(param, grad, state, group)
    with torch.no_grad():
        param.view(-1)[0] = torch.nextafter(param.view(-1)[0], torch.tensor(float("inf"), dtype=param.dtype))


def test_a_kernel_one_ulp_off_is_never_used(fresh_rows_decisions, monkeypatch, caplog):
    monkeypatch.setattr(rows_kernels, "_adagrad_rows", _one_ulp_off)
    with caplog.at_level("INFO", logger="psframe.optim.rows_kernels"):
        (theirs, _), (ours, _), took = _step_both({"lr": 0.1}, (ROWS, 8), torch.float32)
    assert not any(took)
    assert _same_bits(theirs, ours)  # torch's own step, every time
    assert "torch's own sparse step" in caplog.text and "differ after" in caplog.text


def test_the_decision_is_made_once_per_dtype_row_shape_and_arguments(fresh_rows_decisions, monkeypatch):
    calls = []
    check = rows_kernels._rows_kernel_difference
    monkeypatch.setattr(rows_kernels, "_rows_kernel_difference", lambda *args: calls.append(args) or check(*args))
    for _ in range(2):
        _step_both({"lr": 0.1}, (ROWS, 8), torch.float32, steps=3)
    _step_both({"lr": 0.1}, (ROWS, 4), torch.float32, steps=3)
    _step_both({"lr": 0.2}, (ROWS, 8), torch.float32, steps=3)
    assert [(args[0], args[1], args[2]["lr"]) for args in calls] == [
        (torch.float32, (8,), 0.1),
        (torch.float32, (4,), 0.1),
        (torch.float32, (8,), 0.2),
    ]


def test_the_decision_leaves_the_global_random_state_alone(fresh_rows_decisions):
    before = torch.get_rng_state()
    assert rows_kernels.rows_kernel_agrees(torch.float32, (8,), 0.1, 0.0, 1e-10, False) in (True, False)
    assert torch.equal(before, torch.get_rng_state())


def _stepped_once(kwargs: dict | None = None, **group: object) -> tuple[torch.optim.Adagrad, torch.Tensor]:
    """An Adagrad over one table whose state torch made, with a sparse gradient set."""
    param = torch.randn(ROWS, 4).requires_grad_()
    optimizer = torch.optim.Adagrad([param], foreach=False, **(kwargs or {"lr": 0.1}))
    grad = _sparse(torch.tensor([1, 5]), torch.ones(2, 4), (ROWS, 4)).coalesce()
    param.grad = grad
    optimizer.step()
    optimizer.param_groups[0].update(group)
    param.grad = grad
    return optimizer, param


@pytest.mark.parametrize(
    "change",
    [
        {"foreach": True},
        {"differentiable": True},
        {"lr": torch.tensor(0.1)},
    ],
    ids=["foreach", "differentiable", "tensor lr"],
)
def test_groups_the_rows_step_does_not_cover_are_left_to_torch(fresh_rows_decisions, change):
    optimizer, param = _stepped_once(**change)
    before = param.detach().clone()
    assert rows_kernels.adagrad_rows_step(optimizer) is False
    assert torch.equal(param.detach(), before)


def test_a_step_with_any_dense_gradient_is_left_to_torch_whole(fresh_rows_decisions):
    tables = [torch.randn(ROWS, 4).requires_grad_() for _ in range(2)]
    optimizer = torch.optim.Adagrad(tables, lr=0.1, foreach=False)
    for table in tables:
        table.grad = _sparse(torch.tensor([2]), torch.ones(1, 4), (ROWS, 4)).coalesce()
    optimizer.step()
    before = [t.detach().clone() for t in tables]
    tables[0].grad = _sparse(torch.tensor([3]), torch.ones(1, 4), (ROWS, 4)).coalesce()
    tables[1].grad = torch.ones(ROWS, 4)  # dense: torch's step, for both tables
    assert rows_kernels.adagrad_rows_step(optimizer) is False
    assert all(torch.equal(t.detach(), b) for t, b in zip(tables, before))


def test_other_optimizers_are_left_to_torch():
    param = torch.randn(ROWS, 4).requires_grad_()
    param.grad = _sparse(torch.tensor([1]), torch.ones(1, 4), (ROWS, 4)).coalesce()
    assert rows_kernels.adagrad_rows_step(torch.optim.SGD([param], lr=0.1)) is False


@pytest.mark.parametrize("kwargs", [{"lr": 0.05}, {"lr": 0.3, "lr_decay": 0.01, "maximize": True}])
def test_pushed_rows_stepped_directly_give_torch_optims_bits(fresh_rows_decisions, kwargs):
    """A ps task's push, ``(table, sorted distinct ids, rows)``, stepped with no sparse gradient in between."""
    start = torch.randn(ROWS * 3, 8, generator=torch.Generator().manual_seed(1))
    theirs, ours = start.clone().requires_grad_(), start.clone().requires_grad_()
    torch_opt = torch.optim.Adagrad([theirs], foreach=False, **kwargs)
    psframe_opt = torch.optim.Adagrad([ours], foreach=False, **kwargs)
    for grad in _gradients(tuple(start.shape), torch.float32, 8):
        grad = grad.coalesce()
        theirs.grad = grad
        torch_opt.step()
        assert kernels.step_rows(psframe_opt, [(ours, grad.indices()[0], grad.values())])
    assert _same_bits(theirs, ours)
    assert _same_bits(torch_opt.state[theirs]["sum"], psframe_opt.state[ours]["sum"])
    assert _same_bits(torch_opt.state[theirs]["step"], psframe_opt.state[ours]["step"])


def test_pushed_rows_out_of_order_or_repeated_are_left_to_the_sparse_step(fresh_rows_decisions):
    table = torch.randn(ROWS, 4).requires_grad_()
    optimizer = torch.optim.Adagrad([table], lr=0.1, foreach=False)
    before = (table.detach().clone(), optimizer.state[table]["sum"].clone(), optimizer.state[table]["step"].clone())
    for ids in (torch.tensor([3, 1, 7]), torch.tensor([1, 3, 3])):
        assert not kernels.step_rows(optimizer, [(table, ids, torch.ones(3, 4))])
    assert not kernels.step_rows(optimizer, [(table, torch.tensor([1, 2]), torch.ones(2, 4, dtype=torch.float64))])
    after = (table.detach(), optimizer.state[table]["sum"], optimizer.state[table]["step"])
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing changed


def test_a_store_steps_a_sorted_push_directly_and_any_other_through_the_sparse_gradient(
    fresh_rows_decisions, monkeypatch
):
    import psframe
    from psframe.ps.store import VariableStore
    from psframe.ps.store.table_parts import TableParts

    made = []
    sparse_gradients = TableParts.sparse_gradients
    monkeypatch.setattr(
        TableParts, "sparse_gradients", lambda self, rows: made.append(1) or sparse_gradients(self, rows)
    )
    start = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(3))
    store = VariableStore()
    store.create(
        {"emb": start}, psframe.optim.SGD(lr=1.0), tables=["emb"], table_optimizer=psframe.optim.Adagrad(lr=0.1)
    )
    reference = start.clone().requires_grad_()
    optimizer = torch.optim.Adagrad([reference], lr=0.1, foreach=False)
    for ids in (torch.tensor([1, 5, 9]), torch.tensor([9, 2, 2])):  # a worker's push, then one with repeats
        grads = torch.randn(3, 4, generator=torch.Generator().manual_seed(int(ids[0])))
        store.apply_rows([("emb", ids, grads)])
        reference.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grads, reference.shape).coalesce()
        optimizer.step()
    assert made == [1]  # only the second push needed a sparse gradient (its repeats summed)
    assert _same_bits(store.read_rows("emb", torch.arange(ROWS)), reference)
    assert store.pushes == 2

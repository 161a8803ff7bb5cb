"""Optimizers of embedding tables: updates that touch only the rows a push carries.

A ps task updates its embedding tables (variables pushed as rows, see
:mod:`psframe.worker.model.tables`) with ``torch.optim`` optimizers that take
sparse gradients and keep per-row state, so that a step costs the rows it
touched, never the table's size:

- ``SGD`` without momentum, ``Adagrad`` (its per-row sum of squares) and
  ``SparseAdam`` (Adam's moments, per row, updated lazily): torch's own.
- ``SGD`` with momentum: torch's keeps a momentum buffer of every row ever
  touched and decays all of them on every step (dense momentum, at a cost
  that grows with the rows seen). :class:`SparseSGD`, psframe's own,
  applies momentum lazily, as TensorFlow's ``SparseApplyMomentum`` does:
  only the rows pushed have their momentum decayed and their values moved.
- ``Ftrl`` (FTRL-Proximal as TensorFlow's, :mod:`psframe.optim.ftrl`) and
  ``RowWiseAdagrad`` (one accumulator per row, as FBGEMM's,
  :mod:`psframe.optim.rowwise_adagrad`): psframe's own too.

:func:`table_optimizer` picks the table optimizer that goes with a model's
optimizer when the user names none, and :func:`adagrad_rows_step` runs
``Adagrad``'s step on sparse gradients with gathers and scatters of the rows
(where it gives torch's bits), for a ps task's tables.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from psframe.errors import OptimizerConfigError

log = logging.getLogger(__name__)


def strictly_increasing(ids: torch.Tensor) -> bool:
    """Whether ``ids`` (int64, 1-d, on the CPU) are sorted and distinct, as a worker pushes them.

    numpy's compare of the two shifted views costs a third of torch's, each of
    whose operations is dispatched: this is checked on every push of rows.
    """
    values = ids.numpy()
    return bool((values[1:] > values[:-1]).all())


class SparseSGD(torch.optim.Optimizer):
    """SGD whose momentum is applied lazily to the rows a sparse gradient touches.

    For the rows ``i`` of a gradient ``g`` (a ``torch.sparse_coo`` tensor,
    duplicate rows summed)::

        m[i] = momentum * m[i] + g[i]            (m starts at zero)
        p[i] -= lr * (g[i] + momentum * m[i])    with nesterov
        p[i] -= lr * m[i]                        without

    Rows not in ``g`` are left alone, their momentum included. When every
    row is in every gradient this is ``torch.optim.SGD(lr, momentum,
    nesterov)`` step for step (whose first step also sets ``m = g``).

    Args:
        params: the tables (dense tensors; their gradients are sparse).
        lr: the learning rate.
        momentum: the momentum factor (0: plain SGD on the rows).
        nesterov: Nesterov momentum.

    Raises:
        ValueError: a negative learning rate or momentum, or nesterov without momentum.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid learning rate {lr}: expected >= 0")
        if momentum < 0.0:
            raise ValueError(f"invalid momentum {momentum}: expected >= 0")
        if nesterov and momentum <= 0.0:
            raise ValueError("nesterov momentum needs a momentum > 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every table with a gradient (``closure`` is not supported)."""
        if closure is not None:
            raise ValueError("SparseSGD.step takes no closure")
        for group in self.param_groups:
            lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not grad.is_sparse or grad.sparse_dim() != 1:
                    raise RuntimeError(
                        "SparseSGD updates embedding tables from gradients sparse in their "
                        "rows (a torch.sparse_coo tensor of sparse_dim 1), as backward gives them"
                    )
                grad = grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                if momentum == 0.0:
                    param.index_add_(0, rows, values, alpha=-lr)
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                buffer = state["momentum_buffer"]
                row_momentum = buffer.index_select(0, rows).mul_(momentum).add_(values)
                buffer.index_copy_(0, rows, row_momentum)
                update = values.add(row_momentum, alpha=momentum) if nesterov else row_momentum
                param.index_add_(0, rows, update, alpha=-lr)
        return None


# Table optimizers by name: torch.optim's that take sparse gradients, and psframe's own.
TABLE_OPTIMIZERS = ("SGD", "SparseSGD", "Adagrad", "SparseAdam", "Ftrl", "RowWiseAdagrad")


def table_optimizer(name: str, kwargs: dict) -> tuple[str, dict]:
    """The table optimizer (name and keyword arguments) for a model optimized by ``name(**kwargs)``.

    ``SGD`` with momentum becomes :class:`SparseSGD`, ``Adam`` becomes
    ``SparseAdam`` (same ``lr``, ``betas``, ``eps``), and the table
    optimizers stay what they are.

    Raises:
        OptimizerConfigError: no table optimizer goes with it (name one with
            ``Trainer(table_optimizer=...)``), or an argument that sparse
            updates cannot honour (weight decay: it would touch every row).
    """
    kwargs = dict(kwargs)
    if kwargs.get("weight_decay"):
        raise OptimizerConfigError(
            f"{name}(weight_decay={kwargs['weight_decay']}) cannot update embedding tables row by row "
            f"(decay touches every row); give Trainer(table_optimizer=...) without weight_decay"
        )
    kwargs.pop("weight_decay", None)
    kwargs.pop("foreach", None)
    if name == "SGD":
        if kwargs.pop("dampening", 0):
            _refuse(name, {"dampening"})
        _refuse(name, set(kwargs) - {"lr", "momentum", "nesterov"})
        return ("SparseSGD", kwargs) if kwargs.get("momentum") else ("SGD", kwargs)
    if name in ("Adam", "SparseAdam"):
        if kwargs.pop("amsgrad", False):
            _refuse(name, {"amsgrad"})
        _refuse(name, set(kwargs) - {"lr", "betas", "eps", "maximize"})
        return "SparseAdam", kwargs
    if name in ("Adagrad", "SparseSGD", "Ftrl", "RowWiseAdagrad"):
        return name, kwargs
    raise OptimizerConfigError(
        f"{name} does not update embedding tables row by row; give Trainer(table_optimizer=...) "
        f"one of {', '.join(TABLE_OPTIMIZERS)} (psframe.optim.SGD, Adagrad, SparseAdam, SparseSGD, "
        f"Ftrl or RowWiseAdagrad)"
    )


def _refuse(name: str, unsupported: set[str]) -> None:
    if unsupported:
        raise OptimizerConfigError(
            f"{name}({', '.join(sorted(unsupported))}=...) has no row-by-row form for embedding tables; "
            f"give Trainer(table_optimizer=...) without it"
        )


# ---- Adagrad, row by row
#
# torch.optim.Adagrad updates a table from a sparse gradient with two
# dense-plus-sparse additions (the sum of squares, then the rows), each a
# BLAS axpy call per row, and a sparse_mask: about 0.15 us per row of 8
# floats, 3 times the cost of gathering the rows, computing, and scattering
# them back. adagrad_rows_step does the latter, with the same
# operations in the same order: sum += g^2 (axpy with alpha 1: one rounding,
# as an add), std = sqrt(sum) + eps, param += -clr * (g / std) (axpy: a fused
# multiply-add, as ``add_(alpha=)`` is on CPUs with FMA). Whether both give
# the same bits depends on the BLAS and the CPU, so it is decided by running
# both, once per process for each dtype, row shape and arguments
# (rows_kernel_agrees); where they differ, torch's step runs. Under a
# learning-rate schedule the rate changes at every step: the decision is the
# one for the rate the schedule started from, not a check per rate.

_ROWS_CHECK_TABLE = 67  # rows of the check's table: odd, so no row count lines up with a vector width
_ROWS_CHECK_STEPS = 4


def adagrad_rows_step(optimizer: torch.optim.Optimizer) -> bool:
    """One ``torch.optim.Adagrad`` step over sparse row gradients, by gathers and scatters of the rows touched.

    Runs only where every parameter with a gradient is a contiguous float32
    or float64 CPU table with a gradient sparse in its rows and the state
    torch made for it (``Adagrad`` makes it when built), in groups of plain
    arguments (no weight decay, fused, differentiable or tensor learning
    rate), and where the kernel gave torch's bits in this process's check
    (see :func:`rows_kernel_agrees`); else it changes nothing.

    Returns:
        True if the step was taken (values, sums and step counts updated as
        ``optimizer.step()`` would have), False if ``optimizer.step()`` must
        take it.
    """
    if type(optimizer) is not torch.optim.Adagrad:
        return False
    work = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            state = optimizer.state.get(param)
            if state is None or not _rows_step_applies(group, param, grad, state):
                return False
            work.append((group, param, grad, state))
    if not work:
        return False
    # Every table is checked before any changes: the step is taken whole or not at all.
    with torch.no_grad():
        for group, param, grad, state in work:
            _adagrad_rows(param, grad, state, group)
    return True


def adagrad_rows_direct(
    optimizer: torch.optim.Optimizer, work: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> bool:
    """:func:`adagrad_rows_step` on pushed rows as they came, ``(table, ids, gradient rows)``, with
    no sparse gradient built and taken apart in between (a ps task's push of rows).

    Runs only where :func:`adagrad_rows_step` would, and where each table's ids
    are sorted and distinct (a worker's push), so the rows need no summing;
    else it changes nothing. Every table is checked before any changes.

    Returns:
        True if the step was taken, False if the caller must step with sparse gradients.
    """
    if type(optimizer) is not torch.optim.Adagrad:
        return False
    groups = {id(param): group for group in optimizer.param_groups for param in group["params"]}
    checked = []
    for param, ids, values in work:
        group, state = groups.get(id(param)), optimizer.state.get(param)
        if (
            group is None
            or state is None
            or values.dtype != param.dtype
            or tuple(values.shape) != (ids.numel(), *param.shape[1:])
            or not _table_takes_rows(group, param, state)
            or ids.dtype != torch.int64
            or ids.dim() != 1
            or not strictly_increasing(ids)  # no row to sum
        ):
            return False
        checked.append((param, ids, values, state, group))
    with torch.no_grad():
        for param, ids, values, state, group in checked:
            _adagrad_rows_of(param, ids, values, state, group)
    return True


def _hyperparameters(group: dict, *, started: bool = False) -> tuple[float, float, float, bool]:
    """A group's arguments of the update; ``started``: with the rate a learning-rate schedule started
    from (``initial_lr``, as torch's schedulers write it), for which the kernel is decided once."""
    lr = group.get("initial_lr", group["lr"]) if started else group["lr"]
    return (lr, group["lr_decay"], group["eps"], bool(group["maximize"]))


def _rows_step_applies(group: dict, param: torch.Tensor, grad: torch.Tensor, state: dict) -> bool:
    """Whether :func:`_adagrad_rows` takes this table's step as torch would."""
    if not grad.is_sparse or grad.sparse_dim() != 1 or grad.dtype != param.dtype or grad.shape != param.shape:
        return False
    return _table_takes_rows(group, param, state)


def _table_takes_rows(group: dict, param: torch.Tensor, state: dict) -> bool:
    """Whether the row kernel takes steps of this table (its optimizer group and state) as torch would."""
    if (
        group.get("fused")
        or group.get("differentiable")
        or group.get("foreach")  # psframe's tables run the per-parameter kernels; the rest is left to torch
        or group["weight_decay"] != 0
        or isinstance(group["lr"], torch.Tensor)
    ):
        return False
    if (
        param.dim() < 1
        or param.device.type != "cpu"
        or param.dtype not in (torch.float32, torch.float64)
        or not param.is_contiguous()
        or not state
        or not isinstance(state.get("sum"), torch.Tensor)
        or not isinstance(state.get("step"), torch.Tensor)
    ):
        return False
    total = state["sum"]
    if total.dtype != param.dtype or total.shape != param.shape or not total.is_contiguous():
        return False
    return rows_kernel_agrees(param.dtype, tuple(param.shape[1:]), *_hyperparameters(group, started=True))


def _adagrad_rows(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """torch's sparse Adagrad update of ``param`` (``_single_tensor_adagrad``), row by row."""
    grad = grad.coalesce()  # as torch's: the update is not linear, so each row once
    _adagrad_rows_of(param, grad._indices()[0], grad._values(), state, group)


def _adagrad_rows_of(param: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, state: dict, group: dict) -> None:
    """The update of :func:`_adagrad_rows` for distinct ``rows`` and their gradients ``values``."""
    lr, lr_decay, eps, maximize = _hyperparameters(group)
    if maximize:
        values = -values
    step_t = state["step"]
    step_t += 1
    clr = lr / (1 + (step_t.item() - 1) * lr_decay)
    total = state["sum"]
    sums = total.index_select(0, rows).add_(values.pow(2))
    total.index_copy_(0, rows, sums)
    std = sums.sqrt_().add_(eps)
    weight = param.detach()
    weight.index_copy_(0, rows, weight.index_select(0, rows).add_(values / std, alpha=-clr))


def rows_kernel_agrees(
    dtype: torch.dtype, row_shape: tuple[int, ...], lr: float, lr_decay: float, eps: float, maximize: bool
) -> bool:
    """Whether :func:`adagrad_rows_step` gives ``torch.optim.Adagrad``'s bits for tables of
    this dtype and row shape and these arguments, on the installed torch and this CPU.

    Decided once per process for each, by a few steps of both from the same
    values and gradients (random, from a private generator) on a small
    table, bit for bit; a millisecond or two. The answer is logged (debug
    when they agree, info when they do not); a check that fails to run
    counts as a difference, so a False only ever costs speed.
    """
    return _decide_rows_kernel(dtype, row_shape, lr, lr_decay, eps, maximize)


@functools.lru_cache(maxsize=64)
def _decide_rows_kernel(
    dtype: torch.dtype, row_shape: tuple[int, ...], lr: float, lr_decay: float, eps: float, maximize: bool
) -> bool:
    what = f"Adagrad(lr={lr}, lr_decay={lr_decay}, eps={eps}, maximize={maximize}) on {dtype} rows of {row_shape}"
    try:
        # torch's step makes sparse tensors of its own: said outright, their checks are off (as by default).
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            difference = _rows_kernel_difference(
                dtype, row_shape, {"lr": lr, "lr_decay": lr_decay, "eps": eps, "maximize": maximize}
            )
    except Exception as e:  # noqa: BLE001 - any failure leaves them not shown equal: the safe answer
        difference = f"could not be compared ({type(e).__name__}: {e})"
    if difference is None:
        log.debug(
            "%s: row gathers and scatters give torch's bits on torch %s; tables use them", what, torch.__version__
        )
        return True
    log.info(
        "%s: torch's own sparse step: on torch %s row gathers and scatters %s", what, torch.__version__, difference
    )
    return False


def _rows_kernel_difference(dtype: torch.dtype, row_shape: tuple[int, ...], kwargs: dict) -> str | None:
    """None if torch's step and :func:`_adagrad_rows` end on the same bits; else what differs."""
    generator = torch.Generator().manual_seed(0)
    shape = (_ROWS_CHECK_TABLE, *row_shape)
    start = torch.randn(shape, dtype=dtype, generator=generator)
    theirs, ours = start.clone().requires_grad_(), start.clone().requires_grad_()
    torch_opt = torch.optim.Adagrad([theirs], foreach=False, **kwargs)
    rows_opt = torch.optim.Adagrad([ours], foreach=False, **kwargs)
    for step in range(_ROWS_CHECK_STEPS):
        rows = torch.randperm(_ROWS_CHECK_TABLE, generator=generator)[: _ROWS_CHECK_TABLE // 2 + step].sort().values
        # Gradients of many magnitudes, so that a difference in rounding shows.
        scale = torch.exp(4 * torch.randn((rows.numel(),) + (1,) * len(row_shape), dtype=dtype, generator=generator))
        values = torch.randn((rows.numel(), *row_shape), dtype=dtype, generator=generator) * scale
        grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, shape, check_invariants=False).coalesce()
        theirs.grad, ours.grad = grad, grad.clone()
        torch_opt.step()
        _rows_step_unchecked(rows_opt)
    pairs = {"values": (theirs, ours), "sums": (torch_opt.state[theirs]["sum"], rows_opt.state[ours]["sum"])}
    pairs["steps"] = (torch_opt.state[theirs]["step"], rows_opt.state[ours]["step"])
    for name, (a, b) in pairs.items():
        if not torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)):
            count = int((a.detach() != b.detach()).sum())
            return f"differ after {_ROWS_CHECK_STEPS} steps: {count} of the {a.numel()} {name}"
    return None


def _rows_step_unchecked(optimizer: torch.optim.Optimizer) -> None:
    """:func:`adagrad_rows_step` without asking whether it agrees with torch (the check's own step)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    _adagrad_rows(param, param.grad, optimizer.state[param], group)

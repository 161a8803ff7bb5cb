"""Optimizers of embedding tables: updates that touch only the rows a push carries.

A ps task updates its embedding tables (variables pushed as rows, see
:mod:`psframe.worker.tables`) with ``torch.optim`` optimizers that take
sparse gradients and keep per-row state, so that a step costs the rows it
touched, never the table's size:

- ``SGD`` without momentum, ``Adagrad`` (its per-row sum of squares) and
  ``SparseAdam`` (Adam's moments, per row, updated lazily): torch's own.
- ``SGD`` with momentum: torch's keeps a momentum buffer of every row ever
  touched and decays all of them on every step (dense momentum, at a cost
  that grows with the rows seen). :class:`SparseSGD`, the one optimizer
  psframe writes itself, applies momentum lazily, as TensorFlow's
  ``SparseApplyMomentum`` does: only the rows pushed have their momentum
  decayed and their values moved.

:func:`table_optimizer` picks the table optimizer that goes with a model's
optimizer when the user names none.
"""

from __future__ import annotations

import torch

from psframe.errors import OptimizerConfigError


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
TABLE_OPTIMIZERS = ("SGD", "SparseSGD", "Adagrad", "SparseAdam")


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
    if name in ("Adagrad", "SparseSGD"):
        return name, kwargs
    raise OptimizerConfigError(
        f"{name} does not update embedding tables row by row; give Trainer(table_optimizer=...) "
        f"one of {', '.join(TABLE_OPTIMIZERS)} (psframe.optim.SGD, Adagrad, SparseAdam or SparseSGD)"
    )


def _refuse(name: str, unsupported: set[str]) -> None:
    if unsupported:
        raise OptimizerConfigError(
            f"{name}({', '.join(sorted(unsupported))}=...) has no row-by-row form for embedding tables; "
            f"give Trainer(table_optimizer=...) without it"
        )


def fresh_row_state(name: str, kwargs: dict) -> dict[str, float]:
    """The value a new row's element-wise state starts at, per state key, for
    table optimizer ``name`` (a key not listed starts at 0): what the
    optimizer itself gives every row of a new table. A dynamic table gives
    it to each row it creates (:mod:`psframe.dynamic_rows`).
    """
    if name == "Adagrad":
        return {"sum": float(kwargs.get("initial_accumulator_value", 0.0))}
    return {}

"""Row-wise Adagrad: Adagrad with one accumulator per embedding row, as FBGEMM defines it.

:class:`RowWiseAdagrad` is fbgemm_gpu's ``EXACT_ROWWISE_ADAGRAD`` (the
table optimizer of TorchRec's and FBGEMM's embedding kernels, with its L2
weight decay, ``WeightDecayMode.L2``): where Adagrad keeps a sum of squared
gradients per value, it keeps one per row, the running sum of the *mean* of
the row's squared gradients, so its state costs one float per row instead of
a row's worth. For a row ``w`` of ``D`` values and its gradient ``g``, in
this order::

    g        += weight_decay * w                   (L2 decay, of the rows a step updates)
    sum[row] += (g_1^2 + ... + g_D^2) / D          (accumulate first)
    w        -= lr / (sqrt(sum[row]) + eps) * g    (then update; eps outside the root)

The rows are a parameter's first dimension (a 1-d parameter's rows are its
values, which is plain Adagrad on them; a 0-d one is one row). A gradient
sparse in its rows (``torch.sparse_coo``) updates the rows it names, their
repeats summed first (the "exact" of FBGEMM's name: one update per row and
step); no other row or its accumulator changes.
"""

from __future__ import annotations

from typing import Any

import torch


def check_arguments(lr: float, eps: float, initial_accumulator_value: float, weight_decay: float = 0.0) -> None:
    """Refuse arguments row-wise Adagrad is not defined for, naming what is expected.

    Raises:
        ValueError: a negative ``lr``, ``eps``, accumulator start or ``weight_decay``.
    """
    named = (("lr", lr), ("eps", eps), ("initial_accumulator_value", initial_accumulator_value))
    for name, value in (*named, ("weight_decay", weight_decay)):
        if not value >= 0.0:
            raise ValueError(f"invalid {name}={value}: expected >= 0")


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row, as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (see the module).

    Its state, per parameter, is ``sum``: one value per row (shape ``(rows,)``),
    starting at ``initial_accumulator_value``, made when the optimizer is built.

    Args:
        params: the parameters (dense tensors; their gradients dense or sparse in their rows).
        lr: the learning rate, >= 0.
        eps: added to the root of the accumulator, >= 0 (TorchRec's default, 1e-10).
        initial_accumulator_value: where each row's accumulator starts, >= 0.
        weight_decay: L2 decay of the rows a step updates (their gradient gains ``weight_decay * w``), >= 0.

    Raises:
        ValueError: an argument outside its range (:func:`check_arguments`).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        check_arguments(lr, eps, initial_accumulator_value, weight_decay)
        defaults = {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value}
        super().__init__(params, {**defaults, "weight_decay": weight_decay})
        for group in self.param_groups:
            for param in group["params"]:
                rows = param.shape[:1]  # () for a 0-d parameter: one row
                self.state[param]["sum"] = torch.full(
                    rows, float(group["initial_accumulator_value"]), dtype=param.dtype, device=param.device
                )

    @staticmethod
    def fresh_row_state(kwargs: dict[str, Any]) -> dict[str, float]:
        """What a new row's state starts at, per state key, for ``RowWiseAdagrad(**kwargs)``."""
        return {"sum": float(kwargs.get("initial_accumulator_value", 0.0))}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update of every parameter with a gradient (``closure`` is not supported)."""
        if closure is not None:
            raise ValueError("RowWiseAdagrad.step takes no closure")
        for group in self.param_groups:
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                total = self.state[param]["sum"]
                if grad.is_sparse:
                    grad = grad.coalesce()  # repeats summed: one update per row
                    rows, values = grad.indices()[0], grad.values()
                    sums = total.index_select(0, rows)
                    weight = param.index_select(0, rows)
                    _update(weight, sums, values, lr, eps, decay)
                    total.index_copy_(0, rows, sums)
                    param.index_copy_(0, rows, weight)
                else:
                    rows = total.shape + (-1,)
                    _update(param.view(rows), total, grad.reshape(rows), lr, eps, decay)


def _update(weight: torch.Tensor, sums: torch.Tensor, grad: torch.Tensor, lr: float, eps: float, decay: float) -> None:
    """The row-wise Adagrad update, in place, of rows ``weight`` and their accumulators ``sums``
    (one per row: ``weight`` and ``grad`` are shaped ``(rows, ...)``, ``sums`` ``(rows,)``)."""
    if decay:
        grad = grad + decay * weight
    squares = (grad * grad).reshape(sums.shape + (-1,))
    sums.add_(squares.mean(dim=-1))
    multiplier = lr / (sums.sqrt() + eps)
    weight.sub_(grad * multiplier.reshape(sums.shape + (1,) * (grad.dim() - sums.dim())))

"""Row-wise Adagrad: Adagrad with one accumulator per embedding row, as FBGEMM defines it.

:class:`RowWiseAdagrad` is fbgemm_gpu's ``EXACT_ROWWISE_ADAGRAD`` (the
table optimizer of TorchRec's and FBGEMM's embedding kernels, without weight
decay): where Adagrad keeps a sum of squared gradients per value, it keeps
one per row, the running sum of the *mean* of the row's squared gradients,
so its state costs one float per row instead of a row's worth. For a row
``w`` of ``D`` values and its gradient ``g``, in this order::

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


def check_arguments(lr: float, eps: float, initial_accumulator_value: float) -> None:
    """Refuse arguments row-wise Adagrad is not defined for, naming what is expected.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or accumulator start.
    """
    for name, value in (("lr", lr), ("eps", eps), ("initial_accumulator_value", initial_accumulator_value)):
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

    Raises:
        ValueError: an argument outside its range (:func:`check_arguments`).
    """

    def __init__(
        self, params: Any, lr: float = 1e-2, eps: float = 1e-10, initial_accumulator_value: float = 0.0
    ) -> None:
        check_arguments(lr, eps, initial_accumulator_value)
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value})
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
            lr, eps = group["lr"], group["eps"]
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
                    _update(weight, sums, values, lr, eps)
                    total.index_copy_(0, rows, sums)
                    param.index_copy_(0, rows, weight)
                else:
                    _update(param.view(total.shape + (-1,)), total, grad.reshape(total.shape + (-1,)), lr, eps)


def _update(weight: torch.Tensor, sums: torch.Tensor, grad: torch.Tensor, lr: float, eps: float) -> None:
    """The row-wise Adagrad update, in place, of rows ``weight`` and their accumulators ``sums``
    (one per row: ``weight`` and ``grad`` are shaped ``(rows, ...)``, ``sums`` ``(rows,)``)."""
    squares = (grad * grad).reshape(sums.shape + (-1,))
    sums.add_(squares.mean(dim=-1))
    multiplier = lr / (sums.sqrt() + eps)
    weight.sub_(grad * multiplier.reshape(sums.shape + (1,) * (grad.dim() - sums.dim())))

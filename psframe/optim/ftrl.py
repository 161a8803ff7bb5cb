"""FTRL-Proximal, the optimizer of click-through-rate models, as TensorFlow defines it.

:class:`Ftrl` is the "Follow The (Proximally) Regularized Leader" of McMahan
et al., *Ad Click Prediction: a View from the Trenches* (KDD 2013), in the
form of TensorFlow's ``ApplyFtrl``/``ApplyFtrlV2`` kernels (``tf.compat.v1.train.FtrlOptimizer``,
``tf.keras.optimizers.Ftrl``), so a model trained with TF's FTRL trains the
same here. Each value keeps two accumulators: ``accum`` (the paper's *n*, the
sum of squared gradients) and ``linear`` (the paper's *z*). For a gradient
``g`` of a value ``w``, with ``p = -lr_power``::

    g_s        = g + 2 * l2_shrinkage * w                  (TF's FtrlV2; g when l2_shrinkage is 0)
    accum_new  = accum + g * g
    linear    += g_s - (accum_new^p - accum^p) / lr * w
    quadratic  = (accum_new^p + beta) / lr + 2 * l2
    w          = (sign(linear) * l1 - linear) / quadratic  if |linear| > l1  else 0
    accum      = accum_new

``beta`` is keras' (TF's kernels take it folded into ``l2`` as
``l2 + beta / (2 * lr)``). A large ``l1`` sets values to exactly zero: the
sparse models FTRL is chosen for. As in TF, the weights a step starts from
enter only through ``linear``: the first step of a value sets it from ``linear``.

An embedding table's gradient is sparse in its rows (``torch.sparse_coo``):
the rows it names, their repeats summed (as TF sums an ``IndexedSlices``'
duplicates before ``SparseApplyFtrl``), are updated and no other row or its
state changes (``l2_shrinkage`` then acts on the rows a step touches only,
as in TF). A dense gradient updates every value.
"""

from __future__ import annotations

from typing import Any

import torch


def check_arguments(
    lr: float, lr_power: float, initial_accumulator_value: float, l1: float, l2: float, l2_shrinkage: float, beta: float
) -> None:
    """Refuse arguments FTRL is not defined for, naming what is expected.

    Raises:
        ValueError: ``lr`` not > 0, ``lr_power`` > 0, or a negative accumulator start or strength.
    """
    if not lr > 0.0:
        raise ValueError(f"invalid learning rate lr={lr}: expected > 0 (FTRL divides by it)")
    if not lr_power <= 0.0:
        raise ValueError(f"invalid lr_power={lr_power}: expected <= 0 (0: a fixed rate; -0.5: 1/sqrt(accum))")
    for name, value in (
        ("initial_accumulator_value", initial_accumulator_value),
        ("l1", l1),
        ("l2", l2),
        ("l2_shrinkage", l2_shrinkage),
        ("beta", beta),
    ):
        if not value >= 0.0:
            raise ValueError(f"invalid {name}={value}: expected >= 0")


class Ftrl(torch.optim.Optimizer):
    """FTRL-Proximal with L1 and L2 regularization, as TensorFlow's ``FtrlOptimizer`` (see the module).

    Its state, per parameter, is ``accum`` (starting at ``initial_accumulator_value``)
    and ``linear`` (starting at 0), each shaped like the parameter: two floats
    per value. It is made when the optimizer is built.

    Args:
        params: the parameters (dense tensors; their gradients dense or sparse in their rows).
        lr: the learning rate (TF's ``learning_rate``), > 0.
        lr_power: how the rate falls as ``accum`` grows (TF's ``learning_rate_power``), <= 0.
        initial_accumulator_value: where ``accum`` starts, >= 0.
        l1: L1 regularization strength (TF's ``l1_regularization_strength``), >= 0.
        l2: L2 regularization strength (TF's ``l2_regularization_strength``), >= 0.
        l2_shrinkage: L2 shrinkage strength, a magnitude penalty added to the gradient
            (TF's ``l2_shrinkage_regularization_strength``), >= 0.
        beta: keras' ``beta``, added to ``accum^(-lr_power)`` in the quadratic term, >= 0.

    Raises:
        ValueError: an argument outside its range (:func:`check_arguments`).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        lr_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1: float = 0.0,
        l2: float = 0.0,
        l2_shrinkage: float = 0.0,
        beta: float = 0.0,
    ) -> None:
        check_arguments(lr, lr_power, initial_accumulator_value, l1, l2, l2_shrinkage, beta)
        defaults = {
            "lr": lr,
            "lr_power": lr_power,
            "initial_accumulator_value": initial_accumulator_value,
            "l1": l1,
            "l2": l2,
            "l2_shrinkage": l2_shrinkage,
            "beta": beta,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                state["accum"] = torch.full_like(param, group["initial_accumulator_value"]).detach()
                state["linear"] = torch.zeros_like(param).detach()

    @staticmethod
    def fresh_row_state(kwargs: dict[str, Any]) -> dict[str, float]:
        """What a new row's state starts at, per state key, for ``Ftrl(**kwargs)``."""
        return {"accum": float(kwargs.get("initial_accumulator_value", 0.1)), "linear": 0.0}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update of every parameter with a gradient (``closure`` is not supported).

        Raises:
            ValueError: a closure, or a learning rate a schedule brought to 0 or below.
        """
        if closure is not None:
            raise ValueError("Ftrl.step takes no closure")
        for group in self.param_groups:
            if not group["lr"] > 0.0:
                raise ValueError(f"Ftrl's learning rate is {group['lr']}: FTRL divides by it, so it must stay > 0")
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                state = self.state[param]
                if grad.is_sparse:
                    grad = grad.coalesce()  # repeats summed: the update is not linear in the gradient
                    rows = grad.indices()[0]
                    weight, accum, linear = param.index_select(0, rows), *_rows(state, rows)
                    _update(weight, accum, linear, grad.values(), group)
                    param.index_copy_(0, rows, weight)
                    state["accum"].index_copy_(0, rows, accum)
                    state["linear"].index_copy_(0, rows, linear)
                else:
                    _update(param, state["accum"], state["linear"], grad, group)


def _rows(state: dict[str, Any], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return state["accum"].index_select(0, rows), state["linear"].index_select(0, rows)


def _update(
    weight: torch.Tensor, accum: torch.Tensor, linear: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
) -> None:
    """The FTRL update of ``weight``, ``accum`` and ``linear`` (same shapes as ``grad``), in place."""
    lr, power = group["lr"], -group["lr_power"]
    new_accum = accum + grad * grad
    if power == 0.5:  # the common case: a square root, as TF's kernel takes it
        new_power, old_power = new_accum.sqrt(), accum.sqrt()
    else:
        new_power, old_power = new_accum.pow(power), accum.pow(power)
    shrunk = grad.add(weight, alpha=2 * group["l2_shrinkage"]) if group["l2_shrinkage"] else grad
    linear.add_(shrunk - (new_power - old_power) / lr * weight)
    quadratic = (new_power + group["beta"]) / lr + 2 * group["l2"]
    l1 = group["l1"]
    weight.copy_(torch.where(linear.abs() > l1, (l1 * linear.sign() - linear) / quadratic, 0.0))
    accum.copy_(new_accum)

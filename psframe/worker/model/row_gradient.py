"""An embedding table's gradient as the user's own code sees it: the rows a step looked up.

A table's weight never takes part in backward: each lookup reads a small
tensor of the rows of its distinct ids (:mod:`psframe.worker.model.table_views`),
and backward leaves the gradient there. So that the user's unchanged::

    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)   # or clip_grad_value_
    trainer.step()

treats the table as one process treats the same model with a dense
embedding, the table's ``weight.grad`` is a :class:`RowGradient` once
backward reaches a row: a tensor of the weight's shape that holds only the
rows the step looked up (each id once, its repeats summed) and stands for
zero everywhere else. What clipping does to a gradient works on it, in
place, on those rows: its norm (``torch.linalg.vector_norm``, ``norm``,
``torch._foreach_norm``), scaling (``mul_``, ``div_``), ``clamp_`` that
keeps zero at zero, ``zero_``; the rows pushed are the rows as clipped.
Anything else on it (adding to it, reading elements, a norm over one
dimension) raises :class:`~psframe.errors.InvalidGradientError` naming the
table, rather than acting on a part of the gradient in silence. Setting the
weight's ``grad`` to None (``model.zero_grad()``, ``NanGuardHook``) drops the
rows' gradients, as it drops a dense parameter's.

``copy.deepcopy`` of the gradient, or ``to_sparse()``, is the sparse COO
gradient an ``nn.Embedding(sparse=True)`` would have in one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from psframe.errors import InvalidGradientError

aten = torch.ops.aten

# What the user's code may do to a table's gradient (what torch.nn.utils' clipping does), by kind.
_NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dtype, aten.norm.ScalarOpt_dim}
_SCALES = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar}
_CLAMPS = {aten.clamp_.default, aten.clamp_.Tensor, aten.clamp_min_.default, aten.clamp_max_.default}
_FOREACH_SCALES = {
    aten._foreach_mul_.Scalar: aten.mul_.Scalar,
    aten._foreach_mul_.Tensor: aten.mul_.Tensor,
    aten._foreach_mul_.List: aten.mul_.Tensor,
    aten._foreach_mul_.ScalarList: aten.mul_.Scalar,
    aten._foreach_div_.Scalar: aten.div_.Scalar,
    aten._foreach_div_.Tensor: aten.div_.Tensor,
    aten._foreach_div_.List: aten.div_.Tensor,
    aten._foreach_div_.ScalarList: aten.div_.Scalar,
    aten._foreach_clamp_min_.Scalar: aten.clamp_min_.default,
    aten._foreach_clamp_max_.Scalar: aten.clamp_max_.default,
}
_ALLOWED = "clip_grad_norm_, clip_grad_value_, norm(), mul_, div_, clamp_ that keeps 0, zero_, to_sparse()"


class RowGradient(torch.Tensor):
    """The gradient of embedding table ``name``'s weight ``like``: the rows backward reached.

    Made by the first backward that reaches one of the table's lookups
    (:meth:`reached`), and taken by the trainer's step (:meth:`take_rows`).
    """

    # Every op goes to __torch_dispatch__.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor) -> RowGradient:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    def __init__(self, name: str, like: torch.Tensor) -> None:
        self.table = name
        self._row_shape = tuple(like.shape[1:])
        # Each reached lookup's distinct ids and their rows' gradient, as backward left it.
        self._pending_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._row_ids = torch.zeros(0, dtype=torch.int64)  # the rows summed so far, sorted, on the host
        self._row_grads = torch.zeros((0, *self._row_shape), dtype=like.dtype)

    @classmethod
    def reached(cls, name: str, weight: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Backward reached ``rows`` (a lookup's leaf, of the distinct ``ids``) of table ``name``,
        whose weight is ``weight``: add their gradient to ``weight.grad`` (made if None)."""
        grad = weight.grad
        if not isinstance(grad, RowGradient):
            if grad is not None:
                raise InvalidGradientError(
                    f"embedding table {name!r} got a gradient of its whole weight: it was used outside its "
                    f"module's forward, or its grad was set"
                )
            grad = weight.grad = cls(name, weight)
        if rows.grad is not None:
            grad._pending_rows.append((ids, rows.grad))
        rows.grad = None  # this backward's share is the table's now: a second backward adds anew

    def summed_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids (sorted, on the host) and their rows' gradients, summed over every reached lookup."""
        if self._pending_rows:
            ids = [ids for ids, _ in self._pending_rows]
            grads = [grad.to("cpu") for _, grad in self._pending_rows]
            if self._row_ids.numel():  # summed before (a norm was taken), then backward ran again
                ids, grads = [self._row_ids, *ids], [_rows_as_sparse(self._row_grads), *grads]
            self._row_ids, self._row_grads = sum_rows(ids, grads)
            self._pending_rows = []
        return self._row_ids, self._row_grads

    def take_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`summed_rows`, or None if there are none (the step pushes nothing of this table)."""
        ids, values = self.summed_rows()
        return (ids, values) if ids.numel() else None

    def to_sparse_coo(self) -> torch.Tensor:
        """This gradient as ``nn.Embedding(sparse=True)`` has it in one process (coalesced)."""
        ids, values = self.summed_rows()
        return torch.sparse_coo_tensor(
            ids.unsqueeze(0), values.clone(), self.shape, is_coalesced=True, check_invariants=False
        ).to(self.device)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.to_sparse_coo()

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        ids, _ = self.summed_rows()
        return f"RowGradient(table={self.table!r}, rows={ids.numel()} of {self.shape[0]}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            return _norm(func, args[0], *args[1:], **kwargs)
        if func is aten._foreach_norm.Scalar:
            tensors, rest = args[0], args[1:]
            return [_norm(aten.linalg_vector_norm.default, t, *rest, **kwargs) for t in tensors]
        if (func in _SCALES or func in _CLAMPS) and isinstance(args[0], RowGradient):
            return _in_place(func, args[0], *args[1:], **kwargs)
        if func in _FOREACH_SCALES:
            one, (tensors, other) = _FOREACH_SCALES[func], (args[0], args[1])
            others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
            for tensor, each in zip(tensors, others):
                _in_place(one, tensor, each)
            return None
        if func is aten.zero_.default:
            grad = _mine(args[0], func)
            grad.summed_rows()
            grad._row_ids, grad._row_grads = grad._row_ids[:0], grad._row_grads[:0]
            return grad
        if func in (aten.detach.default, aten.alias.default, aten.detach_.default):
            return args[0]
        if func in (aten._to_sparse.default, aten._to_sparse.sparse_dim):
            return _mine(args[0], func).to_sparse_coo()
        raise _refused(func, args, kwargs)


def _refused(func, args: Sequence, kwargs: dict) -> InvalidGradientError:
    mine = next((a for a in _flat(args, kwargs) if isinstance(a, RowGradient)), None)
    table = mine.table if mine is not None else "?"
    return InvalidGradientError(
        f"the gradient of embedding table {table!r} holds only the rows this step looked up (zero "
        f"elsewhere), and {func} cannot act on it: {_ALLOWED} can. Train the table as a whole variable "
        f"(sparse=False) to use its gradient otherwise"
    )


def sum_rows(ids: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of rows by id (each ``grads[k]`` a sparse gradient over the rows of the distinct
    ``ids[k]``), as each id once (sorted) and its gradients summed, on the host: as backward sums
    an ``nn.Embedding(sparse=True)``'s, bit for bit."""
    if len(ids) == 1:
        grad = grads[0].coalesce()
        return ids[0][grad.indices()[0]], grad.values()
    distinct, position = torch.unique(torch.cat(list(ids)), return_inverse=True)
    start, indices, values = 0, [], []
    for some, grad in zip(ids, grads):
        grad = grad.coalesce() if grad.is_sparse else _rows_as_sparse(grad)
        indices.append(position[start + grad.indices()[0]])
        values.append(grad.values())
        start += some.numel()
    total = torch.sparse_coo_tensor(
        torch.cat(indices).unsqueeze(0),
        torch.cat(values),
        (distinct.numel(), *values[0].shape[1:]),
        check_invariants=False,
    ).coalesce()
    return distinct[total.indices()[0]], total.values()


def _rows_as_sparse(rows: torch.Tensor) -> torch.Tensor:
    """Dense rows ``(n, ...)`` as a sparse gradient over rows ``0..n-1`` (one sparse dimension)."""
    count = rows.shape[0]
    return torch.sparse_coo_tensor(
        torch.arange(count).unsqueeze(0), rows, rows.shape, is_coalesced=True, check_invariants=False
    )


def _mine(tensor: object, func) -> RowGradient:
    if not isinstance(tensor, RowGradient):
        raise InvalidGradientError(f"{func} with an embedding table's gradient as an argument: only {_ALLOWED}")
    return tensor


def _norm(func, tensor: torch.Tensor, ord: float | str | None = 2.0, dim=None, keepdim=False, *, dtype=None):
    """The norm of the whole gradient (zero outside its rows), on the host."""
    if not isinstance(tensor, RowGradient):  # the other tensors of a foreach norm
        return torch.linalg.vector_norm(tensor, ord, dim, keepdim, dtype=dtype)
    order = 2.0 if ord is None or ord == "fro" else float(ord)
    if dim not in (None, [], ()) or order < 0 or math.isnan(order):
        raise InvalidGradientError(
            f"the gradient of embedding table {tensor.table!r} holds only the rows this step looked up: "
            f"{func} with ord={ord}, dim={dim} cannot be taken over them (a norm of order >= 0 over "
            f"the whole gradient can)"
        )
    _, values = tensor.summed_rows()
    return torch.linalg.vector_norm(values, order, dtype=dtype)


def _in_place(func, tensor: torch.Tensor, *args, **kwargs):
    """Scale or clamp the rows in place (a clamp must keep zero at zero: the rest of the gradient)."""
    if not isinstance(tensor, RowGradient):  # the other tensors of a foreach op
        if any(isinstance(a, RowGradient) for a in _flat(args, kwargs)):
            raise _refused(func, args, kwargs)
        return func(tensor, *args, **kwargs)
    _, values = tensor.summed_rows()
    if func in _CLAMPS:
        low, high = _bounds(func, args, kwargs)
        if (low is not None and low > 0) or (high is not None and high < 0):
            raise InvalidGradientError(
                f"clamping the gradient of embedding table {tensor.table!r} to [{low}, {high}] would "
                f"change its rows not looked up (zero) too; a range that holds 0 keeps them"
            )
    else:
        args = tuple(_on(values.device, a) for a in args)
        if isinstance(args[0], torch.Tensor) and args[0].numel() != 1:
            raise InvalidGradientError(
                f"the gradient of embedding table {tensor.table!r} can be scaled by one number, "
                f"not by a tensor of shape {tuple(args[0].shape)}"
            )
    func(values, *args, **kwargs)
    return tensor


def _bounds(func, args: tuple, kwargs: dict) -> tuple[float | None, float | None]:
    """A clamp's ``(min, max)`` (None: no bound)."""
    if func is aten.clamp_min_.default:
        low, high = args[0] if args else kwargs.get("min"), None
    elif func is aten.clamp_max_.default:
        low, high = None, args[0] if args else kwargs.get("max")
    else:
        low = args[0] if len(args) > 0 else kwargs.get("min")
        high = args[1] if len(args) > 1 else kwargs.get("max")
    return (float(low) if low is not None else None), (float(high) if high is not None else None)


def _on(device: torch.device, value: object) -> object:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _flat(args: Sequence, kwargs: dict) -> list:
    flat: list = []
    for value in [*args, *kwargs.values()]:
        flat.extend(value if isinstance(value, (list, tuple)) else [value])
    return flat

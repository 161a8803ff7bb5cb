"""Whether a request fits a store's model: gradients against their variables, rows against their tables.

The store (:class:`~psframe.ps.store.VariableStore`) checks every part of a
request before any part changes, so that a bad push leaves it as it was.
:class:`RequestChecks` checks a request against the model the store holds
(that it holds one, the names, the gradients, the rows) and counts a push it
refuses; the rules are the functions beside it: for dense gradients
(:func:`check_gradients`, after :func:`widened` converted those that
travelled compressed) and for the tables a row push or pull names
(:func:`check_table`; the rows themselves are checked by
:class:`~psframe.ps.store.table_parts.TableParts`). Each raises the error
that names what does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from psframe.errors import (
    DtypeMismatchError,
    InvalidGradientError,
    NotReadyError,
    PsframeError,
    ShapeMismatchError,
    UnknownVariableError,
)
from psframe.ps.store.counters import StoreCounts
from psframe.ps.store.store_model import StoreModel
from psframe.tables.rows import RowPush


class RequestChecks:
    """Checks of requests against ``model``, the model a store holds (None: none yet); a push
    refused is counted in ``counts``. Not thread-safe: the store calls it under its lock.

    Args:
        task_name: the task name used in error messages, e.g. ``/job:ps/task:0``.
        model: the model held; None before the chief created the variables.
        counts: the store's counts.
    """

    def __init__(self, task_name: str, model: StoreModel | None, counts: StoreCounts) -> None:
        self._task_name = task_name
        self._model = model
        self._counts = counts

    def ready(self) -> StoreModel:
        """The model held.

        Raises:
            NotReadyError: the store holds none yet.
        """
        if self._model is None:
            raise NotReadyError(f"{self._task_name} holds no variables yet: the chief has not created them")
        return self._model

    def names(self, names: Sequence[str]) -> None:
        """Raise unless every name is a variable of the model."""
        model = self.ready()
        for name in names:
            model.variable(name)

    def fits(self, values: Mapping[str, torch.Tensor]) -> None:
        """Raise unless each of ``values`` (gradients, or values restored) fits its dense variable
        (:func:`check_gradients`); counts nothing."""
        check_gradients(self.ready(), values)

    def gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Raise if any gradient does not fit its variable, counting a refused push."""
        try:
            self.fits(grads)
        except PsframeError:
            self._counts.rejected_pushes += 1
            raise

    def rows(self, rows: Sequence[RowPush]) -> None:
        """Raise unless every ``(table, ids, gradient rows)`` fits its table, counting a refused push."""
        try:
            model = self.ready()
            for name, ids, values in rows:
                check_table(model, name)
                model.table_parts.check_push(name, ids, values)
        except PsframeError:
            self._counts.rejected_pushes += 1
            raise

    def row_ids(self, name: str, ids: torch.Tensor) -> None:
        """Raise unless ``name`` is a table of the model and ``ids`` are rows of it."""
        model = self.ready()
        check_table(model, name)
        model.table_parts.check_ids(name, ids)


def check_gradients(model: StoreModel, grads: Mapping[str, torch.Tensor]) -> None:
    """Raise if any gradient is not one of a dense variable of ``model``, of its shape and dtype.

    Raises:
        UnknownVariableError, InvalidGradientError (a gradient for a table),
        DtypeMismatchError, ShapeMismatchError.
    """
    for name, grad in grads.items():
        variable = model.dense.get(name)
        if variable is None:
            model.variable(name)  # names what this store holds
            raise InvalidGradientError(
                f"{name!r} on {model.task_name} is an embedding table: it takes the rows a batch touched "
                f"(ids and rows), not a whole gradient; nothing was applied"
            )
        if grad.dtype != variable.dtype:
            raise DtypeMismatchError(
                f"gradient for {name!r} has dtype {grad.dtype} but the variable on "
                f"{model.task_name} has dtype {variable.dtype}; nothing was applied"
            )
        if grad.shape != variable.shape:
            raise ShapeMismatchError(
                f"gradient for {name!r} has shape {tuple(grad.shape)} but the variable on "
                f"{model.task_name} has shape {tuple(variable.shape)}; nothing was applied"
            )


def check_table(model: StoreModel, name: str) -> None:
    """Raise unless ``name`` is an embedding table (a fixed table or a dynamic table's part) of ``model``.

    Raises:
        UnknownVariableError: naming what the store holds.
    """
    if name not in model.table_parts:
        model.variable(name)  # names what this store holds
        raise UnknownVariableError(
            f"{name!r} on {model.task_name} is not an embedding table; its rows cannot be pulled or pushed one by one"
        )


def widened(model: StoreModel, grads: Mapping[str, torch.Tensor], wire_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gradients that travelled compressed, converted back to their variable's dtype.

    A gradient in ``wire_dtype`` for a wider floating-point variable is
    converted (a new tensor); any other gradient is returned as given, so
    that :func:`check_gradients` refuses what does not fit, naming it.
    """
    widened = {}
    for name, grad in grads.items():
        variable = model.get(name)
        if (
            variable is not None
            and grad.dtype == wire_dtype
            and variable.is_floating_point()
            and variable.element_size() > grad.element_size()
        ):
            grad = grad.to(variable.dtype)
        widened[name] = grad
    return widened

"""The served model: one instance per version, loaded from its snapshot, and a request's predictions.

``psframe serve --model FILE.py:NAME`` (or ``MODULE:NAME``) names a factory that returns either

- the model, a ``torch.nn.Module`` built as the trainer built it; a request's ``inputs`` are
  then a JSON list (the forward's positional arguments) or object (its keyword arguments),
  each value made a tensor with ``torch.tensor`` (integers int64, numbers float32); or
- ``(model, to_inputs)``, where ``to_inputs(inputs)`` takes the request's ``inputs`` as JSON
  gives it (lists, dicts, numbers, strings) and returns the forward's arguments: a tuple
  (positional), a dict (keyword) or one tensor. A ``ValueError``, ``TypeError`` or ``KeyError``
  it raises answers the request 400 with its message.

The factory's model is a template, never served itself: each version gets a deep copy of it,
loaded with the version's parameters and dynamic tables' rows by
:func:`psframe.worker.model_state.load_model_state` (a dynamic table then answers an id it does
not hold with its initial row, as an evaluation does), in ``eval()`` mode and without gradients.
So a version's model is built whole before the version is switched to, and the weights a
forward reads never change under it. The forward's outputs (a tensor, or lists, tuples and
dicts of them, or numbers) go back as JSON lists.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from psframe.export import Snapshot
from psframe.worker.model_state import load_model_state

ToInputs = Callable[[Any], Any]


class InputError(ValueError):
    """A request's inputs that the model cannot take: answered 400 with this message."""


class ModelFactory:
    """Makes the model of each served version from the factory's template.

    Args:
        template: the model as the factory built it (never served, never changed).
        to_inputs: turns a request's ``inputs`` into the forward's arguments (None: the default rule
            of the module's docstring).

    Raises:
        ValueError: ``template`` is not a ``torch.nn.Module`` or ``to_inputs`` is not callable.
    """

    def __init__(self, template: torch.nn.Module, to_inputs: ToInputs | None = None) -> None:
        if not isinstance(template, torch.nn.Module):
            raise ValueError(f"the model must be a torch.nn.Module, got {type(template).__name__}")
        if to_inputs is not None and not callable(to_inputs):
            raise ValueError(f"to_inputs must be a function of the request's inputs, got {type(to_inputs).__name__}")
        self.template = template
        self.to_inputs = to_inputs

    @classmethod
    def of(cls, made: Any, spec: str = "the factory") -> ModelFactory:
        """From what a ``--model`` factory returned: a module, or ``(module, to_inputs)``.

        Raises:
            ValueError: it is neither, naming ``spec``.
        """
        if isinstance(made, torch.nn.Module):
            return cls(made)
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module) and callable(made[1]):
            return cls(made[0], made[1])
        raise ValueError(
            f"{spec} must return a torch.nn.Module, or (model, to_inputs) where to_inputs turns a request's "
            f"inputs into the forward's arguments; got {type(made).__name__}"
        )

    def model_of(self, snapshot: Snapshot) -> torch.nn.Module:
        """A new instance of the model holding ``snapshot``'s parameters and rows, in ``eval()`` mode.

        Raises:
            ClusterMismatchError: the snapshot does not fit the model (the message names what differs).
        """
        model = copy.deepcopy(self.template)
        load_model_state(model, state_of(snapshot))
        model.eval()
        model.requires_grad_(False)
        return model

    def predict(self, model: torch.nn.Module, inputs: Any) -> Any:
        """The model's outputs on a request's ``inputs``, as JSON values.

        Raises:
            InputError: the inputs cannot be made the forward's arguments, or the forward refused them.
        """
        try:
            arguments = self.to_inputs(inputs) if self.to_inputs is not None else default_inputs(inputs)
        except InputError:
            raise
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise InputError(f"the model's to_inputs refused the inputs: {e}") from e
        args: tuple[Any, ...]
        kwargs: dict[str, Any]
        if isinstance(arguments, torch.Tensor):
            args, kwargs = (arguments,), {}
        elif isinstance(arguments, Mapping):
            args, kwargs = (), dict(arguments)
        elif isinstance(arguments, (tuple, list)):
            args, kwargs = tuple(arguments), {}
        else:
            raise InputError(
                f"the inputs must become a tensor, a tuple (positional) or a dict (keyword arguments) of the "
                f"forward; got {type(arguments).__name__}"
            )
        try:
            with torch.inference_mode():
                outputs = model(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError, IndexError, KeyError) as e:
            raise InputError(f"the model's forward refused the inputs: {e}") from e
        return to_json(outputs)


def state_of(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """A snapshot as :func:`psframe.checkpoint.load` gives a checkpoint: the parameters by name, and a
    dynamic table ``name`` as ``name.ids`` and ``name.rows`` (what :func:`load_model_state` takes)."""
    state = dict(snapshot.dense)
    for name, table in snapshot.tables.items():
        state[f"{name}.ids"] = table.ids
        state[f"{name}.rows"] = table.values()
    return state


def default_inputs(inputs: Any) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """A request's ``inputs`` as the forward's arguments, with no ``to_inputs``: a list is the
    positional arguments, an object the keyword arguments, each made a tensor.

    Raises:
        InputError: ``inputs`` is neither, or a value is no rectangular list of numbers.
    """
    if isinstance(inputs, list):
        return tuple(_tensor(value, f"inputs[{i}]") for i, value in enumerate(inputs))
    if isinstance(inputs, dict):
        return {str(name): _tensor(value, f"inputs[{name!r}]") for name, value in inputs.items()}
    raise InputError(
        f"inputs must be a list (the forward's positional arguments) or an object (its keyword arguments), "
        f"each a number or a rectangular list of numbers; got {type(inputs).__name__}"
    )


def _tensor(value: Any, where: str) -> torch.Tensor:
    try:
        return torch.tensor(value)
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(f"{where} must be a number or a rectangular list of numbers: {e}") from e


def to_json(outputs: Any) -> Any:
    """A forward's outputs as JSON values: tensors as (nested) lists, tuples as lists, dicts by key.

    Raises:
        TypeError: an output is of no such kind (the model's doing: answered 500).
    """
    if isinstance(outputs, torch.Tensor):
        return outputs.detach().to("cpu").tolist()
    if isinstance(outputs, (list, tuple)):
        return [to_json(value) for value in outputs]
    if isinstance(outputs, Mapping):
        return {str(key): to_json(value) for key, value in outputs.items()}
    if outputs is None or isinstance(outputs, (bool, int, float, str)):
        return outputs
    raise TypeError(f"the model's forward returned a {type(outputs).__name__}, which has no JSON form")


__all__ = ["InputError", "ModelFactory", "default_inputs", "state_of", "to_json"]

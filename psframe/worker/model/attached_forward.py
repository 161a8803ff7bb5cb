"""A table module's forward while its table is attached to the ps tasks, and its own given back.

Attaching an embedding table (:meth:`psframe.worker.model.tables.EmbeddingTables.attach`)
gives the user's ``nn.Embedding``/``nn.EmbeddingBag`` a ``forward`` of the
instance's own (:func:`replace_forward`), which looks each batch up in rows
pulled from the ps tasks; the class is untouched. For as long as it is
attached, the module pickles (``torch.save``, ``copy.deepcopy``) as the user's
own, without that forward: the lookup holds the trainer's client.
:func:`restore_forward` gives the module its own forward back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# What replace_forward() gives a module of its own, for as long as it is attached.
_ATTACHED = ("forward", "__getstate__")


def replace_forward(module: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Have ``module`` call ``forward`` instead of its class's forward, until :func:`restore_forward`."""
    module.forward = forward
    module.__getstate__ = functools.partial(_own_state, module)  # type: ignore[method-assign]


def restore_forward(module: torch.nn.Module) -> None:
    """Give ``module`` its class's forward back (nothing happens to one never given another)."""
    for name in _ATTACHED:
        module.__dict__.pop(name, None)


def _own_state(module: torch.nn.Module) -> dict[str, object]:
    """The state pickling takes of an attached table module (pickle reads ``__getstate__`` off
    the instance): its own, without the lookup through the ps tasks, which holds the trainer's
    client; a model saved or copied while the trainer is connected is the user's model."""
    return {name: value for name, value in module.__dict__.items() if name not in _ATTACHED}

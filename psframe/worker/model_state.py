"""A checkpoint's parameters put into a model of this process, dynamic tables included.

:func:`psframe.checkpoint.load` gives a ``state_dict`` of the trainable
parameters, and a dynamic table ``name`` as ``name.ids`` (sorted) and
``name.rows``. :func:`load_model_state` puts both into a model: the
parameters by name, and each :class:`~psframe.worker.model.dynamic.DynamicEmbedding`
a row source over the rows the checkpoint held (:class:`CheckpointRows`),
so that the model evaluates as it would against the ps tasks that saved them,
with no cluster running.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from psframe.errors import ClusterMismatchError
from psframe.tables.row_math import initial_rows
from psframe.worker.model.dynamic import DynamicEmbedding, find_dynamic_tables


class CheckpointRows:
    """The rows of one dynamic table as a checkpoint held them, looked up by id.

    An id the checkpoint held gets its row; any other id gets its initial
    row (the table's :class:`~psframe.RowInitializer`) and nothing is kept:
    what an evaluation's lookup gets from the ps tasks.

    Args:
        module: the table the rows are for (its row width, dtype and initializer).
        ids: the ids held, sorted (``name.ids`` of :func:`psframe.checkpoint.load`).
        rows: their rows (``name.rows``).
    """

    def __init__(self, module: DynamicEmbedding, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.initializer = module.spec.initializer
        self.row_shape = tuple(module.row_template.shape[1:])
        self.dtype = module.row_template.dtype
        self.ids = ids.to("cpu", torch.int64)
        self.rows = rows.to("cpu", self.dtype)

    def __call__(self, ids: torch.Tensor, create: bool) -> torch.Tensor:
        # `create` is ignored: rows read from a checkpoint are never made, as in an evaluation.
        rows = torch.empty((ids.numel(), *self.row_shape), dtype=self.dtype)
        held = torch.zeros(ids.numel(), dtype=torch.bool)
        if self.ids.numel():
            at = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
            held = self.ids[at] == ids
            rows[held] = self.rows[at[held]]
        if not bool(held.all()):
            rows[~held] = initial_rows(self.initializer, ids[~held], self.row_shape, self.dtype)
        return rows


def load_model_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Put a checkpoint's parameters into ``model``.

    Parameters are copied by name (buffers, which no checkpoint holds, keep
    their values); each :class:`~psframe.DynamicEmbedding` ``name`` looks its
    rows up in ``name.ids``/``name.rows`` from now on (:class:`CheckpointRows`).
    Nothing is loaded unless the whole state fits the model.

    Args:
        model: a model of the same class as the one trained.
        state: what :func:`psframe.checkpoint.load` returned.

    Raises:
        ClusterMismatchError: the state and the model disagree: a trainable
            parameter or dynamic table missing from the state, a name the
            model lacks, or a shape that differs. The message names them.
    """
    tables = find_dynamic_tables(model)
    table_keys = {f"{name}.{part}" for name in tables for part in ("ids", "rows")}
    own = model.state_dict()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    problems = [f"{key} (a dynamic table's) is not in the checkpoint" for key in sorted(table_keys - set(state))]
    problems += [f"parameter {name} is not in the checkpoint" for name in trainable if name not in state]
    for name, module in tables.items():
        rows = state.get(f"{name}.rows")
        if rows is not None and tuple(rows.shape[1:]) != tuple(module.row_template.shape[1:]):
            problems.append(
                f"the rows of {name} are {tuple(rows.shape[1:])} wide in the checkpoint, "
                f"{tuple(module.row_template.shape[1:])} in the model"
            )
    for key, value in state.items():
        if key in table_keys:
            continue
        if key not in own:
            problems.append(f"the checkpoint holds {key}, which the model lacks")
        elif tuple(value.shape) != tuple(own[key].shape):
            problems.append(f"{key} is {tuple(value.shape)} in the checkpoint, {tuple(own[key].shape)} in the model")
    if problems:
        raise ClusterMismatchError(
            f"the checkpoint does not fit the model ({type(model).__name__}): {'; '.join(problems)}; "
            "build the model as the trainer did"
        )
    model.load_state_dict({k: v for k, v in state.items() if k not in table_keys}, strict=False)
    for name, module in tables.items():
        module.attach(CheckpointRows(module, state[f"{name}.ids"], state[f"{name}.rows"]))


__all__ = ["CheckpointRows", "load_model_state"]

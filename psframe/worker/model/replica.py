"""A worker's replica of the model, bound to the shards the ps tasks hold.

:class:`Replica` knows which part of which local parameter each stored
shard mirrors (:class:`~psframe.worker.plan.step_plan.Slot`), hands out the
gradients a request pushes (on the host, ready for the wire) and writes the
values a reply carries back into the parameters. It never talks to a ps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from psframe.cluster.placement import ShardPlacement, VariableInfo, place
from psframe.tables.spec import place_dynamic, place_tables
from psframe.wire import dtypes
from psframe.worker.client.operations import DenseReply
from psframe.worker.model.dynamic import find_dynamic_tables
from psframe.worker.model.staging import HostStaging
from psframe.worker.model.tables import EmbeddingTables, find_tables
from psframe.worker.plan.step_plan import Request, Slot, StepPlan


def place_model(
    model: torch.nn.Module,
    num_ps: int,
    *,
    variable_devices: Mapping[str, str],
    max_shard_bytes: int,
    table_partition: str = "mod",
    table_parts: int | None = None,
    **placement_options,
) -> ShardPlacement:
    """Where the trainable parameters and embedding tables of ``model`` go on ``num_ps`` ps tasks:
    dense variables by :func:`~psframe.cluster.placement.place` (``placement_options`` are its
    keyword arguments), tables one part per task or ``table_parts`` parts
    (:func:`~psframe.tables.spec.place_tables`).

    Raises:
        ValueError: the model has no trainable parameter, or ``variable_devices`` names a
            parameter it does not have.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    dynamic = find_dynamic_tables(model)
    if not params and not dynamic:
        raise ValueError("the model has no trainable parameter: nothing to place on the ps tasks")
    unknown = sorted(set(variable_devices) - {n for n, _ in params})
    if unknown:
        raise ValueError(
            f"variable_devices names {unknown}, which are not trainable parameters of the model; "
            f"expected names from model.named_parameters()"
        )
    tables = find_tables(model)
    infos = [VariableInfo(n, tuple(p.shape), p.element_size(), variable_devices.get(n)) for n, p in params]
    dense = place(
        [i for i in infos if i.name not in tables], num_ps, max_shard_bytes=max_shard_bytes, **placement_options
    )
    table_shards = place_tables(
        [i for i in infos if i.name in tables],
        num_ps,
        partition=table_partition,
        soft_placement=placement_options.get("soft_placement", False),
        num_parts=table_parts,
    )
    for name, module in dynamic.items():
        table_shards += place_dynamic(
            name, (module.embedding_dim,), module.row_template.element_size(), module.spec, num_ps, table_parts
        )
    return ShardPlacement(num_ps, dense.shards + tuple(table_shards))


class Replica:
    """The trainable parameters of ``model`` as variables placed on ``num_ps`` ps tasks.

    Args:
        model: the local model (already on its device).
        num_ps: the number of ps tasks.
        staging: how tensors travel between the model's device and the host.
        sync: True for synchronous training (see :meth:`gradients`).
        wire_dtype: the dtype gradients travel in, if compressed: a CUDA
            replica converts them on the GPU, so half the bytes cross to the host.
        placement_options: keyword arguments of :func:`psframe.cluster.placement.place`
            (``strategy``, ``min_partition_bytes``, ``soft_placement``, ``max_shard_bytes``).
        variable_devices: explicit TF device strings for some parameters.
        placement: where the shards are, when it is not the model's placement on ``num_ps``
            tasks (:func:`place_model`) but a stage of a re-layout (:mod:`psframe.cluster.moves`).

    Raises:
        ValueError: the model has no trainable parameter, or ``variable_devices``
            names a parameter it does not have.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_ps: int,
        staging: HostStaging,
        *,
        sync: bool,
        variable_devices: Mapping[str, str],
        max_shard_bytes: int,
        wire_dtype: torch.dtype | None = None,
        table_partition: str = "mod",
        placement: ShardPlacement | None = None,
        **placement_options,
    ) -> None:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dynamic = find_dynamic_tables(model)
        tables = find_tables(model)
        if placement is None:
            placement = place_model(
                model,
                num_ps,
                variable_devices=variable_devices,
                max_shard_bytes=max_shard_bytes,
                table_partition=table_partition,
                **placement_options,
            )
        num_ps = placement.num_ps
        self.placement: ShardPlacement = placement
        by_name = {**dict(params), **{name: module.row_template for name, module in dynamic.items()}}
        self.slots = tuple(Slot(shard, by_name[shard.variable]) for shard in self.placement.shards)
        self.dense_slots = tuple(s for s in self.slots if not s.shard.table)
        self.tables = EmbeddingTables(tables, [s for s in self.slots if s.shard.table], dynamic)
        self.has_tables = bool(self.tables)  # none: a step takes no path through them
        # Each ps task's requests in the order backward makes their gradients (the model's
        # last parameters first), so that a step can send them as they come (psframe.worker.model.overlap).
        position = {id(p): k for k, (_, p) in enumerate(params)}
        backward_order = sorted(self.dense_slots, key=lambda s: (-position[id(s.param)], s.shard.row_start))
        self.plan = StepPlan.make(backward_order, num_ps, max_shard_bytes, sync)
        self.max_shard_bytes = max_shard_bytes
        self.sync = sync
        self.staging = staging
        # On a CUDA replica, gradients and values pass through pinned host buffers; on a CPU one
        # they are the wire's tensors already, and a step calls nothing of the staging.
        self._cuda = staging.cuda
        self._device_wire_dtype = wire_dtype if staging.cuda else None
        # Whose gradients are cleared after every step (the trainable ones, once each).
        self._params = [p for _, p in params]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The model's trainable parameters, in the model's order."""
        return list(self._params)

    def values(self, slots: Sequence[Slot]) -> list[tuple[str, torch.Tensor]]:
        """The current values of ``slots`` on the host, by shard name (the chief's initial values)."""
        return [(s.name, self.staging.to_host(s.rows(s.param.detach()))) for s in slots]

    def table_rows(self, slot: Slot) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """The current values of a table part, as ``(part, ids, rows)`` runs of at most
        ``max_shard_bytes`` on the host (the chief's initial values of a table)."""
        part = slot.rows(slot.param.detach())
        count = part.shape[0]
        row_bytes = max(1, part[0].numel() * part.element_size()) if count else 1
        per_message = max(1, self.max_shard_bytes // row_bytes)
        for start in range(0, count, per_message):
            end = min(count, start + per_message)
            rows = self.staging.to_host(part[start:end]).contiguous()
            yield slot.name, torch.arange(start, end, dtype=torch.int64), rows

    def has_gradients(self) -> bool:
        """Whether backward left a gradient on any trainable parameter."""
        for param in self._params:
            if param.grad is not None:
                return True
        return self.tables.has_gradients()

    def gradients(self, request: Request) -> list[tuple[str, torch.Tensor]]:
        """The gradients ``request`` pushes, on the host, by shard name.

        Async: parameters without a gradient are left out. Sync: an update
        averages a gradient of every variable, so a parameter this replica
        did not use contributes zeros.
        """
        push = request.push
        grads = [(s.name, grad if s.whole else grad[s.part]) for s in push if (grad := s.param.grad) is not None]
        if self.sync and len(grads) < len(push):
            grads = [(s.name, s.rows(_grad_or_zeros(s.param))) for s in push]
        if not self._cuda:
            return grads
        if self._device_wire_dtype is not None:
            grads = [(name, dtypes.to_wire(grad, self._device_wire_dtype)) for name, grad in grads]
        return self.staging.grads_to_host(grads)

    def assign(self, requests: Sequence[Request], replies: Sequence[DenseReply]) -> None:
        """Write the values the replies carry into the parameters, and clear the gradients."""
        cuda = self._cuda
        with torch.no_grad():
            for request, reply in zip(requests, replies):
                for slot, tensor in zip(request.pull, reply.values):
                    if cuda:
                        self.staging.to_device(slot.rows(slot.param.data), tensor)
                    elif slot.whole:
                        # A whole CPU parameter takes the received bytes as its
                        # storage: the reply is not copied again (unless it
                        # travelled compressed: then widening is the copy).
                        slot.param.data = tensor if tensor.dtype == slot.param.dtype else tensor.to(slot.param.dtype)
                    else:
                        slot.param.data[slot.part].copy_(tensor)
            self.clear_gradients()
        if cuda:
            self.staging.synchronize()

    def clear_gradients(self) -> None:
        for param in self._params:
            param.grad = None


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)

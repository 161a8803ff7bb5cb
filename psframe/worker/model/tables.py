"""A worker's embedding tables: the rows a batch looks up are pulled, the rows it touched are pushed.

Every ``nn.Embedding`` and ``nn.EmbeddingBag`` built with ``sparse=True`` is
an embedding table: its weight lives on the ps tasks in parts
(:mod:`psframe.tables.spec`) and never travels whole. The
trainer hooks each table's module: before its forward, the ids it is about
to look up are pulled from the ps tasks into the local weight (only those
rows); after backward, its sparse gradient (duplicates summed) is cut by
part and pushed as ids plus rows. Nothing changes in the model's code.

:class:`EmbeddingTables` is a model's tables as one set:
:meth:`~EmbeddingTables.attach` gives each table module a forward that looks
the batch up in rows pulled from the ps tasks
(:mod:`psframe.worker.model.attached_forward`; one table's lookup is in
:mod:`psframe.worker.model.table_views`, its pulls in
:mod:`psframe.worker.model.row_pulls`), and puts the local weights in the
memory it is given (large ones on huge pages by default, see
:mod:`psframe.memory.huge_pages`); :meth:`~EmbeddingTables.gradients` cuts a
step's row gradients by part; ``trainer.pull()`` writes the current values of
the rows a lookup wrote into a local weight there again
(:meth:`EmbeddingTables.refresh`); and a re-layout hands a step under way
over to the tables as placed anew (:meth:`~EmbeddingTables.step_state`,
:meth:`~EmbeddingTables.take_over`, :meth:`~EmbeddingTables.rows_moved`). A
table's weight must be used only through its module's forward (not tied to
another layer), since only those lookups are seen.

A dynamic table (:class:`~psframe.worker.model.dynamic.DynamicEmbedding`) has
no local weight: its lookups get the rows of their distinct ids from the
ps tasks (one part per ps task, by id), and its gradients are those rows'.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

from psframe.errors import InvalidGradientError, PsframeError
from psframe.memory import HugePageMemory, Memory
from psframe.tables.rows import RowPush
from psframe.worker.model.attached_forward import replace_forward, restore_forward
from psframe.worker.model.dynamic import DynamicEmbedding
from psframe.worker.model.row_gradient import RowGradient
from psframe.worker.model.row_pulls import Pull, pull_parts
from psframe.worker.model.table_views import DynamicTable, EmbeddingModule, Table
from psframe.worker.plan.step_plan import Slot

TABLE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)

REFRESH_BYTES = 64 << 20  # the most bytes of rows one pull of EmbeddingTables.refresh asks for


def find_tables(model: torch.nn.Module) -> dict[str, EmbeddingModule]:
    """The model's embedding tables: parameter name -> module, for every
    ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` and a trainable weight.

    Raises:
        ValueError: a table with ``max_norm`` (its forward rewrites rows in
            place, which a ps cannot follow), or whose weight another module shares.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    tables: dict[str, EmbeddingModule] = {}
    for module in model.modules():
        if not isinstance(module, TABLE_MODULES) or not module.sparse or not module.weight.requires_grad:
            continue
        name = names[id(module.weight)]
        if module.max_norm is not None:
            raise ValueError(
                f"embedding table {name!r} has max_norm={module.max_norm}: its forward renormalises "
                f"rows in place, which the ps tasks cannot follow; use sparse=False or no max_norm"
            )
        if owners[id(module.weight)] > 1:
            raise ValueError(
                f"embedding table {name!r} shares its weight with another module (tied weights); "
                f"a table is pulled and pushed by rows, so only its own lookups may use it: "
                f"use sparse=False to train it as a whole variable"
            )
        tables[name] = module
    return tables


class EmbeddingTables:
    """The tables of a replica, with their lookups hooked while attached to the ps tasks.

    Args:
        tables: parameter name -> module (from :func:`find_tables`).
        slots: the slots of every table part (any order).
        dynamic: the dynamic tables, by module name.
        memory: where the local weights live (:class:`psframe.memory.Memory`; large ones on
            huge pages by default), told of each table's weight at :meth:`attach`.
    """

    def __init__(
        self,
        tables: Mapping[str, EmbeddingModule],
        slots: Sequence[Slot],
        dynamic: Mapping[str, DynamicEmbedding] | None = None,
        memory: Memory | None = None,
    ) -> None:
        self._memory = memory if memory is not None else HugePageMemory()
        by_table: dict[str, list[Slot]] = {}
        for slot in slots:
            by_table.setdefault(slot.shard.variable, []).append(slot)
        self.tables = [
            Table(name, module, sorted(by_table[name], key=lambda s: s.shard.part_index))
            for name, module in tables.items()
        ]
        self.dynamic = [
            DynamicTable(name, module, sorted(by_table[name], key=lambda s: s.shard.part_index))
            for name, module in (dynamic or {}).items()
        ]

    def __bool__(self) -> bool:
        return bool(self.tables or self.dynamic)

    def attach(self, pull: Pull) -> None:
        """Have each table's forward look its batch up in rows pulled from the ps tasks, from now on."""
        self.detach()
        # The pulled rows are written into the local weights at random: on
        # huge pages, as on the ps tasks, a large table costs a step about what a small one does.
        for table in self.tables:
            self._memory.keep(table.param)
        for table in self.tables:
            # This module's own forward, for as long as it is attached (detach() gives its own back).
            replace_forward(table.module, functools.partial(table.lookup, functools.partial(self._pull, table, pull)))
        for dynamic in self.dynamic:
            dynamic.module.attach(functools.partial(dynamic.pull, pull=pull))

    def detach(self) -> None:
        """Give the table modules their own forward back (the local weights keep the rows last pulled)."""
        for table in self.tables:
            restore_forward(table.module)
            table.prefetched = []
        for dynamic in self.dynamic:
            dynamic.module.attach(None)
            dynamic.prefetched = []

    def drop_prefetched(self) -> None:
        """Forget the rows pulled ahead that no lookup took."""
        for table in self.tables:
            table.prefetched = []
        for dynamic in self.dynamic:
            dynamic.prefetched = []

    def has_gradients(self) -> bool:
        """Whether backward reached the rows of a lookup since the last step (and, of a fixed table,
        its weight's grad was not set to None since)."""
        return any(table.param.grad is not None for table in self.tables) or any(
            table.module.has_gradients() for table in self.dynamic
        )

    def table_of(self, module: torch.nn.Module) -> Table | DynamicTable:
        """The table ``module`` is.

        Raises:
            TypeError: ``module`` is none of this model's tables (an
                ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True``,
                or a :class:`~psframe.worker.model.dynamic.DynamicEmbedding`).
        """
        for table in self.tables:
            if table.module is module:
                return table
        for dynamic in self.dynamic:
            if dynamic.module is module:
                return dynamic
        raise TypeError(
            f"rows can be prefetched for the model's nn.Embedding/nn.EmbeddingBag tables built with "
            f"sparse=True and its DynamicEmbeddings; {type(module).__name__} is not an embedding table of the model"
        )

    @staticmethod
    def _pull(table: Table, pull: Pull, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (distinct, sorted, on the host) from the parts that hold them."""
        return pull_parts(pull, table.split(ids), ids.numel(), table.param, create=True)

    def step_state(self) -> list[tuple[list, list]]:
        """Each table's lookups of this step and rows pulled ahead (fixed tables, then dynamic), for
        :meth:`take_over`. A fixed table's lookups are in its weight's grad, which stays."""
        return [([], table.prefetched) for table in self.tables] + [
            (dynamic.module.lookups, dynamic.prefetched) for dynamic in self.dynamic
        ]

    def take_over(self, before: EmbeddingTables, state: list[tuple[list, list]]) -> None:
        """Go on from ``before`` (the same model's tables as placed before a re-layout, detached), as
        its :meth:`step_state` was: this step's lookups, and rows pulled ahead, are these tables'. The
        lists are shared by both, not copied: a lookup under way on ``before`` (its pull found the
        layout changed) records its rows here too (a fixed table's, in the one weight's grad)."""
        fixed = len(self.tables)
        for table, old, (_, prefetched) in zip(self.tables, before.tables, state[:fixed]):
            table.held = old.held  # one local weight
            table.prefetched = old.prefetched = prefetched
        for dynamic, old_dynamic, (looked_up, prefetched) in zip(self.dynamic, before.dynamic, state[fixed:]):
            dynamic.module.lookups = looked_up  # one module: the lookup under way appends here
            dynamic.prefetched = old_dynamic.prefetched = prefetched

    def refresh(self, pull: Pull) -> int:
        """Write the current value of every row a lookup wrote into a fixed table's local weight
        there again (the others keep theirs); returns the rows pulled.
        Pulled in batches of at most :data:`REFRESH_BYTES` (``create``: as a lookup's pull)."""
        count = 0
        for table in self.tables:
            ids, weight = table.held_ids(), table.param
            batch = max(1, REFRESH_BYTES // max(1, weight.shape[1:].numel() * weight.element_size()))
            for some in torch.split(ids, batch):
                rows = pull_parts(pull, table.split(some), some.numel(), weight, create=True)
                with torch.no_grad():
                    weight.index_copy_(0, some.to(weight.device), rows.to(weight.device, weight.dtype))
            count += ids.numel()
        return count

    def rows_moved(self, before: EmbeddingTables, part: str, ids: torch.Tensor, pull: Pull) -> torch.Tensor:
        """The rows a lookup asked of part ``part`` of ``before`` (the same model's tables as placed
        before a re-layout), read from these tables' parts: ``ids`` as that part numbers its rows.

        Raises:
            PsframeError: ``part`` is no part of a fixed table of ``before``.
        """
        dynamic = next((d for d in before.dynamic for slot in d.slots if slot.name == part), None)
        if dynamic is not None:  # a dynamic part is asked by the ids themselves
            return next(d for d in self.dynamic if d.name == dynamic.name).pull(ids, True, pull)
        slot = next((slot for table in before.tables for slot in table.slots if slot.name == part), None)
        if slot is None:
            raise PsframeError(f"{part!r} is no part of an embedding table placed before the re-layout")
        whole = slot.shard.row_start + ids * max(1, slot.shard.row_stride)  # the ids of the table
        table = next(table for table in self.tables if table.name == slot.shard.variable)
        return pull_parts(pull, table.split(whole), whole.numel(), table.param, create=True)

    @property
    def names(self) -> list[str]:
        """Every table's name (its weight's parameter name), fixed tables first."""
        return [table.name for table in self.tables] + [table.name for table in self.dynamic]

    def gradients(
        self, every_table: bool = False, except_tables: frozenset[str] = frozenset()
    ) -> dict[int, list[RowPush]]:
        """Per ps task, the rows each table's backward touched and their gradients,
        as ``(part, ids within the part, rows)`` on the host, duplicates summed.

        Every part of a table that has a gradient is listed, with no rows if
        the batch touched none of its ids: its optimizer counts the step, as
        one process's would. With ``every_table`` (synchronous training,
        where an update waits for every variable of every member), a table
        without a gradient is listed too, with no rows; but for those of
        ``except_tables`` (applied at once, outside the rounds).

        Raises:
            InvalidGradientError: a table's weight got a gradient (it was used
                outside its module's forward, which the ps tasks cannot follow).
        """
        return self.cut(self.take_row_gradients(), every_table, except_tables)

    def take_row_gradients(self) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each table's rows this step's backward touched (ids of the whole table) and their
        gradients, duplicates summed; None for a table the batch did not use. Taken: the next
        step's lookups start afresh. :meth:`cut` shares them out among the parts.

        A fixed table's are its weight's grad (a
        :class:`~psframe.worker.model.row_gradient.RowGradient`, as the user's clipping left it;
        None: none, or dropped), which is taken too.

        Raises:
            InvalidGradientError: a table's weight got a gradient of its whole weight.
        """
        used: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for table in self.tables:
            grad = table.param.grad
            if grad is not None and not isinstance(grad, RowGradient):
                raise InvalidGradientError(
                    f"embedding table {table.name!r} got a gradient of its whole weight: it was "
                    f"used outside its module's forward, or its grad was set"
                )
            used[table.name] = grad.take_rows() if grad is not None else None
            table.param.grad = None
        for dynamic in self.dynamic:
            used[dynamic.name] = dynamic.module.take_gradients()
        return used

    def cut(
        self,
        used: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None],
        every_table: bool = False,
        except_tables: frozenset[str] = frozenset(),
    ) -> dict[int, list[RowPush]]:
        """:meth:`gradients` of the row gradients :meth:`take_row_gradients` took (of these
        tables, or of the same model placed otherwise: a re-layout's), cut for these parts."""
        pushes: dict[int, list[RowPush]] = {}
        for table in self.tables:
            rows = used.get(table.name)
            if rows is None:
                if every_table and table.name not in except_tables:
                    for slot in table.slots:
                        pushes.setdefault(slot.shard.ps_task, []).append(
                            (
                                slot.name,
                                torch.zeros(0, dtype=torch.int64),
                                torch.zeros((0, *table.param.shape[1:]), dtype=table.param.dtype),
                            )
                        )
                continue
            ids, values = rows
            for slot, positions, local in table.split(ids):
                pushes.setdefault(slot.shard.ps_task, []).append((slot.name, local, values[positions]))
        for dynamic in self.dynamic:
            dynamic.cut(pushes, used.get(dynamic.name), every_table and dynamic.name not in except_tables)
        return pushes

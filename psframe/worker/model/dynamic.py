"""Dynamic embedding tables: any int64 id, a row made on first touch.

:class:`DynamicEmbedding` is the module a model uses where it would use
``nn.Embedding``/``nn.EmbeddingBag`` but cannot number its ids in advance
(hashed features, user or item ids of an open catalogue)::

    self.users = psframe.DynamicEmbedding(64, initializer=psframe.RowInitializer(std=0.01, seed=1),
                                          max_rows=1_000_000)
    ...
    vectors = self.users(user_ids)            # any int64 ids, shape (batch,) -> (batch, 64)

It holds no rows itself. Trained through :class:`psframe.Trainer`, its
rows live on the ps tasks, one part per ps task: each forward pulls the
rows of the batch's distinct ids (the ps tasks make those they do not hold
yet), and after backward the trainer pushes their gradients, which the ps
tasks' table optimizer applies to those rows only. In one process,
:class:`DynamicTables` holds the rows and applies the updates instead: the
reference a distributed run is compared with.

In ``eval()`` mode (or under ``torch.no_grad()``), a lookup of an id not
held returns its initial row without making it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from psframe.errors import PsframeError
from psframe.memory import HugePageMemory
from psframe.optim import OptimizerSpec
from psframe.tables.dynamic_rows import DynamicRows
from psframe.tables.spec import Admission, DynamicTableSpec, Eviction, RowInitializer
from psframe.worker.model.row_gradient import sum_rows

# rows(ids, create) -> the rows of ids (int64, on the host), made where missing if `create`.
RowSource = Callable[[torch.Tensor, bool], torch.Tensor]

BAG_MODES = ("sum", "mean", "max")


class DynamicEmbedding(torch.nn.Module):
    """An embedding table over any int64 ids, whose rows are made on first touch.

    Args:
        embedding_dim: the width of a row.
        mode: None for ``nn.Embedding``'s lookup (``(*ids.shape, dim)`` out);
            ``"sum"``, ``"mean"`` or ``"max"`` to reduce each bag as
            ``nn.EmbeddingBag`` does (2-d ids, or 1-d ids with ``offsets``).
        initializer: how a new id's row is made (:class:`RowInitializer`;
            N(0, 1) as ``nn.Embedding`` by default). The same id always gets
            the same row.
        max_rows: the most rows each ps task keeps of this table (None: no cap).
        eviction: which rows go first when the cap is reached: ``"lru"``
            (updated longest ago) or ``"lfu"`` (updated fewest times).
        max_age: forget rows not updated in this many updates of their part (None: never).
        ttl_seconds: forget rows not looked up for training or updated for this
            many seconds of wall-clock time (None: never); evaluation's lookups
            do not count. A forgotten id gets a fresh row when it comes back.
        min_norm: forget a row as soon as an update leaves its L2 norm below
            this (None: never).
        admit_after: give a new id a row only once it was looked up for
            training this many times (1: at once); until then it reads as
            its initial row, its gradients are dropped, and it takes no
            memory. Counted in a counting Bloom filter of
            ``admission_counters`` bytes per ps task
            (:class:`~psframe.tables.spec.Admission`).
        admit_probability: or give a new id a row with this probability at
            each training lookup (1.0: always).
        admission_counters: the counting filter's size, a power of two.
        dtype: the rows' dtype.
        row_storage: the dtype the ps tasks store the rows in, ``torch.bfloat16`` or
            ``torch.float16`` (or its name) for compact rows: half the bytes of float32 per
            row; each update is worked out in float32 (the optimizer's state stays float32)
            and stored rounded stochastically, reproducibly (:mod:`psframe.tables.compact`).
            Rows are read in ``dtype``. None: ``dtype``.
        ram_budget: bytes of RAM each ps task's part of the table may take, its rows and their
            optimizer state; the rows beyond it live on the ps host's local disk (LMDB, in
            ``PSFRAME_TABLE_DISK_DIR`` or the system's temporary folder), those updated longest ago
            first, and come back in batches when looked up (:mod:`psframe.tables.disk_tier`).
            Not with ``max_rows``, ``max_age`` or ``ttl_seconds`` yet. None: all in RAM.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        mode: str | None = None,
        initializer: RowInitializer | None = None,
        max_rows: int | None = None,
        eviction: str = "lru",
        max_age: int | None = None,
        ttl_seconds: float | None = None,
        min_norm: float | None = None,
        admit_after: int = 1,
        admit_probability: float = 1.0,
        admission_counters: int = Admission.counters,
        dtype: torch.dtype = torch.float32,
        row_storage: torch.dtype | str | None = None,
        ram_budget: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if mode is not None and mode not in BAG_MODES:
            raise ValueError(f"mode must be None or one of {BAG_MODES}, got {mode!r}")
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.spec = DynamicTableSpec(
            initializer or RowInitializer(),
            Eviction(max_rows=max_rows, policy=eviction, max_age=max_age, ttl_seconds=ttl_seconds, min_norm=min_norm),
            Admission(min_count=admit_after, probability=admit_probability, counters=admission_counters),
            str(row_storage).removeprefix("torch.") if row_storage is not None else None,
            ram_budget,
        )
        # Stands for the table where a parameter would (its dtype and row width); holds no row.
        self.row_template = torch.empty((0, embedding_dim), dtype=dtype)
        self._rows: RowSource | None = None
        self._looked_up: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getstate__(self) -> dict[str, object]:
        """The module as pickled (``torch.save(model)``, ``copy.deepcopy``): its definition, not
        where its lookups get their rows (the trainer's, which holds its client): unattached."""
        state = dict(self.__dict__)
        state["_rows"], state["_looked_up"] = None, []
        return state

    def extra_repr(self) -> str:
        spec = self.spec
        storage = f", row_storage={spec.storage!r}" if spec.storage is not None else ""
        storage += f", ram_budget={spec.ram_budget}" if spec.ram_budget is not None else ""
        return (
            f"{self.embedding_dim}, mode={self.mode!r}, {spec.initializer}, {spec.eviction}, {spec.admission}{storage}"
        )

    def attach(self, rows: RowSource | None) -> None:
        """Where lookups get their rows from (None: nowhere; set by the trainer or :class:`DynamicTables`)."""
        self._rows = rows
        self._looked_up = []

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self._rows is None:
            raise PsframeError(
                "this DynamicEmbedding holds no rows: train it through psframe.Trainer (its rows "
                "live on the ps tasks), or in one process with psframe.DynamicTables(model, ...)"
            )
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"a DynamicEmbedding looks up int64 ids, got {ids.dtype}")
        distinct, position = torch.unique(ids, return_inverse=True)
        learning = self.training and torch.is_grad_enabled()
        host_ids = distinct.to("cpu", torch.int64)
        rows = self._rows(host_ids, learning).to(ids.device, self.row_template.dtype)
        if learning:
            rows.requires_grad_(True)
            self._looked_up.append((host_ids, rows))
        # sparse: the gradient of the rows is one entry per lookup, summed by take_gradients as
        # backward sums an nn.Embedding's, so that a ps task's update is one process's, bit for bit.
        if self.mode is None:
            return F.embedding(position, rows, sparse=True)
        return F.embedding_bag(
            position, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights, sparse=True
        )

    def has_gradients(self) -> bool:
        """Whether backward reached the rows of a lookup since the last step."""
        return any(rows.grad is not None for _, rows in self._looked_up)

    @property
    def lookups(self) -> list[Lookup]:
        """This step's lookups (the list itself: :meth:`attach` starts a new one)."""
        return self._looked_up

    @lookups.setter
    def lookups(self, looked_up: list[Lookup]) -> None:
        self._looked_up = looked_up

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ids this step's lookups used and their rows' gradients (on the
        host; an id looked up twice has its gradients summed), forgetting the
        lookups; None if backward reached none."""
        looked_up, self._looked_up = self._looked_up, []
        return lookup_gradients(looked_up)


Lookup = tuple[torch.Tensor, torch.Tensor]  # the distinct ids a lookup used (host, int64), their rows (a leaf)


def lookup_gradients(looked_up: Sequence[Lookup]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ids some lookups used and their rows' gradients, on the host: each
    id once (sorted), the gradients of its repeats summed as backward sums an
    ``nn.Embedding(sparse=True)``'s, bit for bit; None if backward reached no row."""
    used = [(ids, rows.grad.to("cpu")) for ids, rows in looked_up if rows.grad is not None]
    if not used:
        return None
    return sum_rows([ids for ids, _ in used], [grad for _, grad in used])


def find_dynamic_tables(model: torch.nn.Module) -> dict[str, DynamicEmbedding]:
    """The model's dynamic tables, by module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, DynamicEmbedding)}


class DynamicTables:
    """The dynamic tables of a model trained in one process, without ps tasks.

    Holds each table's rows and updates them with ``optimizer`` (a table
    optimizer, e.g. ``psframe.optim.Adagrad(lr=0.1)``; see
    :mod:`psframe.optim.rows_kernels`), exactly as a ps task would::

        tables = psframe.DynamicTables(model, psframe.optim.Adagrad(lr=0.05))
        loss.backward(); dense_optimizer.step(); tables.step()

    Raises:
        ValueError: the model has no :class:`DynamicEmbedding`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerSpec) -> None:
        self.modules = find_dynamic_tables(model)
        if not self.modules:
            raise ValueError("the model has no DynamicEmbedding")
        self.rows = {
            name: DynamicRows(
                name, (m.embedding_dim,), m.row_template.dtype, m.spec, optimizer, memory=HugePageMemory()
            )
            for name, m in self.modules.items()
        }
        for name, module in self.modules.items():
            module.attach(functools.partial(_read_rows, self.rows[name]))

    def step(self) -> None:
        """Apply the gradients of the rows each table's lookups used since the last step."""
        for name, module in self.modules.items():
            used = module.take_gradients()
            if used is not None:
                self.rows[name].apply(*used)

    def zero_grad(self) -> None:
        """Forget the lookups since the last step, without applying their gradients."""
        for module in self.modules.values():
            module.take_gradients()


def _read_rows(rows: DynamicRows, ids: torch.Tensor, create: bool) -> torch.Tensor:
    """A :data:`RowSource` over a table held in this process."""
    return rows.read(ids, create=create)

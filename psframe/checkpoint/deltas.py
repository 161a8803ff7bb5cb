"""Delta checkpoints: what changed since the checkpoint before, and chains of them on a full checkpoint.

Between full checkpoints the chief commits deltas. Each ps task writes
what changed in its store since the checkpoint the delta follows (its
*parent*: the full checkpoint or the delta before), all taken under its
store's lock, so a row's value and its optimizer state are always of one
instant::

    DIR/ckpt-000000001000/...                      <- a full checkpoint (files.py)
    DIR/delta-000000001100/shard-00000-of-00002.pt <- ps task 0's changes since step 1000
    DIR/delta-000000001100/MANIFEST.json           <- {"parent": 1000, ...}, the chief's commit
    DIR/delta-000000001200/...                     <- {"parent": 1100, ...}

A delta shard (:class:`DeltaShard`) holds the dense variables that changed
(whole, with their optimizer state), the rows of fixed tables that changed
(with theirs), each dynamic table part's changed rows (as
:meth:`psframe.tables.dynamic_rows.DynamicRows.export` gives them) and the ids it
evicted (tombstones), the part's clock and counts, and the global step,
pushes and learning-rate schedules' states of the instant.

A *chain* (:class:`Chain`) is a full checkpoint and the deltas that follow
it, each naming the one before as its parent. :func:`latest_chain` finds
the newest one whose files all verify: a delta that is corrupt, or that
does not follow the one before (a gap), ends the chain there, with a
logged warning. :meth:`Chain.read_shard` applies the deltas to the full
checkpoint's shard in order (:func:`apply_delta`): the result is what a
full checkpoint at the chain's last step holds, bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psframe.checkpoint import files
from psframe.checkpoint.atomic import join, norm
from psframe.checkpoint.manifest import Manifest, ShardRecord, folder_name
from psframe.checkpoint.shard import DELTA_FORMAT_VERSION, DELTA_FORMATS, OptimizerData, ShardData, VariableData
from psframe.errors import CheckpointCorruptError, CheckpointError
from psframe.optim.row_state import is_row_state

logger = logging.getLogger(__name__)

_DYNAMIC_ROWS = ("updated", "updates", "seen")  # per-row tensors of a dynamic part besides its rows and state


@dataclass(frozen=True, eq=False)
class RowChanges:
    """The rows of a fixed table part that changed: their indices in the part, values and optimizer state.

    ``state`` holds per-row state by row (:func:`psframe.optim.row_state.is_row_state`) and any other state whole.
    """

    index: torch.Tensor
    value: torch.Tensor
    state: Mapping[str, Any]

    @classmethod
    def of(cls, index: torch.Tensor, value: torch.Tensor, state: Mapping[str, Any]) -> RowChanges:
        """Copies of rows ``index`` of a fixed table part ``value`` and of its optimizer ``state``
        (per-row state by row; any other state whole)."""
        rows = {
            k: (x.index_select(0, index) if is_row_state(x, value.shape) else x.clone())
            if isinstance(x, torch.Tensor)
            else x
            for k, x in state.items()
        }
        return cls(index, value.detach().index_select(0, index), rows)

    def well_formed(self) -> bool:
        """Whether it holds 1-d int64 indices and a row of values per index."""
        return (
            isinstance(self.index, torch.Tensor)
            and self.index.dtype == torch.int64
            and self.index.dim() == 1
            and isinstance(self.value, torch.Tensor)
            and self.value.shape[:1] == self.index.shape
            and isinstance(self.state, Mapping)
        )


@dataclass(frozen=True, eq=False)
class DeltaShard:
    """What one ps task changed since checkpoint ``parent_step``, at global step ``global_step``.

    ``variables`` are dense variables, whole, by stored name, each as
    ``(value, state)``; ``rows`` fixed table parts; ``dynamic`` dynamic table
    parts, each as :meth:`~psframe.tables.dynamic_rows.DynamicRows.export_changes` gives it.
    """

    global_step: int
    ps_task: int
    num_shards: int
    parent_step: int
    variables: Mapping[str, tuple[torch.Tensor, Mapping[str, Any]]]
    rows: Mapping[str, RowChanges]
    dynamic: Mapping[str, Mapping[str, Any]]
    pushes: Mapping[str, list[int]] | None = None
    # Where the optimizers' schedules stood, by optimizer ("optimizer", "table_optimizer"); absent: as before.
    schedules: Mapping[str, Mapping[str, Any]] | None = None

    def to_dict(self) -> dict:
        """The plain dict ``torch.save`` writes (read back with ``weights_only=True``)."""
        return {
            "format_version": DELTA_FORMAT_VERSION,
            "kind": "delta",
            "global_step": self.global_step,
            "ps_task": self.ps_task,
            "num_shards": self.num_shards,
            "parent_step": self.parent_step,
            "variables": {
                name: {"value": value.detach().contiguous(), "state": dict(state)}
                for name, (value, state) in self.variables.items()
            },
            "rows": {
                name: {"index": r.index, "value": r.value.contiguous(), "state": dict(r.state)}
                for name, r in self.rows.items()
            },
            "dynamic": {name: dict(part) for name, part in self.dynamic.items()},
            "pushes": None if self.pushes is None else {k: [int(x) for x in v] for k, v in self.pushes.items()},
            "schedules": None if self.schedules is None else {k: dict(v) for k, v in self.schedules.items()},
        }

    @classmethod
    def from_dict(cls, obj: Any) -> DeltaShard:
        """The delta a loaded dict holds.

        Raises:
            CheckpointError: not a delta shard of a format this psframe reads, or a part of it is malformed.
        """
        if not isinstance(obj, Mapping) or obj.get("kind") != "delta":
            raise CheckpointError("not a delta shard (no 'kind': 'delta')")
        if obj.get("format_version") not in DELTA_FORMATS:
            raise CheckpointError(
                f"delta format {obj.get('format_version')!r}; this psframe reads formats {list(DELTA_FORMATS)}"
            )
        try:
            delta = cls(
                global_step=int(obj["global_step"]),
                ps_task=int(obj["ps_task"]),
                num_shards=int(obj["num_shards"]),
                parent_step=int(obj["parent_step"]),
                variables={n: (v["value"], dict(v["state"])) for n, v in obj["variables"].items()},
                rows={n: RowChanges(r["index"], r["value"], dict(r["state"])) for n, r in obj["rows"].items()},
                dynamic={n: dict(p) for n, p in obj["dynamic"].items()},
                pushes=obj["pushes"],
                schedules=obj.get("schedules"),  # absent from deltas written before schedules
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise CheckpointError(f"a malformed delta shard: {e!r}") from e
        for name, r in delta.rows.items():
            if not r.well_formed():
                raise CheckpointError(f"delta rows of {name!r} need 1-d int64 indices and a row per index")
        for name, part in delta.dynamic.items():
            ids, deleted = part.get("ids"), part.get("deleted")
            if not all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1 for t in (ids, deleted)):
                raise CheckpointError(f"delta of dynamic table part {name!r} needs 1-d int64 ids and deleted ids")
        return delta


# ---- writing


def write_delta_shard(url: str, step: int, delta: DeltaShard) -> ShardRecord:
    """Write one ps task's shard of the delta checkpoint at ``step`` under ``url`` (counts once committed).

    Raises:
        CheckpointError: ``step`` does not follow the delta's parent, or that delta is already committed.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step <= delta.parent_step:
        raise CheckpointError(f"a delta's step ({step!r}) must come after its parent step {delta.parent_step}")
    return files.write_content(join(norm(url), folder_name(step, delta=True)), delta.to_dict())


def commit_delta(url: str, step: int, parent: int, records: Sequence[ShardRecord]) -> Manifest:
    """Commit the delta checkpoint at ``step`` following checkpoint ``parent`` by writing its manifest.

    Raises:
        CheckpointError: the parent is not a committed checkpoint (full or
            delta) under ``url``, or the records are not one per ps task, or
            a shard file is missing (see :func:`psframe.checkpoint.files.write_manifest`).
    """
    require_parent(url, step, parent)
    return files.write_manifest(url, step, records, parent=parent)


def require_parent(url: str, step: int, parent: int, num_shards: int | None = None) -> None:
    """Raise unless ``parent`` is a committed checkpoint (full or delta) under ``url`` that ``step``
    follows, written by ``num_shards`` ps tasks (when given: a delta's shards follow its parent's).

    Raises:
        CheckpointError: naming the delta's step and its parent.
    """
    if step <= parent:
        raise CheckpointError(f"a delta's step ({step}) must come after its parent step {parent}")
    committed = {m.step: m for m in files.list_checkpoints(url)} | {
        m.step: m for m in files.list_checkpoints(url, deltas=True)
    }
    if parent not in committed:
        raise CheckpointError(
            f"cannot commit the delta of step {step} in {url}: its parent, step {parent}, is no committed checkpoint"
        )
    if num_shards is not None and committed[parent].num_shards != num_shards:
        raise CheckpointError(
            f"cannot write the delta of step {step} from step {parent}: that checkpoint has "
            f"{committed[parent].num_shards} shards, and {num_shards} ps tasks hold the model now (a re-layout)"
        )


def read_delta(manifest: Manifest, ps_task: int) -> DeltaShard:
    """Load ``ps_task``'s shard of a committed delta checkpoint, after verifying its size and sha256.

    Raises:
        CheckpointCorruptError: the file is missing or does not match the manifest.
        CheckpointError: the file is no delta shard this psframe reads, or another ps task's.
    """
    content, where = files.load_verified(manifest, ps_task)
    try:
        delta = DeltaShard.from_dict(content)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e
    if (delta.ps_task, delta.num_shards, delta.parent_step) != (ps_task, manifest.num_shards, manifest.parent):
        raise CheckpointError(
            f"{where} holds ps task {delta.ps_task} of {delta.num_shards} after step {delta.parent_step}; "
            f"the manifest expects ps task {ps_task} of {manifest.num_shards} after step {manifest.parent}"
        )
    return delta


# ---- applying


def apply_delta(shard: ShardData, delta: DeltaShard) -> ShardData:
    """``shard`` (of the delta's parent) with the delta's changes applied: a new record, ``shard`` left as it is.

    Raises:
        CheckpointError: the delta is another ps task's, or names a variable the shard does not hold.
    """
    if (delta.ps_task, delta.num_shards) != (shard.ps_task, shard.num_shards):
        raise CheckpointError(
            f"a delta of ps task {delta.ps_task} of {delta.num_shards} cannot apply to the shard of "
            f"ps task {shard.ps_task} of {shard.num_shards}"
        )
    held = {v.name for v in shard.variables}
    unknown = sorted((set(delta.variables) | set(delta.rows) | set(delta.dynamic)) - held)
    if unknown:
        raise CheckpointError(f"a delta of ps task {delta.ps_task} changes {unknown}, which its parent does not hold")
    variables = []
    for var in shard.variables:
        if var.name in delta.variables:
            value, state = delta.variables[var.name]
            var = dataclasses.replace(var, value=value, state=dict(state))
        elif var.name in delta.rows:
            var = with_rows(var, delta.rows[var.name])
        elif var.name in delta.dynamic:
            var = _with_dynamic(var, delta.dynamic[var.name])
        variables.append(var)
    schedules = delta.schedules or {}  # where each optimizer's schedule stood, if it has one

    def scheduled(key: str, record: OptimizerData | None) -> OptimizerData | None:
        if record is None or key not in schedules:
            return record
        return dataclasses.replace(record, schedule_state=dict(schedules[key]))

    return dataclasses.replace(
        shard,
        global_step=delta.global_step,
        variables=tuple(variables),
        pushes=shard.pushes if delta.pushes is None else dict(delta.pushes),
        optimizer=scheduled("optimizer", shard.optimizer) or shard.optimizer,
        table_optimizer=scheduled("table_optimizer", shard.table_optimizer),
    )


def with_rows(var: VariableData, rows: RowChanges, *, in_place: bool = False) -> VariableData:
    """A fixed table part with its changed rows (and their state) put in; ``in_place``: into its
    own tensors (the caller's to change), else into copies."""
    value = var.value if in_place else var.value.clone()
    value.index_copy_(0, rows.index, rows.value.to(value.dtype))
    state = dict(var.state)
    for key, changed in rows.state.items():
        old = state.get(key)
        if isinstance(changed, torch.Tensor) and is_row_state(old, var.value.shape):
            state[key] = (old if in_place else old.clone()).index_copy_(0, rows.index, changed.to(old.dtype))
        else:  # other state, whole; or state made since the parent, for which every row is in the delta
            state[key] = changed
    return dataclasses.replace(var, value=value, state=state)


def _with_dynamic(var: VariableData, changes: Mapping[str, Any]) -> VariableData:
    """A dynamic table part with the ids evicted since its parent removed and its changed rows upserted."""
    if var.dynamic is None:
        raise CheckpointError(f"a delta changes dynamic rows of {var.name!r}, which is no dynamic table part")
    old_ids = var.dynamic["ids"]
    changed_ids = changes["ids"]
    # Keep an old row unless it was evicted or changed since; then add the changed rows; sort by id.
    keep = ~(torch.isin(old_ids, changes["deleted"]) | torch.isin(old_ids, changed_ids))
    ids = torch.cat([old_ids[keep], changed_ids])
    order = torch.argsort(ids)

    def merged(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old[keep], new.to(old.dtype)])[order]

    state: dict[str, Any] = {}
    for key, new in changes["state"].items():
        old = var.state.get(key)
        per_row = isinstance(new, torch.Tensor) and new.dim() and new.shape[0] == changed_ids.numel()
        if per_row and isinstance(old, torch.Tensor) and old.dim() and old.shape[0] == old_ids.numel():
            state[key] = merged(old, new)
        else:
            state[key] = new
    dynamic = dict(var.dynamic)
    dynamic["ids"] = ids[order]
    for key in _DYNAMIC_ROWS:
        if changes.get(key) is not None and dynamic.get(key) is not None:
            dynamic[key] = merged(dynamic[key], changes[key])
    for key in ("clock", "counts", "admission"):
        if key in changes:
            dynamic[key] = changes[key]
    rows = merged(var.value, changes["rows"])
    return dataclasses.replace(var, value=rows, state=state, dynamic=dynamic, shape=tuple(rows.shape))


# ---- chains


@dataclass(frozen=True)
class Chain:
    """A committed full checkpoint (``base``) and the deltas that follow it, in order."""

    base: Manifest
    deltas: tuple[Manifest, ...] = ()

    @property
    def step(self) -> int:
        """The step the chain restores: its last delta's, or the full checkpoint's."""
        return self.deltas[-1].step if self.deltas else self.base.step

    @property
    def num_shards(self) -> int:
        return self.base.num_shards

    @property
    def last(self) -> Manifest:
        """The manifest of the chain's last checkpoint (full or delta)."""
        return self.deltas[-1] if self.deltas else self.base

    def read_shard(self, ps_task: int) -> ShardData:
        """``ps_task``'s shard as at :attr:`step`: the full checkpoint's, with every delta applied in order."""
        shard = files.read_shard(self.base, ps_task)
        for manifest in self.deltas:
            shard = apply_delta(shard, read_delta(manifest, ps_task))
        return shard

    def read_shards(self) -> list[ShardData]:
        """Every ps task's shard as at :attr:`step`."""
        return [self.read_shard(k) for k in range(self.num_shards)]


def chain_of(base: Manifest, deltas: Sequence[Manifest], until: int | None = None) -> Chain:
    """``base`` and the deltas that follow it one after the other (up to step ``until``), each verified.

    A delta that is corrupt, or whose shards are not the base's count, ends
    the chain before it, with a logged warning; so does a gap (no committed
    delta follows the last one, but a later one exists).
    """
    by_parent = {m.parent: m for m in deltas if m.step > base.step}
    chain: list[Manifest] = []
    step = base.step
    while step in by_parent and (until is None or by_parent[step].step <= until):
        delta = by_parent[step]
        if delta.num_shards != base.num_shards:
            logger.warning(
                "delta checkpoint %s has %d shards, its chain %d: the chain stops at step %d",
                delta.folder,
                delta.num_shards,
                base.num_shards,
                step,
            )
            break
        try:
            files.verify(delta)
        except CheckpointCorruptError as e:
            logger.warning("delta checkpoint %s is corrupt, the chain stops at step %d: %s", delta.folder, step, e)
            break
        chain.append(delta)
        step = delta.step
    later = [m.step for m in deltas if m.step > step and m not in chain and (until is None or m.step <= until)]
    if later and not any(m.parent == step for m in deltas if m.step in later):
        logger.warning(
            "the deltas after step %d in %s do not follow it (steps %s): the chain stops at step %d",
            step,
            base.url,
            later,
            step,
        )
    return Chain(base, tuple(chain))


def latest_chain(url: str) -> Chain | None:
    """The newest valid full checkpoint under ``url`` and the valid deltas that follow it; None if none."""
    base = files.latest_valid(url)
    if base is None:
        return None
    return chain_of(base, files.list_checkpoints(url, deltas=True))


def chain_at(url: str, step: int) -> Chain:
    """The chain that ends at checkpoint ``step`` (a full checkpoint, or a delta on one).

    Raises:
        CheckpointError: no committed checkpoint of ``step``, or no valid chain reaches it.
    """
    fulls = files.list_checkpoints(url)
    deltas = files.list_checkpoints(url, deltas=True)
    for manifest in fulls:
        if manifest.step == step:
            return Chain(manifest)
    if not any(m.step == step for m in deltas):
        raise CheckpointError(f"no committed checkpoint of step {step} in {url}")
    for base in reversed([m for m in fulls if m.step < step]):
        chain = chain_of(base, deltas, until=step)
        if chain.step == step:
            files.verify(base)
            return chain
    raise CheckpointError(
        f"the delta checkpoint of step {step} in {url} does not follow a valid full checkpoint "
        f"through valid deltas: a delta before it is missing or corrupt"
    )

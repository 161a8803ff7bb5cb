"""The shard record: what one ps task saves of a checkpoint, as typed dataclasses.

A :class:`ShardData` holds a ps task's global step, optimizer, sync settings
and the parts of variables it holds (:class:`VariableData`). On disk it is a
plain dict of builtins and tensors, so ``torch.load(weights_only=True)`` reads
it back without unpickling any code. Its keys are the dataclasses' field
names, nested the same way, plus ``format_version``::

    {"format_version": 5, "global_step": int, "ps_task": int, "num_shards": int,
     "optimizer": {"name": "Adam", "kwargs": {"lr": 0.001}, "schedule": None or {...},
                   "schedule_state": None or {...}},
     "table_optimizer": None or {"name": "SparseAdam", "kwargs": {...}, "schedule": ..., "schedule_state": ...},
     "sync": None or {"replicas_to_aggregate": int, "total_num_replicas": int,
                      "timeout_seconds": float, "fraction_to_aggregate": float, "async_tables": [str]},
     "variables": [{"name": "emb.weight/part_1", "variable": "emb.weight",
                    "dtype": "float32", "shape": [r, c], "full_shape": [R, c],
                    "row_start": int, "part_index": int, "num_parts": int,
                    "value": Tensor, "state": {"step": Tensor, "exp_avg": Tensor},
                    "row_stride": int, "table": bool, "dynamic": None or {...}}],
     "pushes": None or {"last_push": [int, ...], "applied_steps": [int, ...]}}

``state`` is the variable's optimizer per-parameter state: a tensor shaped
like ``value`` is element-wise state, one of shape ``[r]`` (a table's) one
value per row (row-wise Adagrad's), anything else is per-parameter scalar
state. ``row_stride`` (0 or 1: contiguous rows) and ``table`` are those of
``pb.VariableDef``: an embedding table shared out by id modulo its parts
holds every ``row_stride``-th row. A dynamic table's part has ``dynamic``:
``{"spec": {...the fields of pb.DynamicTableDef}, "ids": Tensor, "updated":
Tensor, "updates": Tensor, "clock": int, "seen": Tensor, "counts": {...}, "admission":
{...}}``; its ``value`` holds the rows of
``ids`` (``shape`` ``[len(ids), ...]``, ``full_shape`` ``[0, ...]``), ``state``
their optimizer state, ``updated``/``updates`` their ages, ``seen`` (float64
seconds of wall-clock time; absent in files written before it) when each was
last looked up or updated, for ``ttl_seconds`` eviction, ``counts`` the
ids the part ``admitted``, ``filtered`` and ``evicted`` (ints), and
``admission`` the admission filter's ``counts`` (uint8) and ``random``
(a generator's state), those in use; the last three are absent in older
files (see :class:`psframe.tables.dynamic_rows.DynamicRows`). ``pushes`` holds, by worker, the
last push the ps task had applied and the steps it applied, at the instant
of the values (:mod:`psframe.ps.protocol.ledger`). An optimizer's ``schedule`` is its
learning-rate schedule (:meth:`psframe.optim.lr_scheduler.ScheduleSpec.to_dict`) and
``schedule_state`` where the schedule stood (:meth:`psframe.optim.schedule_clock.ScheduleClock.state_dict`),
both builtins. Format 5 differs only in having no schedules, format 4 also in having no
``pushes``, format 3 also in having no dynamic tables, format 2 also in having no tables at all (nor
``table_optimizer``, ``row_stride``, ``table``), format 1 also in naming the
sync deadline ``timeout``; all are still read. :mod:`psframe.checkpoint.files` stores shards;
:mod:`psframe.checkpoint.slices` rebuilds variables from their parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from psframe.errors import CheckpointError

FORMAT_VERSION = 6
# Every format this version reads; each step up is converted on reading.
READABLE_FORMATS = (1, 2, 3, 4, 5, 6)
# The format of delta checkpoints' shards and manifests (psframe.checkpoint.deltas), and those read.
DELTA_FORMAT_VERSION = 1
DELTA_FORMATS = (1,)
# Format 1 named these fields otherwise (old key -> field), in the sync dict.
_FORMAT_1_SYNC_KEYS = {"timeout": "timeout_seconds"}


@dataclass(frozen=True)
class OptimizerData:
    """The ``torch.optim`` optimizer a shard was trained with: class name and kwargs, and its
    learning-rate schedule and where it stood (builtins; absent from earlier shards: None)."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    schedule: Mapping[str, Any] | None = None
    schedule_state: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SyncData:
    """Synchronous-training settings of the ps task (absent when training is asynchronous)."""

    replicas_to_aggregate: int  # 0 in an elastic cluster with a fraction
    total_num_replicas: int  # 0 in an elastic cluster: the live workers
    timeout_seconds: float
    fraction_to_aggregate: float = 0.0  # elastic clusters (absent from earlier shards: 0)
    async_tables: tuple[str, ...] = ()  # tables applied at once (absent from earlier shards: none)

    def __post_init__(self) -> None:
        _as_tuple(self, "async_tables")  # read back as a list


@dataclass(frozen=True, eq=False)
class VariableData:
    """One stored part of a model parameter: rows ``[row_start, row_start + shape[0])``.

    ``dtype`` is the tensor's dtype by name (``"float32"``, ``"bfloat16"``), as
    on the wire; a 0-d variable has ``shape == full_shape == ()``. Shapes given
    as lists or ``torch.Size`` are kept as tuples.
    """

    name: str
    variable: str
    dtype: str
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    row_start: int
    part_index: int
    num_parts: int
    value: torch.Tensor
    state: Mapping[str, Any] = field(default_factory=dict)
    row_stride: int = 0  # 0 or 1: rows row_start, row_start + 1, ...
    table: bool = False  # an embedding table's part
    dynamic: Mapping[str, Any] | None = None  # a dynamic table's part: spec, ids, ages (see the module)

    def __post_init__(self) -> None:
        for name in ("shape", "full_shape"):
            _as_tuple(self, name)


@dataclass(frozen=True, eq=False)
class ShardData:
    """What ps task ``ps_task`` of ``num_shards`` saves of one checkpoint.

    Build one and hand it to :func:`psframe.checkpoint.files.write_shard`;
    :func:`~psframe.checkpoint.files.read_shard` gives one back. A list of
    variables is kept as a tuple.
    """

    global_step: int
    ps_task: int
    num_shards: int
    optimizer: OptimizerData
    sync: SyncData | None
    variables: tuple[VariableData, ...]
    table_optimizer: OptimizerData | None = None  # the embedding tables' (None: no table)
    # Each worker's last push applied and steps applied, at the same instant as the
    # values ({"last_push": [int], "applied_steps": [int]}, see psframe.ps.protocol.ledger), and
    # what those pushes consumed of data sets read in ranges ("data:<name>": [int],
    # see psframe.ps.protocol.data_ranges).
    pushes: Mapping[str, list[int]] | None = None

    def __post_init__(self) -> None:
        _as_tuple(self, "variables")

    def to_dict(self, *, compact: bool = True) -> dict:
        """The plain dict ``torch.save`` writes for this shard.

        Tensors come out detached, on the CPU and ``compact``: a view keeps its
        rows, not its whole storage (a copy, which ``torch.save`` needs; a
        message that sends a tensor's own bytes does not, ``compact=False``).
        The record itself is left as it is.

        Returns:
            The dict of the module docstring, in the current format.

        Raises:
            CheckpointError: a field has the wrong type, a shape disagrees
                with its tensor, rows do not fit, a variable is named twice,
                or a value would not load back with ``weights_only=True``.
        """
        _check_shard(self)
        return {
            "format_version": FORMAT_VERSION,
            **_fields_of(self),
            "optimizer": {**_fields_of(self.optimizer), "kwargs": dict(self.optimizer.kwargs)},
            "sync": None
            if self.sync is None
            else {**_fields_of(self.sync), "async_tables": list(self.sync.async_tables)},
            "variables": [_variable_to_dict(v, compact) for v in self.variables],
            "table_optimizer": None
            if self.table_optimizer is None
            else {**_fields_of(self.table_optimizer), "kwargs": dict(self.table_optimizer.kwargs)},
            "pushes": None if self.pushes is None else {k: [int(x) for x in v] for k, v in self.pushes.items()},
        }

    @classmethod
    def from_dict(cls, obj: Any) -> ShardData:
        """The shard a loaded dict holds, checked as :meth:`to_dict` checks it.

        Tensors are taken as they are, not copied. Format 1 is read too.

        Raises:
            CheckpointError: the dict is in a format this psframe does not
                read, lacks keys or has unknown ones, or fails a check of
                :meth:`to_dict`.
        """
        raw = _raw_fields(cls, _in_current_format(obj), "shard")
        sync, variables, table_optimizer = raw["sync"], raw["variables"], raw["table_optimizer"]
        if not isinstance(variables, (list, tuple)):
            raise CheckpointError(f"variables must be a list of dicts, got {type(variables).__name__}")
        shard = cls(
            **{
                **raw,
                "optimizer": OptimizerData(**_raw_fields(OptimizerData, raw["optimizer"], "optimizer")),
                "table_optimizer": None
                if table_optimizer is None
                else OptimizerData(**_raw_fields(OptimizerData, table_optimizer, "table_optimizer")),
                "sync": None if sync is None else SyncData(**_raw_fields(SyncData, sync, "sync")),
                "variables": [
                    VariableData(**_raw_fields(VariableData, v, _label(i, v))) for i, v in enumerate(variables)
                ],
            }
        )
        _check_shard(shard)
        return shard


# ---- checks


def _check_shard(shard: ShardData) -> None:
    """Check every field of ``shard``, as :meth:`ShardData.to_dict` does.

    Raises:
        CheckpointError: naming the field, what it should be and what it is.
    """
    if not isinstance(shard, ShardData):
        raise CheckpointError(f"a shard must be a ShardData, got {type(shard).__name__}")
    if not _is_int(shard.global_step):
        raise CheckpointError(f"global_step must be an int, got {shard.global_step!r}")
    if not (_is_int(shard.num_shards) and shard.num_shards >= 1):
        raise CheckpointError(f"num_shards ({shard.num_shards!r}) must be an int >= 1")
    if not (_is_int(shard.ps_task) and 0 <= shard.ps_task < shard.num_shards):
        raise CheckpointError(f"ps_task ({shard.ps_task!r}) must be in 0..{shard.num_shards - 1}")
    _check_optimizer(shard.optimizer)
    if shard.table_optimizer is not None:
        _check_optimizer(shard.table_optimizer)
    _check_sync(shard.sync)
    if not isinstance(shard.variables, tuple):
        raise CheckpointError(f"variables must be a list of VariableData, got {type(shard.variables).__name__}")
    for i, var in enumerate(shard.variables):
        _check_variable(var, i)
    names = [v.name for v in shard.variables]
    if len(set(names)) != len(names):
        raise CheckpointError(f"shard of ps task {shard.ps_task} names a variable twice: {names}")
    _check_pushes(shard.pushes)


DATA_KEYS = ("data:", "stream:", "stream-applied:")  # a record of pushes' keys of data read, beside the counts


def _check_pushes(pushes: Any) -> None:
    if pushes is None:
        return
    if (
        not isinstance(pushes, Mapping)
        or {k for k in pushes if not str(k).startswith(DATA_KEYS)} != {"last_push", "applied_steps"}
        or not all(isinstance(v, (list, tuple)) and all(_is_int(x) and x >= 0 for x in v) for v in pushes.values())
    ):
        raise CheckpointError(
            f"pushes must be None or {{'last_push': [int >= 0], 'applied_steps': [int >= 0]}} "
            f"(and 'data:<name>': [int >= 0] for each data set read in ranges, 'stream:<name>': [int >= 0] "
            f"for each stream), got {pushes!r}"
        )


def _check_optimizer(optimizer: Any) -> None:
    if (
        not isinstance(optimizer, OptimizerData)
        or not isinstance(optimizer.name, str)
        or not isinstance(optimizer.kwargs, Mapping)
    ):
        raise CheckpointError(f"optimizer must be {{'name': str, 'kwargs': dict}}, got {optimizer!r}")
    _check_plain(dict(optimizer.kwargs), "optimizer kwargs")
    for key in ("schedule", "schedule_state"):
        value = getattr(optimizer, key)
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"optimizer {key} must be None or a dict, got {value!r}")
        _check_plain(value, f"optimizer {key}")


def _check_sync(sync: Any) -> None:
    if sync is None:
        return
    if not isinstance(sync, SyncData):
        raise CheckpointError(f"sync must be None or a SyncData, got {sync!r}")
    timeout = sync.timeout_seconds
    if not (
        _is_int(sync.replicas_to_aggregate)
        and _is_int(sync.total_num_replicas)
        and (_is_int(timeout) or isinstance(timeout, float))
        and (_is_int(sync.fraction_to_aggregate) or isinstance(sync.fraction_to_aggregate, float))
        and isinstance(sync.async_tables, (list, tuple))
        and all(isinstance(t, str) for t in sync.async_tables)
    ):
        raise CheckpointError(
            f"sync must hold two int replica counts, a number of timeout seconds, a fraction and a list of "
            f"table names, got {sync!r}"
        )


def _check_variable(var: Any, index: int) -> None:
    if not isinstance(var, VariableData):
        raise CheckpointError(f"variables[{index}] must be a VariableData, got {type(var).__name__}")
    label = _label(index, var)
    if not isinstance(var.value, torch.Tensor):
        raise CheckpointError(f"{label}: value must be a tensor, got {type(var.value).__name__}")
    for key in ("name", "variable", "dtype"):
        if not isinstance(getattr(var, key), str):
            raise CheckpointError(f"{label}: {key} must be a str, got {getattr(var, key)!r}")
    if not isinstance(var.table, bool):
        raise CheckpointError(f"{label}: table must be a bool, got {var.table!r}")
    for key in ("row_start", "part_index", "num_parts", "row_stride"):
        if not _is_int(getattr(var, key)):
            raise CheckpointError(f"{label}: {key} must be an int, got {getattr(var, key)!r}")
    shape, full_shape = _shape(var.shape, label), _shape(var.full_shape, label)
    if shape != list(var.value.shape):
        raise CheckpointError(f"{label}: shape {shape} but value has shape {list(var.value.shape)}")
    if var.dtype != _dtype_name(var.value.dtype):
        raise CheckpointError(f"{label}: dtype {var.dtype!r} but value is {_dtype_name(var.value.dtype)!r}")
    if var.dynamic is not None:
        _check_dynamic(var, label, shape, full_shape)
        return _check_state(var, label)
    stride = max(1, var.row_stride)
    rows_ok = (shape == full_shape == [] and var.row_start == 0) or (
        len(shape) == len(full_shape) >= 1
        and shape[1:] == full_shape[1:]
        and var.row_stride >= 0
        and 0 <= var.row_start
        and var.row_start + (shape[0] - 1) * stride < full_shape[0]
    )
    if not rows_ok:
        raise CheckpointError(
            f"{label}: shape {shape} at row_start {var.row_start} does not fit in full_shape {full_shape}"
        )
    _check_state(var, label)


def _check_dynamic(var: VariableData, label: str, shape: list[int], full_shape: list[int]) -> None:
    held = var.dynamic
    keys, optional = {"spec", "ids", "updated", "updates", "clock"}, {"seen", "counts", "admission"}
    if not isinstance(held, Mapping) or not keys <= set(held) <= keys | optional:
        raise CheckpointError(
            f"{label}: dynamic must be a dict of {sorted(keys)} (and {sorted(optional)}), got {held!r}"
        )
    _check_plain(dict(held["spec"]) if isinstance(held["spec"], Mapping) else held["spec"], f"{label} dynamic spec")
    if not (len(shape) >= 1 and full_shape == [0, *shape[1:]]):
        raise CheckpointError(
            f"{label}: a dynamic table part of shape {shape} needs full_shape {[0, *shape[1:]]}, got {full_shape}"
        )
    for key in ("ids", "updated", "updates"):
        x = held[key]
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.int64 and list(x.shape) == shape[:1]):
            raise CheckpointError(f"{label}: dynamic {key} must be an int64 tensor of shape {shape[:1]}")
    if not _is_int(held["clock"]):
        raise CheckpointError(f"{label}: dynamic clock must be an int, got {held['clock']!r}")
    seen = held.get("seen")
    if seen is not None and not (
        isinstance(seen, torch.Tensor) and seen.dtype == torch.float64 and list(seen.shape) == shape[:1]
    ):
        raise CheckpointError(f"{label}: dynamic seen must be a float64 tensor of shape {shape[:1]}")
    counts = held.get("counts")
    if counts is not None and not (
        isinstance(counts, Mapping) and all(isinstance(k, str) and _is_int(v) and v >= 0 for k, v in counts.items())
    ):
        raise CheckpointError(f"{label}: dynamic counts must be a dict of counts by name, got {counts!r}")
    admission = held.get("admission")
    if admission is not None and not (
        isinstance(admission, Mapping)
        and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in admission.values())
    ):
        raise CheckpointError(f"{label}: dynamic admission must be a dict of uint8 tensors, got {admission!r}")


def _check_state(var: VariableData, label: str) -> None:
    if not isinstance(var.state, Mapping):
        raise CheckpointError(f"{label}: state must be a dict, got {type(var.state).__name__}")
    for key, x in var.state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{label}: state keys must be str, got {key!r}")
        if not isinstance(x, torch.Tensor):
            _check_plain(x, f"{label} state {key!r}")


def _check_plain(obj: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would not load back."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            _check_plain(x, where)
        return
    if isinstance(obj, dict):
        for k, x in obj.items():
            _check_plain(k, where)
            _check_plain(x, where)
        return
    raise CheckpointError(
        f"{where}: {type(obj).__name__} values cannot be checkpointed; "
        f"use tensors, numbers, strings, lists, tuples or dicts"
    )


def _shape(shape: Any, label: str) -> list[int]:
    if not isinstance(shape, (list, tuple, torch.Size)) or not all(_is_int(n) and n >= 0 for n in shape):
        raise CheckpointError(f"{label}: shapes must be lists of ints >= 0, got {shape!r}")
    return [int(n) for n in shape]


# ---- conversions


def _in_current_format(obj: Any) -> dict[str, Any]:
    """A loaded shard dict's entries as the current format names them, less
    its format_version."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"a shard must be a dict, got {type(obj).__name__}")
    if "format_version" not in obj:
        raise CheckpointError(f"a shard dict needs a format_version; this one has keys {list(obj)}")
    version = obj["format_version"]
    if version not in READABLE_FORMATS:
        raise CheckpointError(
            f"it is in checkpoint format {version!r}; this psframe reads formats {list(READABLE_FORMATS)}"
        )
    body = {k: x for k, x in obj.items() if k != "format_version"}
    if version == 1 and isinstance(body.get("sync"), Mapping):
        body["sync"] = {_FORMAT_1_SYNC_KEYS.get(k, k): x for k, x in body["sync"].items()}
    if version < 3:  # no embedding tables then
        body.setdefault("table_optimizer", None)
        if isinstance(body.get("variables"), (list, tuple)):
            body["variables"] = [
                {"row_stride": 0, "table": False, **v} if isinstance(v, Mapping) else v for v in body["variables"]
            ]
    if version < 5:  # no record of the workers' pushes then
        body.setdefault("pushes", None)
    if version < 4 and isinstance(body.get("variables"), (list, tuple)):  # no dynamic tables then
        body["variables"] = [{"dynamic": None, **v} if isinstance(v, Mapping) else v for v in body["variables"]]
    return body


def _raw_fields(cls: type, obj: Any, label: str) -> dict[str, Any]:
    """The values of ``cls``'s fields in ``obj``, a dict with exactly those keys (a field
    with a default, added since, may be absent)."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{label} must be a dict, got {type(obj).__name__}")
    names = [f.name for f in fields(cls)]
    missing = [f.name for f in fields(cls) if f.name not in obj and f.default is MISSING]
    if missing:
        raise CheckpointError(f"{label} lacks keys {missing}; it needs {names}")
    unknown = [k for k in obj if k not in names]
    if unknown:
        raise CheckpointError(f"{label} has unknown keys {unknown}; it takes {names}")
    return {n: obj[n] for n in names if n in obj}


def _fields_of(record: Any) -> dict[str, Any]:
    """A dataclass's fields by name, shallow (``dataclasses.asdict`` would
    deep-copy every tensor)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def _variable_to_dict(var: VariableData, compact: bool = True) -> dict:
    def out(x: Any) -> Any:
        return _portable(x, compact) if isinstance(x, torch.Tensor) else x

    return {
        **_fields_of(var),
        "shape": list(var.shape),
        "full_shape": list(var.full_shape),
        "value": out(var.value),
        "state": {k: out(x) for k, x in var.state.items()},
        "dynamic": None if var.dynamic is None else {k: out(x) for k, x in var.dynamic.items()},
    }


def _portable(t: torch.Tensor, compact: bool = True) -> torch.Tensor:
    """Detached, on the CPU, and (``compact``) owning exactly its own bytes
    (torch.save writes a view's whole storage otherwise)."""
    t = t.detach().cpu()
    if t.layout != torch.strided or not compact:
        return t
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _as_tuple(record: Any, name: str) -> None:
    """Store a list (or torch.Size) field of a frozen record as a tuple; other
    values are left for the checks to report."""
    value = getattr(record, name)
    if isinstance(value, list) or type(value) is torch.Size:
        object.__setattr__(record, name, tuple(value))


def _label(index: int, var: Any) -> str:
    """How messages name ``variables[index]``, with its name where it has one."""
    name = var.get("name", "?") if isinstance(var, Mapping) else getattr(var, "name", "?")
    return f"variables[{index}] ({name!r})"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

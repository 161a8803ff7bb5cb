"""What a task says of itself when asked (``psframe status``, ``psframe ping``, ``control_calls.get_info``).

Plain, frozen dataclasses: a caller reads names and Python values, never the
wire's messages (:func:`psframe.wire.messages.task_status` converts them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: psframe.optim loads torch, and reading a status needs none
    from psframe.optim import OptimizerSpec, SyncReplicas


class TaskState(enum.Enum):
    """Where a task stands."""

    STARTING = "starting"
    WAITING_FOR_MODEL = "waiting_for_model"  # a ps task whose variables the chief has not created yet
    READY = "ready"
    FINISHED = "finished"  # every worker finished; the task is exiting


@dataclass(frozen=True, slots=True)
class VariableStatus:
    """One variable (or part of one) a ps task holds."""

    name: str  # stored name: "fc1.weight", or "emb.weight/part_1"
    dtype: str  # "float32", ...
    shape: tuple[int, ...]  # of what this task holds
    variable: str = ""  # the model's parameter it belongs to
    table: bool = False  # an embedding table's part: pushed and pulled by rows
    dynamic: bool = False  # a dynamic table's part: its rows are made on first touch

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        """What two tasks holding the same variable agree on: name, dtype and shape."""
        return (self.name, self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as a ps task saw it."""

    task_index: int
    seconds_ago: float | None  # since it was last heard from; None: never
    finished: bool
    applied_steps: int  # its steps whose gradients this ps task applied (each once)
    last_push_id: int  # the number of its last push applied


@dataclass(frozen=True, slots=True)
class DynamicTableStatus:
    """A dynamic table's part on a ps task: the rows it holds, and what became of new ids so far."""

    name: str  # stored name: "emb/part_1"
    rows: int  # held now
    admitted: int  # ids given a row
    filtered: int  # ids refused a row by the table's admission (counted at each lookup)
    evicted: int  # rows evicted: by cap, age, time or norm
    rows_on_disk: int = 0  # of rows: those beyond the table's ram_budget, on local disk


@dataclass(frozen=True, slots=True)
class DataSetStatus:
    """A data set read in ranges (:class:`psframe.DataRanges`), as ps 0 keeps its queue."""

    name: str
    consumed: int  # examples consumed, over all epochs
    total: int  # examples in all its epochs
    ranges_out: int  # ranges handed out and not yet consumed


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """A stream as one ps task knows it (:meth:`psframe.Trainer.stream`): how far the task's updates
    of each partition reached (0: none yet), and on ps 0 the worker reading each (-1: none)."""

    name: str
    applied: tuple[int, ...]
    readers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """A worker that joined, left or was presumed dead, as a ps task saw it (elastic clusters)."""

    worker: int
    kind: str  # "joined", "left", "presumed_dead" or "returned"
    global_step: int  # the step it takes effect at
    seconds_ago: float


@dataclass(frozen=True, slots=True)
class TaskStatus:
    """A task's answer to "who are you, and how are you?".

    The counters (``global_step``, ``applied_steps``...) are a ps task's; a worker's
    task answers who it is and its state only.
    """

    job_name: str
    task_index: int
    address: str
    cluster_spec: str  # ClusterSpec.to_string()
    cluster_fingerprint: str
    state: TaskState
    version: str  # of psframe
    pid: int
    global_step: int = 0
    variables: tuple[VariableStatus, ...] = ()
    bytes_held: int = 0  # variables and optimizer state
    optimizer: OptimizerSpec | None = None  # None: no model yet
    table_optimizer: OptimizerSpec | None = None  # None: no embedding table
    sync: SyncReplicas | None = None  # None: asynchronous training (or no model yet)
    # a ps task's workers' steps whose gradients it applied, each once (the workers' applied_steps added):
    # asynchronous training, its global step; synchronous, each round's members (R a round)
    applied_steps: int = 0
    rejected_pushes: int = 0  # pushes refused as invalid
    dropped_gradients: int = 0  # stale or late gradients dropped (sync)
    finished_workers: tuple[int, ...] = ()
    workers: tuple[WorkerStatus, ...] = ()
    restored_step: int | None = None  # the checkpoint step it restored from; None: none
    checkpoint_dir: str | None = None  # where it restores from (and saves to)
    dynamic_tables: tuple[DynamicTableStatus, ...] = ()  # a ps task's dynamic tables' parts
    # async: how many step-ending pushes found their worker 0, 1, ... steps ahead of the slowest
    # live worker (the last: that many or more; psframe.ps.protocol.staleness); empty: none counted
    steps_ahead_counts: tuple[int, ...] = ()
    max_workers: int | None = None  # a ps task's worker slots, if workers may join; None: fixed
    layout_version: int = 0  # a ps task's layouts gone through (one per stage of a re-layout)
    relayouts: int = 0  # a ps task's re-layouts gone through to their end (ps tasks added or drained live)
    move_stage: tuple[int, int] | None = None  # the stage of a re-layout under way, and of how many
    reshard_to: str = ""  # a ps task's re-layout asked for or taken: the cluster (ClusterSpec.to_string)
    membership: tuple[MembershipEvent, ...] = ()  # who joined and left, oldest first
    data_sets: tuple[DataSetStatus, ...] = ()  # ps 0: data sets read in ranges
    streams: tuple[StreamStatus, ...] = ()  # ps: streams read by partition

    @property
    def name(self) -> str:
        """``/job:ps/task:0``."""
        return f"/job:{self.job_name}/task:{self.task_index}"

from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes", "kind")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VALUE: _ClassVar[TensorMeta.Kind]
        ROW_IDS: _ClassVar[TensorMeta.Kind]
        ROWS: _ClassVar[TensorMeta.Kind]
        PULL_ROW_IDS: _ClassVar[TensorMeta.Kind]
        PEEK_ROW_IDS: _ClassVar[TensorMeta.Kind]
    VALUE: TensorMeta.Kind
    ROW_IDS: TensorMeta.Kind
    ROWS: TensorMeta.Kind
    PULL_ROW_IDS: TensorMeta.Kind
    PEEK_ROW_IDS: TensorMeta.Kind
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    kind: TensorMeta.Kind
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., kind: _Optional[_Union[TensorMeta.Kind, str]] = ...) -> None: ...

class VariableDef(_message.Message):
    __slots__ = ("name", "variable", "dtype", "shape", "full_shape", "row_start", "part_index", "num_parts", "row_stride", "table", "dynamic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    variable: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    row_start: int
    part_index: int
    num_parts: int
    row_stride: int
    table: bool
    dynamic: DynamicTableDef
    def __init__(self, name: _Optional[str] = ..., variable: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., full_shape: _Optional[_Iterable[int]] = ..., row_start: _Optional[int] = ..., part_index: _Optional[int] = ..., num_parts: _Optional[int] = ..., row_stride: _Optional[int] = ..., table: _Optional[bool] = ..., dynamic: _Optional[_Union[DynamicTableDef, _Mapping]] = ...) -> None: ...

class DynamicTableDef(_message.Message):
    __slots__ = ("distribution", "mean", "std", "low", "high", "value", "seed", "max_rows", "policy", "max_age", "ttl_seconds", "min_norm", "admit_after", "admit_probability", "admission_counters", "row_storage", "ram_budget")
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_NORM_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    ROW_STORAGE_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    distribution: str
    mean: float
    std: float
    low: float
    high: float
    value: float
    seed: int
    max_rows: int
    policy: str
    max_age: int
    ttl_seconds: float
    min_norm: float
    admit_after: int
    admit_probability: float
    admission_counters: int
    row_storage: str
    ram_budget: int
    def __init__(self, distribution: _Optional[str] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., low: _Optional[float] = ..., high: _Optional[float] = ..., value: _Optional[float] = ..., seed: _Optional[int] = ..., max_rows: _Optional[int] = ..., policy: _Optional[str] = ..., max_age: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., min_norm: _Optional[float] = ..., admit_after: _Optional[int] = ..., admit_probability: _Optional[float] = ..., admission_counters: _Optional[int] = ..., row_storage: _Optional[str] = ..., ram_budget: _Optional[int] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("number", "integer", "flag", "text", "numbers", "integers")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    FLAG_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUMBERS_FIELD_NUMBER: _ClassVar[int]
    INTEGERS_FIELD_NUMBER: _ClassVar[int]
    number: float
    integer: int
    flag: bool
    text: str
    numbers: NumberList
    integers: IntegerList
    def __init__(self, number: _Optional[float] = ..., integer: _Optional[int] = ..., flag: _Optional[bool] = ..., text: _Optional[str] = ..., numbers: _Optional[_Union[NumberList, _Mapping]] = ..., integers: _Optional[_Union[IntegerList, _Mapping]] = ...) -> None: ...

class NumberList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class IntegerList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class OptimizerDef(_message.Message):
    __slots__ = ("name", "kwargs", "schedule")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs: _containers.MessageMap[str, Value]
    schedule: ScheduleDef
    def __init__(self, name: _Optional[str] = ..., kwargs: _Optional[_Mapping[str, Value]] = ..., schedule: _Optional[_Union[ScheduleDef, _Mapping]] = ...) -> None: ...

class ScheduleDef(_message.Message):
    __slots__ = ("name", "kwargs", "schedulers", "function", "function_args", "function_kwargs")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    class FunctionKwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_ARGS_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_KWARGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kwargs: _containers.MessageMap[str, Value]
    schedulers: _containers.RepeatedCompositeFieldContainer[ScheduleDef]
    function: str
    function_args: _containers.RepeatedCompositeFieldContainer[Value]
    function_kwargs: _containers.MessageMap[str, Value]
    def __init__(self, name: _Optional[str] = ..., kwargs: _Optional[_Mapping[str, Value]] = ..., schedulers: _Optional[_Iterable[_Union[ScheduleDef, _Mapping]]] = ..., function: _Optional[str] = ..., function_args: _Optional[_Iterable[_Union[Value, _Mapping]]] = ..., function_kwargs: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class SyncDef(_message.Message):
    __slots__ = ("replicas_to_aggregate", "total_num_replicas", "timeout_seconds", "fraction_to_aggregate", "async_tables")
    REPLICAS_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FRACTION_TO_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_TABLES_FIELD_NUMBER: _ClassVar[int]
    replicas_to_aggregate: int
    total_num_replicas: int
    timeout_seconds: float
    fraction_to_aggregate: float
    async_tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replicas_to_aggregate: _Optional[int] = ..., total_num_replicas: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., fraction_to_aggregate: _Optional[float] = ..., async_tables: _Optional[_Iterable[str]] = ...) -> None: ...

class Caller(_message.Message):
    __slots__ = ("job_name", "task_index", "cluster_fingerprint", "ps_fingerprint", "layout_version")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    task_index: int
    cluster_fingerprint: str
    ps_fingerprint: str
    layout_version: int
    def __init__(self, job_name: _Optional[str] = ..., task_index: _Optional[int] = ..., cluster_fingerprint: _Optional[str] = ..., ps_fingerprint: _Optional[str] = ..., layout_version: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("caller", "joining")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    joining: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., joining: _Optional[bool] = ...) -> None: ...

class DataRangeRequest(_message.Message):
    __slots__ = ("caller", "name", "num_examples", "range_size", "epochs")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    RANGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    name: str
    num_examples: int
    range_size: int
    epochs: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., name: _Optional[str] = ..., num_examples: _Optional[int] = ..., range_size: _Optional[int] = ..., epochs: _Optional[int] = ...) -> None: ...

class DataRangeReply(_message.Message):
    __slots__ = ("lease", "epoch", "start", "end", "offset", "exhausted", "retry_after", "consumed", "total")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    lease: int
    epoch: int
    start: int
    end: int
    offset: int
    exhausted: bool
    retry_after: float
    consumed: int
    total: int
    def __init__(self, lease: _Optional[int] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., offset: _Optional[int] = ..., exhausted: _Optional[bool] = ..., retry_after: _Optional[float] = ..., consumed: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class StreamPartitionsRequest(_message.Message):
    __slots__ = ("caller", "name", "partitions", "given_back", "leaving")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    GIVEN_BACK_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    name: str
    partitions: int
    given_back: _containers.RepeatedScalarFieldContainer[int]
    leaving: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., name: _Optional[str] = ..., partitions: _Optional[int] = ..., given_back: _Optional[_Iterable[int]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class StreamLease(_message.Message):
    __slots__ = ("lease", "partition", "give_back")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_FIELD_NUMBER: _ClassVar[int]
    lease: int
    partition: int
    give_back: bool
    def __init__(self, lease: _Optional[int] = ..., partition: _Optional[int] = ..., give_back: _Optional[bool] = ...) -> None: ...

class StreamPartitionsReply(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[StreamLease]
    def __init__(self, leases: _Optional[_Iterable[_Union[StreamLease, _Mapping]]] = ...) -> None: ...

class StreamOffsetsRequest(_message.Message):
    __slots__ = ("caller", "name")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    name: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class StreamOffsetsReply(_message.Message):
    __slots__ = ("applied",)
    class AppliedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: _containers.ScalarMap[int, int]
    def __init__(self, applied: _Optional[_Mapping[int, int]] = ...) -> None: ...

class DataProgress(_message.Message):
    __slots__ = ("name", "lease", "offset", "start", "seen", "partition", "partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    lease: int
    offset: int
    start: int
    seen: int
    partition: int
    partitions: int
    def __init__(self, name: _Optional[str] = ..., lease: _Optional[int] = ..., offset: _Optional[int] = ..., start: _Optional[int] = ..., seen: _Optional[int] = ..., partition: _Optional[int] = ..., partitions: _Optional[int] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("job_name", "task_index", "address", "cluster_spec", "cluster_fingerprint", "state", "global_step", "variables", "bytes_held", "optimizer", "applied_steps", "rejected_pushes", "finished_workers", "version", "pid", "sync", "dropped_gradients", "restored_step", "workers", "checkpoint_dir", "table_optimizer", "dynamic_tables", "steps_ahead_counts", "max_workers", "membership", "data_sets", "reshard_to", "layout_version", "relayouts", "move_stage", "streams")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STARTING: _ClassVar[TaskInfo.State]
        WAITING_FOR_MODEL: _ClassVar[TaskInfo.State]
        READY: _ClassVar[TaskInfo.State]
        FINISHED: _ClassVar[TaskInfo.State]
    STARTING: TaskInfo.State
    WAITING_FOR_MODEL: TaskInfo.State
    READY: TaskInfo.State
    FINISHED: TaskInfo.State
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUSHES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    TABLE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_TABLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_AHEAD_COUNTS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    DATA_SETS_FIELD_NUMBER: _ClassVar[int]
    RESHARD_TO_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAYOUTS_FIELD_NUMBER: _ClassVar[int]
    MOVE_STAGE_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    task_index: int
    address: str
    cluster_spec: str
    cluster_fingerprint: str
    state: TaskInfo.State
    global_step: int
    variables: _containers.RepeatedCompositeFieldContainer[VariableDef]
    bytes_held: int
    optimizer: OptimizerDef
    applied_steps: int
    rejected_pushes: int
    finished_workers: _containers.RepeatedScalarFieldContainer[int]
    version: str
    pid: int
    sync: SyncDef
    dropped_gradients: int
    restored_step: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerSeen]
    checkpoint_dir: str
    table_optimizer: OptimizerDef
    dynamic_tables: _containers.RepeatedCompositeFieldContainer[DynamicTableCounts]
    steps_ahead_counts: _containers.RepeatedScalarFieldContainer[int]
    max_workers: int
    membership: _containers.RepeatedCompositeFieldContainer[MembershipChange]
    data_sets: _containers.RepeatedCompositeFieldContainer[DataSetCounts]
    reshard_to: str
    layout_version: int
    relayouts: int
    move_stage: MoveStage
    streams: _containers.RepeatedCompositeFieldContainer[StreamCounts]
    def __init__(self, job_name: _Optional[str] = ..., task_index: _Optional[int] = ..., address: _Optional[str] = ..., cluster_spec: _Optional[str] = ..., cluster_fingerprint: _Optional[str] = ..., state: _Optional[_Union[TaskInfo.State, str]] = ..., global_step: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[VariableDef, _Mapping]]] = ..., bytes_held: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., applied_steps: _Optional[int] = ..., rejected_pushes: _Optional[int] = ..., finished_workers: _Optional[_Iterable[int]] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., sync: _Optional[_Union[SyncDef, _Mapping]] = ..., dropped_gradients: _Optional[int] = ..., restored_step: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerSeen, _Mapping]]] = ..., checkpoint_dir: _Optional[str] = ..., table_optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., dynamic_tables: _Optional[_Iterable[_Union[DynamicTableCounts, _Mapping]]] = ..., steps_ahead_counts: _Optional[_Iterable[int]] = ..., max_workers: _Optional[int] = ..., membership: _Optional[_Iterable[_Union[MembershipChange, _Mapping]]] = ..., data_sets: _Optional[_Iterable[_Union[DataSetCounts, _Mapping]]] = ..., reshard_to: _Optional[str] = ..., layout_version: _Optional[int] = ..., relayouts: _Optional[int] = ..., move_stage: _Optional[_Union[MoveStage, _Mapping]] = ..., streams: _Optional[_Iterable[_Union[StreamCounts, _Mapping]]] = ...) -> None: ...

class StreamCounts(_message.Message):
    __slots__ = ("name", "applied", "readers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    applied: _containers.RepeatedScalarFieldContainer[int]
    readers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., applied: _Optional[_Iterable[int]] = ..., readers: _Optional[_Iterable[int]] = ...) -> None: ...

class DataSetCounts(_message.Message):
    __slots__ = ("name", "consumed", "total", "ranges_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    RANGES_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    consumed: int
    total: int
    ranges_out: int
    def __init__(self, name: _Optional[str] = ..., consumed: _Optional[int] = ..., total: _Optional[int] = ..., ranges_out: _Optional[int] = ...) -> None: ...

class MembershipChange(_message.Message):
    __slots__ = ("worker", "kind", "global_step", "seconds_ago")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        JOINED: _ClassVar[MembershipChange.Kind]
        LEFT: _ClassVar[MembershipChange.Kind]
        PRESUMED_DEAD: _ClassVar[MembershipChange.Kind]
        RETURNED: _ClassVar[MembershipChange.Kind]
    JOINED: MembershipChange.Kind
    LEFT: MembershipChange.Kind
    PRESUMED_DEAD: MembershipChange.Kind
    RETURNED: MembershipChange.Kind
    WORKER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    worker: int
    kind: MembershipChange.Kind
    global_step: int
    seconds_ago: float
    def __init__(self, worker: _Optional[int] = ..., kind: _Optional[_Union[MembershipChange.Kind, str]] = ..., global_step: _Optional[int] = ..., seconds_ago: _Optional[float] = ...) -> None: ...

class DynamicTableCounts(_message.Message):
    __slots__ = ("name", "rows", "admitted", "filtered", "evicted", "rows_on_disk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ROWS_ON_DISK_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    admitted: int
    filtered: int
    evicted: int
    rows_on_disk: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., admitted: _Optional[int] = ..., filtered: _Optional[int] = ..., evicted: _Optional[int] = ..., rows_on_disk: _Optional[int] = ...) -> None: ...

class WorkerSeen(_message.Message):
    __slots__ = ("task_index", "seconds_ago", "finished", "applied_steps", "last_push_id")
    TASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    task_index: int
    seconds_ago: float
    finished: bool
    applied_steps: int
    last_push_id: int
    def __init__(self, task_index: _Optional[int] = ..., seconds_ago: _Optional[float] = ..., finished: _Optional[bool] = ..., applied_steps: _Optional[int] = ..., last_push_id: _Optional[int] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("caller", "variables", "optimizer", "tensors", "sync", "checkpoint_dir", "table_optimizer", "global_step")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    TABLE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    variables: _containers.RepeatedCompositeFieldContainer[VariableDef]
    optimizer: OptimizerDef
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    sync: SyncDef
    checkpoint_dir: str
    table_optimizer: OptimizerDef
    global_step: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[VariableDef, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., sync: _Optional[_Union[SyncDef, _Mapping]] = ..., checkpoint_dir: _Optional[str] = ..., table_optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., global_step: _Optional[int] = ...) -> None: ...

class InitRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class InitReplyHeader(_message.Message):
    __slots__ = ("state", "created", "global_step", "tensors")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    state: TaskInfo.State
    created: bool
    global_step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, state: _Optional[_Union[TaskInfo.State, str]] = ..., created: _Optional[bool] = ..., global_step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class InitResponse(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: InitReplyHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[InitReplyHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class TakePartsRequest(_message.Message):
    __slots__ = ("caller", "variables", "optimizer", "table_optimizer", "sync", "before", "read_from", "layout_version", "finished_workers", "ledger")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TABLE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    READ_FROM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    variables: _containers.RepeatedCompositeFieldContainer[VariableDef]
    optimizer: OptimizerDef
    table_optimizer: OptimizerDef
    sync: SyncDef
    before: _containers.RepeatedScalarFieldContainer[str]
    read_from: _containers.RepeatedScalarFieldContainer[int]
    layout_version: int
    finished_workers: _containers.RepeatedScalarFieldContainer[int]
    ledger: PushLedger
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[VariableDef, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., table_optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., sync: _Optional[_Union[SyncDef, _Mapping]] = ..., before: _Optional[_Iterable[str]] = ..., read_from: _Optional[_Iterable[int]] = ..., layout_version: _Optional[int] = ..., finished_workers: _Optional[_Iterable[int]] = ..., ledger: _Optional[_Union[PushLedger, _Mapping]] = ...) -> None: ...

class TakePartsReply(_message.Message):
    __slots__ = ("state", "global_step", "last_push_id", "layout_version")
    STATE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: TaskInfo.State
    global_step: int
    last_push_id: int
    layout_version: int
    def __init__(self, state: _Optional[_Union[TaskInfo.State, str]] = ..., global_step: _Optional[int] = ..., last_push_id: _Optional[int] = ..., layout_version: _Optional[int] = ...) -> None: ...

class PushPullHeader(_message.Message):
    __slots__ = ("caller", "step", "tensors", "pull", "end_of_step", "wire_dtype", "same_host", "push_id", "staleness_bound", "staleness_timeout", "progress", "rows_async")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    END_OF_STEP_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    STALENESS_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ROWS_ASYNC_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    pull: _containers.RepeatedScalarFieldContainer[str]
    end_of_step: bool
    wire_dtype: str
    same_host: SameHostRegion
    push_id: int
    staleness_bound: int
    staleness_timeout: float
    progress: DataProgress
    rows_async: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., pull: _Optional[_Iterable[str]] = ..., end_of_step: _Optional[bool] = ..., wire_dtype: _Optional[str] = ..., same_host: _Optional[_Union[SameHostRegion, _Mapping]] = ..., push_id: _Optional[int] = ..., staleness_bound: _Optional[int] = ..., staleness_timeout: _Optional[float] = ..., progress: _Optional[_Union[DataProgress, _Mapping]] = ..., rows_async: _Optional[bool] = ...) -> None: ...

class SameHostRegion(_message.Message):
    __slots__ = ("path", "key", "size", "request_start", "request_length", "reply_start", "in_region")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_START_FIELD_NUMBER: _ClassVar[int]
    REQUEST_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REPLY_START_FIELD_NUMBER: _ClassVar[int]
    IN_REGION_FIELD_NUMBER: _ClassVar[int]
    path: str
    key: bytes
    size: int
    request_start: int
    request_length: int
    reply_start: int
    in_region: bool
    def __init__(self, path: _Optional[str] = ..., key: _Optional[bytes] = ..., size: _Optional[int] = ..., request_start: _Optional[int] = ..., request_length: _Optional[int] = ..., reply_start: _Optional[int] = ..., in_region: _Optional[bool] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PushPullHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[PushPullHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PushPullReplyHeader(_message.Message):
    __slots__ = ("global_step", "tensors", "dropped", "error_class", "error_message", "in_region", "region_refused", "duplicate", "region_unusable", "steps_ahead", "relayout_pending")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IN_REGION_FIELD_NUMBER: _ClassVar[int]
    REGION_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REGION_UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    STEPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RELAYOUT_PENDING_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    dropped: bool
    error_class: str
    error_message: str
    in_region: bool
    region_refused: str
    duplicate: bool
    region_unusable: str
    steps_ahead: int
    relayout_pending: bool
    def __init__(self, global_step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., dropped: _Optional[bool] = ..., error_class: _Optional[str] = ..., error_message: _Optional[str] = ..., in_region: _Optional[bool] = ..., region_refused: _Optional[str] = ..., duplicate: _Optional[bool] = ..., region_unusable: _Optional[str] = ..., steps_ahead: _Optional[int] = ..., relayout_pending: _Optional[bool] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: PushPullReplyHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[PushPullReplyHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class FinishResponse(_message.Message):
    __slots__ = ("finished_workers", "num_workers")
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    finished_workers: int
    num_workers: int
    def __init__(self, finished_workers: _Optional[int] = ..., num_workers: _Optional[int] = ...) -> None: ...

class StepMembersRequest(_message.Message):
    __slots__ = ("caller", "step")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    step: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., step: _Optional[int] = ...) -> None: ...

class StepMembersReply(_message.Message):
    __slots__ = ("step", "workers")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., workers: _Optional[_Iterable[int]] = ...) -> None: ...

class HoldCutRequest(_message.Message):
    __slots__ = ("caller", "hold_seconds", "for_move")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FOR_MOVE_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    hold_seconds: float
    for_move: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., hold_seconds: _Optional[float] = ..., for_move: _Optional[bool] = ...) -> None: ...

class HoldCutReply(_message.Message):
    __slots__ = ("holds", "steps_begun", "holds_rounds", "round")
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_BEGUN_FIELD_NUMBER: _ClassVar[int]
    HOLDS_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    holds: bool
    steps_begun: _containers.RepeatedScalarFieldContainer[int]
    holds_rounds: bool
    round: int
    def __init__(self, holds: _Optional[bool] = ..., steps_begun: _Optional[_Iterable[int]] = ..., holds_rounds: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class CutPoint(_message.Message):
    __slots__ = ("targets", "rounds", "round_target")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TARGET_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[int]
    rounds: bool
    round_target: int
    def __init__(self, targets: _Optional[_Iterable[int]] = ..., rounds: _Optional[bool] = ..., round_target: _Optional[int] = ...) -> None: ...

class SaveShardRequest(_message.Message):
    __slots__ = ("caller", "checkpoint_dir", "step", "delta", "parent_step", "cut")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PARENT_STEP_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    checkpoint_dir: str
    step: int
    delta: bool
    parent_step: int
    cut: CutPoint
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., checkpoint_dir: _Optional[str] = ..., step: _Optional[int] = ..., delta: _Optional[bool] = ..., parent_step: _Optional[int] = ..., cut: _Optional[_Union[CutPoint, _Mapping]] = ...) -> None: ...

class SaveShardReply(_message.Message):
    __slots__ = ("file", "sha256", "nbytes", "global_step")
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    file: str
    sha256: str
    nbytes: int
    global_step: int
    def __init__(self, file: _Optional[str] = ..., sha256: _Optional[str] = ..., nbytes: _Optional[int] = ..., global_step: _Optional[int] = ...) -> None: ...

class MoveCutRequest(_message.Message):
    __slots__ = ("caller", "cluster_spec", "stage", "cut")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    cluster_spec: str
    stage: MoveStage
    cut: CutPoint
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., cluster_spec: _Optional[str] = ..., stage: _Optional[_Union[MoveStage, _Mapping]] = ..., cut: _Optional[_Union[CutPoint, _Mapping]] = ...) -> None: ...

class MoveCutReply(_message.Message):
    __slots__ = ("global_step", "layout_version", "finished_workers", "ledger")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    layout_version: int
    finished_workers: _containers.RepeatedScalarFieldContainer[int]
    ledger: PushLedger
    def __init__(self, global_step: _Optional[int] = ..., layout_version: _Optional[int] = ..., finished_workers: _Optional[_Iterable[int]] = ..., ledger: _Optional[_Union[PushLedger, _Mapping]] = ...) -> None: ...

class PushLedger(_message.Message):
    __slots__ = ("last_push", "applied_steps")
    LAST_PUSH_FIELD_NUMBER: _ClassVar[int]
    APPLIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    last_push: _containers.RepeatedScalarFieldContainer[int]
    applied_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, last_push: _Optional[_Iterable[int]] = ..., applied_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AskRelayoutRequest(_message.Message):
    __slots__ = ("caller", "cluster_spec")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    cluster_spec: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., cluster_spec: _Optional[str] = ...) -> None: ...

class RelayoutStatusRequest(_message.Message):
    __slots__ = ("caller", "wait_seconds", "after_version")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    wait_seconds: float
    after_version: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., wait_seconds: _Optional[float] = ..., after_version: _Optional[int] = ...) -> None: ...

class RelayoutStatusReply(_message.Message):
    __slots__ = ("cluster_spec", "moved", "layout_version", "before_spec", "stage")
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BEFORE_SPEC_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    cluster_spec: str
    moved: bool
    layout_version: int
    before_spec: str
    stage: MoveStage
    def __init__(self, cluster_spec: _Optional[str] = ..., moved: _Optional[bool] = ..., layout_version: _Optional[int] = ..., before_spec: _Optional[str] = ..., stage: _Optional[_Union[MoveStage, _Mapping]] = ...) -> None: ...

class RelayoutDoneRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class RelayoutDoneReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrecopyRequest(_message.Message):
    __slots__ = ("caller", "variables", "before", "read_from", "optimizer", "table_optimizer", "cluster_spec", "parts")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    READ_FROM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TABLE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SPEC_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    variables: _containers.RepeatedCompositeFieldContainer[VariableDef]
    before: _containers.RepeatedScalarFieldContainer[str]
    read_from: _containers.RepeatedScalarFieldContainer[int]
    optimizer: OptimizerDef
    table_optimizer: OptimizerDef
    cluster_spec: str
    parts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., variables: _Optional[_Iterable[_Union[VariableDef, _Mapping]]] = ..., before: _Optional[_Iterable[str]] = ..., read_from: _Optional[_Iterable[int]] = ..., optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., table_optimizer: _Optional[_Union[OptimizerDef, _Mapping]] = ..., cluster_spec: _Optional[str] = ..., parts: _Optional[_Iterable[str]] = ...) -> None: ...

class PrecopyReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MoveStage(_message.Message):
    __slots__ = ("origin_spec", "target_spec", "stage", "stages")
    ORIGIN_SPEC_FIELD_NUMBER: _ClassVar[int]
    TARGET_SPEC_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    origin_spec: str
    target_spec: str
    stage: int
    stages: int
    def __init__(self, origin_spec: _Optional[str] = ..., target_spec: _Optional[str] = ..., stage: _Optional[int] = ..., stages: _Optional[int] = ...) -> None: ...

class FetchPartsHeader(_message.Message):
    __slots__ = ("caller", "variables", "tensors", "rows", "precopied", "since_mark", "since_version", "same_host")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    SINCE_MARK_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    variables: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    rows: _containers.RepeatedCompositeFieldContainer[RowRange]
    precopied: _containers.RepeatedScalarFieldContainer[str]
    since_mark: int
    since_version: int
    same_host: bool
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., variables: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[RowRange, _Mapping]]] = ..., precopied: _Optional[_Iterable[str]] = ..., since_mark: _Optional[int] = ..., since_version: _Optional[int] = ..., same_host: _Optional[bool] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("variable", "start", "end", "stride", "num_parts", "part_index")
    VARIABLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    variable: str
    start: int
    end: int
    stride: int
    num_parts: int
    part_index: int
    def __init__(self, variable: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., stride: _Optional[int] = ..., num_parts: _Optional[int] = ..., part_index: _Optional[int] = ...) -> None: ...

class FetchPartsRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: FetchPartsHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[FetchPartsHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class CopyPartsLiveHeader(_message.Message):
    __slots__ = ("caller", "variables", "tensors", "rows")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    variables: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    rows: _containers.RepeatedCompositeFieldContainer[RowRange]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., variables: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., rows: _Optional[_Iterable[_Union[RowRange, _Mapping]]] = ...) -> None: ...

class CopyPartsLiveRequest(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: CopyPartsLiveHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[CopyPartsLiveHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class FetchPartsReplyHeader(_message.Message):
    __slots__ = ("record", "tensors", "mark", "layout_version", "shared")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    record: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    mark: int
    layout_version: int
    shared: SameHostRegion
    def __init__(self, record: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., mark: _Optional[int] = ..., layout_version: _Optional[int] = ..., shared: _Optional[_Union[SameHostRegion, _Mapping]] = ...) -> None: ...

class FetchPartsResponse(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: FetchPartsReplyHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[FetchPartsReplyHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ReportMetricRequest(_message.Message):
    __slots__ = ("caller", "value", "global_step")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    value: float
    global_step: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., value: _Optional[float] = ..., global_step: _Optional[int] = ...) -> None: ...

class ReportMetricReply(_message.Message):
    __slots__ = ("global_step", "learning_rate")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    learning_rate: float
    def __init__(self, global_step: _Optional[int] = ..., learning_rate: _Optional[float] = ...) -> None: ...

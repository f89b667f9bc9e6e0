from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_TRAIN: _ClassVar[Phase]
    PHASE_EVAL: _ClassVar[Phase]
    PHASE_CHECKPOINT: _ClassVar[Phase]
    PHASE_IDLE: _ClassVar[Phase]
    PHASE_RECOVERY: _ClassVar[Phase]
PHASE_UNSPECIFIED: Phase
PHASE_TRAIN: Phase
PHASE_EVAL: Phase
PHASE_CHECKPOINT: Phase
PHASE_IDLE: Phase
PHASE_RECOVERY: Phase

class Hello(_message.Message):
    __slots__ = ("rank", "local_rank", "world_size", "node_id", "pid", "backend", "device", "mesh_coords", "mesh_shape", "job_id", "peak_flops", "op_names", "device_uuid", "collective_source", "peer_nonce", "fault_file", "instrumentation")
    class MeshCoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MeshShapeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDS_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    OP_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEER_NONCE_FIELD_NUMBER: _ClassVar[int]
    FAULT_FILE_FIELD_NUMBER: _ClassVar[int]
    INSTRUMENTATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    world_size: int
    node_id: str
    pid: int
    backend: str
    device: str
    mesh_coords: _containers.ScalarMap[str, int]
    mesh_shape: _containers.ScalarMap[str, int]
    job_id: str
    peak_flops: float
    op_names: _containers.RepeatedScalarFieldContainer[str]
    device_uuid: str
    collective_source: str
    peer_nonce: bytes
    fault_file: str
    instrumentation: str
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., node_id: _Optional[str] = ..., pid: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., mesh_coords: _Optional[_Mapping[str, int]] = ..., mesh_shape: _Optional[_Mapping[str, int]] = ..., job_id: _Optional[str] = ..., peak_flops: _Optional[float] = ..., op_names: _Optional[_Iterable[str]] = ..., device_uuid: _Optional[str] = ..., collective_source: _Optional[str] = ..., peer_nonce: _Optional[bytes] = ..., fault_file: _Optional[str] = ..., instrumentation: _Optional[str] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("step", "start", "duration", "data", "forward", "backward", "optimizer", "tokens", "flops", "wait")
    STEP_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    step: _containers.RepeatedScalarFieldContainer[int]
    start: _containers.RepeatedScalarFieldContainer[float]
    duration: _containers.RepeatedScalarFieldContainer[float]
    data: _containers.RepeatedScalarFieldContainer[float]
    forward: _containers.RepeatedScalarFieldContainer[float]
    backward: _containers.RepeatedScalarFieldContainer[float]
    optimizer: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[float]
    flops: _containers.RepeatedScalarFieldContainer[float]
    wait: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step: _Optional[_Iterable[int]] = ..., start: _Optional[_Iterable[float]] = ..., duration: _Optional[_Iterable[float]] = ..., data: _Optional[_Iterable[float]] = ..., forward: _Optional[_Iterable[float]] = ..., backward: _Optional[_Iterable[float]] = ..., optimizer: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[float]] = ..., flops: _Optional[_Iterable[float]] = ..., wait: _Optional[_Iterable[float]] = ...) -> None: ...

class CollectiveColumns(_message.Message):
    __slots__ = ("op", "pg", "seq", "start", "duration", "nbytes", "pg_names")
    OP_FIELD_NUMBER: _ClassVar[int]
    PG_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PG_NAMES_FIELD_NUMBER: _ClassVar[int]
    op: bytes
    pg: bytes
    seq: bytes
    start: bytes
    duration: bytes
    nbytes: bytes
    pg_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, op: _Optional[bytes] = ..., pg: _Optional[bytes] = ..., seq: _Optional[bytes] = ..., start: _Optional[bytes] = ..., duration: _Optional[bytes] = ..., nbytes: _Optional[bytes] = ..., pg_names: _Optional[_Iterable[str]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "step_started_at", "phase", "last_collective_seq", "sampled_at", "inflight", "group_seqs", "stacks", "flight_recorder")
    class GroupSeqsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAST_COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_AT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SEQS_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_started_at: float
    phase: Phase
    last_collective_seq: int
    sampled_at: float
    inflight: InFlight
    group_seqs: _containers.ScalarMap[str, int]
    stacks: str
    flight_recorder: str
    def __init__(self, step: _Optional[int] = ..., step_started_at: _Optional[float] = ..., phase: _Optional[_Union[Phase, str]] = ..., last_collective_seq: _Optional[int] = ..., sampled_at: _Optional[float] = ..., inflight: _Optional[_Union[InFlight, _Mapping]] = ..., group_seqs: _Optional[_Mapping[str, int]] = ..., stacks: _Optional[str] = ..., flight_recorder: _Optional[str] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("op", "group", "seq", "since", "peer", "microbatch", "microbatch_pass")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_PASS_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    seq: int
    since: float
    peer: int
    microbatch: int
    microbatch_pass: str
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., seq: _Optional[int] = ..., since: _Optional[float] = ..., peer: _Optional[int] = ..., microbatch: _Optional[int] = ..., microbatch_pass: _Optional[str] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("step", "tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRecord(_message.Message):
    __slots__ = ("step", "started_at", "duration", "path", "request_id", "ok", "error", "completed_after", "asynchronous")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AFTER_FIELD_NUMBER: _ClassVar[int]
    ASYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    step: int
    started_at: float
    duration: float
    path: str
    request_id: str
    ok: bool
    error: str
    completed_after: float
    asynchronous: bool
    def __init__(self, step: _Optional[int] = ..., started_at: _Optional[float] = ..., duration: _Optional[float] = ..., path: _Optional[str] = ..., request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., completed_after: _Optional[float] = ..., asynchronous: _Optional[bool] = ...) -> None: ...

class RecoveryRecord(_message.Message):
    __slots__ = ("started_at", "step", "old_world_size", "new_world_size", "dropped_nodes", "ok", "error", "phases", "rank_after", "failed_at", "snapshot")
    class PhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OLD_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEW_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NODES_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RANK_AFTER_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    started_at: float
    step: int
    old_world_size: int
    new_world_size: int
    dropped_nodes: _containers.RepeatedScalarFieldContainer[str]
    ok: bool
    error: str
    phases: _containers.ScalarMap[str, float]
    rank_after: int
    failed_at: int
    snapshot: SnapshotStats
    def __init__(self, started_at: _Optional[float] = ..., step: _Optional[int] = ..., old_world_size: _Optional[int] = ..., new_world_size: _Optional[int] = ..., dropped_nodes: _Optional[_Iterable[str]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., phases: _Optional[_Mapping[str, float]] = ..., rank_after: _Optional[int] = ..., failed_at: _Optional[int] = ..., snapshot: _Optional[_Union[SnapshotStats, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("seq", "dropped_total", "progress", "steps", "collectives", "checkpoints", "recoveries", "exit", "mesh", "expert_loads", "snapshot")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    EXPERT_LOADS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    dropped_total: int
    progress: Progress
    steps: StepColumns
    collectives: CollectiveColumns
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointRecord]
    recoveries: _containers.RepeatedCompositeFieldContainer[RecoveryRecord]
    exit: ExitRecord
    mesh: MeshUpdate
    expert_loads: _containers.RepeatedCompositeFieldContainer[ExpertLoad]
    snapshot: SnapshotStats
    def __init__(self, seq: _Optional[int] = ..., dropped_total: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., steps: _Optional[_Union[StepColumns, _Mapping]] = ..., collectives: _Optional[_Union[CollectiveColumns, _Mapping]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointRecord, _Mapping]]] = ..., recoveries: _Optional[_Iterable[_Union[RecoveryRecord, _Mapping]]] = ..., exit: _Optional[_Union[ExitRecord, _Mapping]] = ..., mesh: _Optional[_Union[MeshUpdate, _Mapping]] = ..., expert_loads: _Optional[_Iterable[_Union[ExpertLoad, _Mapping]]] = ..., snapshot: _Optional[_Union[SnapshotStats, _Mapping]] = ...) -> None: ...

class SnapshotStats(_message.Message):
    __slots__ = ("step", "memory_bytes", "sent_bytes", "send_seconds", "copy_seconds", "exchanges", "failures", "every", "reason", "work_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COPY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    memory_bytes: int
    sent_bytes: int
    send_seconds: float
    copy_seconds: float
    exchanges: int
    failures: int
    every: int
    reason: int
    work_seconds: float
    def __init__(self, step: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., sent_bytes: _Optional[int] = ..., send_seconds: _Optional[float] = ..., copy_seconds: _Optional[float] = ..., exchanges: _Optional[int] = ..., failures: _Optional[int] = ..., every: _Optional[int] = ..., reason: _Optional[int] = ..., work_seconds: _Optional[float] = ...) -> None: ...

class MeshUpdate(_message.Message):
    __slots__ = ("mesh_coords", "mesh_shape")
    class MeshCoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MeshShapeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MESH_COORDS_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    mesh_coords: _containers.ScalarMap[str, int]
    mesh_shape: _containers.ScalarMap[str, int]
    def __init__(self, mesh_coords: _Optional[_Mapping[str, int]] = ..., mesh_shape: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReportMessage(_message.Message):
    __slots__ = ("hello", "batch", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: Batch
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportSummary(_message.Message):
    __slots__ = ("batches_accepted", "batches_rejected")
    BATCHES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    batches_accepted: int
    batches_rejected: int
    def __init__(self, batches_accepted: _Optional[int] = ..., batches_rejected: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("all_ranks", "max_ranks")
    ALL_RANKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANKS_FIELD_NUMBER: _ClassVar[int]
    all_ranks: bool
    max_ranks: int
    def __init__(self, all_ranks: _Optional[bool] = ..., max_ranks: _Optional[int] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "node", "pid", "step", "step_seconds", "state", "phase_seconds", "mesh_coords", "backend", "collectives", "last_collective_seq", "dropped", "last_seen", "connected", "tokens_per_second", "slowdown", "own_work_seconds", "collective_wait_seconds", "collective_source", "device_uuid", "op_latency", "restarting", "instrumentation")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MeshCoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class OpLatencyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: OpLatency
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[OpLatency, _Mapping]] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    LAST_COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    OWN_WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OP_LATENCY_FIELD_NUMBER: _ClassVar[int]
    RESTARTING_FIELD_NUMBER: _ClassVar[int]
    INSTRUMENTATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    pid: int
    step: int
    step_seconds: float
    state: str
    phase_seconds: _containers.ScalarMap[str, float]
    mesh_coords: _containers.ScalarMap[str, int]
    backend: str
    collectives: int
    last_collective_seq: int
    dropped: int
    last_seen: float
    connected: bool
    tokens_per_second: float
    slowdown: float
    own_work_seconds: float
    collective_wait_seconds: float
    collective_source: str
    device_uuid: str
    op_latency: _containers.MessageMap[str, OpLatency]
    restarting: bool
    instrumentation: str
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., state: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., mesh_coords: _Optional[_Mapping[str, int]] = ..., backend: _Optional[str] = ..., collectives: _Optional[int] = ..., last_collective_seq: _Optional[int] = ..., dropped: _Optional[int] = ..., last_seen: _Optional[float] = ..., connected: _Optional[bool] = ..., tokens_per_second: _Optional[float] = ..., slowdown: _Optional[float] = ..., own_work_seconds: _Optional[float] = ..., collective_wait_seconds: _Optional[float] = ..., collective_source: _Optional[str] = ..., device_uuid: _Optional[str] = ..., op_latency: _Optional[_Mapping[str, OpLatency]] = ..., restarting: _Optional[bool] = ..., instrumentation: _Optional[str] = ...) -> None: ...

class OpLatency(_message.Message):
    __slots__ = ("count", "p50_seconds", "p99_seconds", "window")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50_seconds: float
    p99_seconds: float
    window: int
    def __init__(self, count: _Optional[int] = ..., p50_seconds: _Optional[float] = ..., p99_seconds: _Optional[float] = ..., window: _Optional[int] = ...) -> None: ...

class Incident(_message.Message):
    __slots__ = ("kind", "node", "rank", "step", "detected_at", "detail_json", "id", "run_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_JSON_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    node: str
    rank: int
    step: int
    detected_at: float
    detail_json: str
    id: str
    run_id: str
    def __init__(self, kind: _Optional[str] = ..., node: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., detected_at: _Optional[float] = ..., detail_json: _Optional[str] = ..., id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node_id", "started_at", "metrics_port", "ranks", "incidents", "goodput", "records_received", "messages_rejected", "tokens_per_second", "mfu", "coordinator", "coordinator_node", "decisions", "time_seconds", "nodes", "excluded_nodes", "storage", "ranks_total", "ranks_left_out", "rank_states", "bottleneck", "rank_conflicts", "pipeline", "experts")
    class TimeSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StorageEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StorageStatus
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StorageStatus, _Mapping]] = ...) -> None: ...
    class RankStatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    RECORDS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_NODE_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_NODES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    RANKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RANKS_LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    RANK_STATES_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    RANK_CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    started_at: float
    metrics_port: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    goodput: float
    records_received: int
    messages_rejected: int
    tokens_per_second: float
    mfu: float
    coordinator: bool
    coordinator_node: str
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    time_seconds: _containers.ScalarMap[str, float]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    excluded_nodes: _containers.RepeatedScalarFieldContainer[str]
    storage: _containers.MessageMap[str, StorageStatus]
    ranks_total: int
    ranks_left_out: int
    rank_states: _containers.ScalarMap[str, int]
    bottleneck: Bottleneck
    rank_conflicts: _containers.RepeatedCompositeFieldContainer[RankConflict]
    pipeline: PipelineBalance
    experts: ExpertSkew
    def __init__(self, node_id: _Optional[str] = ..., started_at: _Optional[float] = ..., metrics_port: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., goodput: _Optional[float] = ..., records_received: _Optional[int] = ..., messages_rejected: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., mfu: _Optional[float] = ..., coordinator: _Optional[bool] = ..., coordinator_node: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., time_seconds: _Optional[_Mapping[str, float]] = ..., nodes: _Optional[_Iterable[str]] = ..., excluded_nodes: _Optional[_Iterable[str]] = ..., storage: _Optional[_Mapping[str, StorageStatus]] = ..., ranks_total: _Optional[int] = ..., ranks_left_out: _Optional[int] = ..., rank_states: _Optional[_Mapping[str, int]] = ..., bottleneck: _Optional[_Union[Bottleneck, _Mapping]] = ..., rank_conflicts: _Optional[_Iterable[_Union[RankConflict, _Mapping]]] = ..., pipeline: _Optional[_Union[PipelineBalance, _Mapping]] = ..., experts: _Optional[_Union[ExpertSkew, _Mapping]] = ...) -> None: ...

class StageLoad(_message.Message):
    __slots__ = ("stage", "ranks", "compute_seconds", "step_seconds", "bubble")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    ranks: int
    compute_seconds: float
    step_seconds: float
    bubble: float
    def __init__(self, stage: _Optional[int] = ..., ranks: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ..., bubble: _Optional[float] = ...) -> None: ...

class PipelineBalance(_message.Message):
    __slots__ = ("stages", "imbalance", "heaviest_stage", "lightest_stage", "idle", "text", "scope")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    HEAVIEST_STAGE_FIELD_NUMBER: _ClassVar[int]
    LIGHTEST_STAGE_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    imbalance: float
    heaviest_stage: int
    lightest_stage: int
    idle: float
    text: str
    scope: str
    def __init__(self, stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ..., imbalance: _Optional[float] = ..., heaviest_stage: _Optional[int] = ..., lightest_stage: _Optional[int] = ..., idle: _Optional[float] = ..., text: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class ExpertSkew(_message.Message):
    __slots__ = ("skew", "hottest_rank", "tokens_per_step", "scope")
    class TokensPerStepEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    SKEW_FIELD_NUMBER: _ClassVar[int]
    HOTTEST_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    skew: float
    hottest_rank: int
    tokens_per_step: _containers.ScalarMap[int, float]
    scope: str
    def __init__(self, skew: _Optional[float] = ..., hottest_rank: _Optional[int] = ..., tokens_per_step: _Optional[_Mapping[int, float]] = ..., scope: _Optional[str] = ...) -> None: ...

class RankConflict(_message.Message):
    __slots__ = ("rank", "node", "claimed_by", "since", "last_at", "refused")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LAST_AT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    claimed_by: str
    since: float
    last_at: float
    refused: int
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., claimed_by: _Optional[str] = ..., since: _Optional[float] = ..., last_at: _Optional[float] = ..., refused: _Optional[int] = ...) -> None: ...

class Bottleneck(_message.Message):
    __slots__ = ("kind", "share", "input_share", "communication_share", "compute_share", "since", "step_seconds", "ranks", "ranks_seen", "gpu_utilization", "scope")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHARE_FIELD_NUMBER: _ClassVar[int]
    COMMUNICATION_SHARE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    share: float
    input_share: float
    communication_share: float
    compute_share: float
    since: float
    step_seconds: float
    ranks: int
    ranks_seen: int
    gpu_utilization: float
    scope: str
    def __init__(self, kind: _Optional[str] = ..., share: _Optional[float] = ..., input_share: _Optional[float] = ..., communication_share: _Optional[float] = ..., compute_share: _Optional[float] = ..., since: _Optional[float] = ..., step_seconds: _Optional[float] = ..., ranks: _Optional[int] = ..., ranks_seen: _Optional[int] = ..., gpu_utilization: _Optional[float] = ..., scope: _Optional[str] = ...) -> None: ...

class StepMakeup(_message.Message):
    __slots__ = ("step_seconds", "data_seconds", "wait_seconds", "own_seconds", "ranks", "ranks_seen", "steps", "gpu_utilization")
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GPU_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    step_seconds: float
    data_seconds: float
    wait_seconds: float
    own_seconds: float
    ranks: int
    ranks_seen: int
    steps: int
    gpu_utilization: float
    def __init__(self, step_seconds: _Optional[float] = ..., data_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., own_seconds: _Optional[float] = ..., ranks: _Optional[int] = ..., ranks_seen: _Optional[int] = ..., steps: _Optional[int] = ..., gpu_utilization: _Optional[float] = ...) -> None: ...

class StorageStatus(_message.Message):
    __slots__ = ("path", "ok", "written", "spooled", "failures", "dropped", "last_error")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SPOOLED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    path: str
    ok: bool
    written: int
    spooled: int
    failures: int
    dropped: int
    last_error: str
    def __init__(self, path: _Optional[str] = ..., ok: _Optional[bool] = ..., written: _Optional[int] = ..., spooled: _Optional[int] = ..., failures: _Optional[int] = ..., dropped: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class CommandRequest(_message.Message):
    __slots__ = ("rank", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class CheckpointCommand(_message.Message):
    __slots__ = ("step", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    reason: str
    def __init__(self, step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "checkpoint")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    id: str
    checkpoint: CheckpointCommand
    def __init__(self, id: _Optional[str] = ..., checkpoint: _Optional[_Union[CheckpointCommand, _Mapping]] = ...) -> None: ...

class RankSummary(_message.Message):
    __slots__ = ("rank", "pid", "step", "step_seconds", "steps_completed", "activity", "progress_at", "last_seen", "connected", "exited_cleanly", "group_seqs", "inflight", "stacks", "alive", "stopped", "own_work", "data_wait", "comm_wait", "state", "local_rank", "tokens_per_second", "stacks_at", "flight_recorder", "phase_seconds", "mesh_coords", "op_latency", "backend", "collectives", "world_size", "world_rank", "expert_tokens", "step_period", "work")
    class GroupSeqsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MeshCoordsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class OpLatencyEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: OpLatency
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[OpLatency, _Mapping]] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EXITED_CLEANLY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SEQS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    OWN_WORK_FIELD_NUMBER: _ClassVar[int]
    DATA_WAIT_FIELD_NUMBER: _ClassVar[int]
    COMM_WAIT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STACKS_AT_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_RECORDER_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDS_FIELD_NUMBER: _ClassVar[int]
    OP_LATENCY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORLD_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_PERIOD_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    step: int
    step_seconds: float
    steps_completed: int
    activity: str
    progress_at: float
    last_seen: float
    connected: bool
    exited_cleanly: bool
    group_seqs: _containers.ScalarMap[str, int]
    inflight: InFlight
    stacks: str
    alive: bool
    stopped: bool
    own_work: _containers.RepeatedScalarFieldContainer[float]
    data_wait: _containers.RepeatedScalarFieldContainer[float]
    comm_wait: _containers.RepeatedScalarFieldContainer[float]
    state: str
    local_rank: int
    tokens_per_second: float
    stacks_at: float
    flight_recorder: str
    phase_seconds: _containers.ScalarMap[str, float]
    mesh_coords: _containers.ScalarMap[str, int]
    op_latency: _containers.MessageMap[str, OpLatency]
    backend: str
    collectives: int
    world_size: int
    world_rank: int
    expert_tokens: float
    step_period: float
    work: bytes
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., steps_completed: _Optional[int] = ..., activity: _Optional[str] = ..., progress_at: _Optional[float] = ..., last_seen: _Optional[float] = ..., connected: _Optional[bool] = ..., exited_cleanly: _Optional[bool] = ..., group_seqs: _Optional[_Mapping[str, int]] = ..., inflight: _Optional[_Union[InFlight, _Mapping]] = ..., stacks: _Optional[str] = ..., alive: _Optional[bool] = ..., stopped: _Optional[bool] = ..., own_work: _Optional[_Iterable[float]] = ..., data_wait: _Optional[_Iterable[float]] = ..., comm_wait: _Optional[_Iterable[float]] = ..., state: _Optional[str] = ..., local_rank: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., stacks_at: _Optional[float] = ..., flight_recorder: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., mesh_coords: _Optional[_Mapping[str, int]] = ..., op_latency: _Optional[_Mapping[str, OpLatency]] = ..., backend: _Optional[str] = ..., collectives: _Optional[int] = ..., world_size: _Optional[int] = ..., world_rank: _Optional[int] = ..., expert_tokens: _Optional[float] = ..., step_period: _Optional[float] = ..., work: _Optional[bytes] = ...) -> None: ...

class NodeSummary(_message.Message):
    __slots__ = ("node_id", "seq", "sent_at", "ranks", "incidents", "time_seconds", "decisions", "run_id", "relay_address", "step_makeup", "agent_instance")
    class TimeSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_MAKEUP_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    sent_at: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankSummary]
    incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    time_seconds: _containers.ScalarMap[str, float]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    run_id: str
    relay_address: str
    step_makeup: StepMakeup
    agent_instance: str
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ..., sent_at: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankSummary, _Mapping]]] = ..., incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., time_seconds: _Optional[_Mapping[str, float]] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., run_id: _Optional[str] = ..., relay_address: _Optional[str] = ..., step_makeup: _Optional[_Union[StepMakeup, _Mapping]] = ..., agent_instance: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("id", "kind", "node", "generation", "step", "reason", "decided_at", "run_id", "seq")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    node: str
    generation: int
    step: int
    reason: str
    decided_at: float
    run_id: str
    seq: int
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., node: _Optional[str] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ..., decided_at: _Optional[float] = ..., run_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class SyncReply(_message.Message):
    __slots__ = ("coordinator", "decisions", "incidents", "sync_interval_seconds", "relay")
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    coordinator: str
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    sync_interval_seconds: float
    relay: str
    def __init__(self, coordinator: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., sync_interval_seconds: _Optional[float] = ..., relay: _Optional[str] = ...) -> None: ...

class GroupSummary(_message.Message):
    __slots__ = ("nodes", "held_seconds", "beats", "absent")
    NODES_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BEATS_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeSummary]
    held_seconds: _containers.RepeatedScalarFieldContainer[float]
    beats: _containers.RepeatedCompositeFieldContainer[NodeBeat]
    absent: _containers.RepeatedCompositeFieldContainer[NodeAbsence]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeSummary, _Mapping]]] = ..., held_seconds: _Optional[_Iterable[float]] = ..., beats: _Optional[_Iterable[_Union[NodeBeat, _Mapping]]] = ..., absent: _Optional[_Iterable[_Union[NodeAbsence, _Mapping]]] = ...) -> None: ...

class NodeAbsence(_message.Message):
    __slots__ = ("node_id", "unheard_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UNHEARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    unheard_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., unheard_seconds: _Optional[float] = ...) -> None: ...

class NodeBeat(_message.Message):
    __slots__ = ("node_id", "seq", "sent_at", "held_seconds", "latest_progress")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LATEST_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    seq: int
    sent_at: float
    held_seconds: float
    latest_progress: float
    def __init__(self, node_id: _Optional[str] = ..., seq: _Optional[int] = ..., sent_at: _Optional[float] = ..., held_seconds: _Optional[float] = ..., latest_progress: _Optional[float] = ...) -> None: ...

class GroupReply(_message.Message):
    __slots__ = ("coordinator", "decisions", "incidents", "sync_interval_seconds", "relays", "refused")
    class RelaysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    SYNC_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    coordinator: str
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    sync_interval_seconds: float
    relays: _containers.ScalarMap[str, str]
    refused: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, coordinator: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., sync_interval_seconds: _Optional[float] = ..., relays: _Optional[_Mapping[str, str]] = ..., refused: _Optional[_Iterable[str]] = ...) -> None: ...

class ExitRecord(_message.Message):
    __slots__ = ("type", "message", "frames", "step", "at", "thread", "main_thread")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    THREAD_FIELD_NUMBER: _ClassVar[int]
    MAIN_THREAD_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    step: int
    at: float
    thread: str
    main_thread: bool
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ..., step: _Optional[int] = ..., at: _Optional[float] = ..., thread: _Optional[str] = ..., main_thread: _Optional[bool] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("file", "line", "function")
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    file: str
    line: int
    function: str
    def __init__(self, file: _Optional[str] = ..., line: _Optional[int] = ..., function: _Optional[str] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("pid", "rank", "local_rank", "exitcode", "signal", "error_file", "at", "failed")
    PID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    EXITCODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FILE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    rank: int
    local_rank: int
    exitcode: int
    signal: str
    error_file: str
    at: float
    failed: bool
    def __init__(self, pid: _Optional[int] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., exitcode: _Optional[int] = ..., signal: _Optional[str] = ..., error_file: _Optional[str] = ..., at: _Optional[float] = ..., failed: _Optional[bool] = ...) -> None: ...

class WorkerExits(_message.Message):
    __slots__ = ("node_id", "run_id", "exits")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    run_id: str
    exits: _containers.RepeatedCompositeFieldContainer[WorkerExit]
    def __init__(self, node_id: _Optional[str] = ..., run_id: _Optional[str] = ..., exits: _Optional[_Iterable[_Union[WorkerExit, _Mapping]]] = ...) -> None: ...

class WorkerExitsReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("accepted", "step", "id", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    step: int
    id: str
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., step: _Optional[int] = ..., id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

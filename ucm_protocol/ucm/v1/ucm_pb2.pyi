from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATUS_UNSPECIFIED: _ClassVar[BlockStatus]
    BLOCK_PENDING: _ClassVar[BlockStatus]
    BLOCK_OK: _ClassVar[BlockStatus]
    BLOCK_MISSING: _ClassVar[BlockStatus]
    BLOCK_FAILED: _ClassVar[BlockStatus]
    BLOCK_CANCELLED: _ClassVar[BlockStatus]

class TaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_KIND_UNSPECIFIED: _ClassVar[TaskKind]
    TASK_LOAD: _ClassVar[TaskKind]
    TASK_DUMP: _ClassVar[TaskKind]
    TASK_PREFETCH: _ClassVar[TaskKind]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_RUNNING: _ClassVar[TaskState]
    TASK_DONE: _ClassVar[TaskState]
    TASK_CANCELLED: _ClassVar[TaskState]
BLOCK_STATUS_UNSPECIFIED: BlockStatus
BLOCK_PENDING: BlockStatus
BLOCK_OK: BlockStatus
BLOCK_MISSING: BlockStatus
BLOCK_FAILED: BlockStatus
BLOCK_CANCELLED: BlockStatus
TASK_KIND_UNSPECIFIED: TaskKind
TASK_LOAD: TaskKind
TASK_DUMP: TaskKind
TASK_PREFETCH: TaskKind
TASK_STATE_UNSPECIFIED: TaskState
TASK_RUNNING: TaskState
TASK_DONE: TaskState
TASK_CANCELLED: TaskState

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "pid", "task_events")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TASK_EVENTS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    task_events: bool
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., task_events: _Optional[bool] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "heartbeat_interval_s", "server_version", "finished", "task_events_stopped", "store_saturated")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TASK_EVENTS_STOPPED_FIELD_NUMBER: _ClassVar[int]
    STORE_SATURATED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    heartbeat_interval_s: float
    server_version: str
    finished: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    task_events_stopped: bool
    store_saturated: bool
    def __init__(self, session_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., server_version: _Optional[str] = ..., finished: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ..., task_events_stopped: _Optional[bool] = ..., store_saturated: _Optional[bool] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("shm_name", "size", "label", "cuda_ipc_handle", "cuda_offset", "cuda_device", "cuda_device_uuid", "memfd_token")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEMFD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size: int
    label: str
    cuda_ipc_handle: bytes
    cuda_offset: int
    cuda_device: int
    cuda_device_uuid: bytes
    memfd_token: bytes
    def __init__(self, shm_name: _Optional[str] = ..., size: _Optional[int] = ..., label: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_offset: _Optional[int] = ..., cuda_device: _Optional[int] = ..., cuda_device_uuid: _Optional[bytes] = ..., memfd_token: _Optional[bytes] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockBatch(_message.Message):
    __slots__ = ("namespace", "keys", "segment_counts", "region_ids", "offsets", "lengths")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    REGION_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    segment_counts: _containers.RepeatedScalarFieldContainer[int]
    region_ids: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., segment_counts: _Optional[_Iterable[int]] = ..., region_ids: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("blocks", "progress")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    blocks: BlockBatch
    progress: Segment
    def __init__(self, blocks: _Optional[_Union[BlockBatch, _Mapping]] = ..., progress: _Optional[_Union[Segment, _Mapping]] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("region_id", "offset", "length")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    offset: int
    length: int
    def __init__(self, region_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class DumpRequest(_message.Message):
    __slots__ = ("blocks", "wait_durable", "cache_only")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAIT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    blocks: BlockBatch
    wait_durable: bool
    cache_only: bool
    def __init__(self, blocks: _Optional[_Union[BlockBatch, _Mapping]] = ..., wait_durable: _Optional[bool] = ..., cache_only: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TaskHandle(_message.Message):
    __slots__ = ("task_id", "progress", "store_saturated")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_SATURATED_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    progress: bool
    store_saturated: bool
    def __init__(self, task_id: _Optional[int] = ..., progress: _Optional[bool] = ..., store_saturated: _Optional[bool] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("task_id", "timeout_s", "cancel_on_timeout")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CANCEL_ON_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    timeout_s: float
    cancel_on_timeout: bool
    def __init__(self, task_id: _Optional[int] = ..., timeout_s: _Optional[float] = ..., cancel_on_timeout: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    def __init__(self, task_id: _Optional[int] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "kind", "state", "block_status", "reasons", "bytes_done", "elapsed_s")
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STATUS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    kind: TaskKind
    state: TaskState
    block_status: _containers.RepeatedScalarFieldContainer[BlockStatus]
    reasons: _containers.ScalarMap[int, str]
    bytes_done: int
    elapsed_s: float
    def __init__(self, task_id: _Optional[int] = ..., kind: _Optional[_Union[TaskKind, str]] = ..., state: _Optional[_Union[TaskState, str]] = ..., block_status: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., reasons: _Optional[_Mapping[int, str]] = ..., bytes_done: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "packed_keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_keys: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("present", "hit_prefix", "present_bytes")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    HIT_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PRESENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    hit_prefix: int
    present_bytes: bytes
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., hit_prefix: _Optional[int] = ..., present_bytes: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("pinned", "expires_at", "priority")
    PINNED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    pinned: bool
    expires_at: float
    priority: int
    def __init__(self, pinned: _Optional[bool] = ..., expires_at: _Optional[float] = ..., priority: _Optional[int] = ...) -> None: ...

class SetRetentionRequest(_message.Message):
    __slots__ = ("namespace", "keys", "pin", "unpin", "ttl_s", "clear_ttl", "set_priority", "priority", "require_all_tiers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    CLEAR_TTL_FIELD_NUMBER: _ClassVar[int]
    SET_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_ALL_TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    unpin: bool
    ttl_s: float
    clear_ttl: bool
    set_priority: bool
    priority: int
    require_all_tiers: bool
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., pin: _Optional[bool] = ..., unpin: _Optional[bool] = ..., ttl_s: _Optional[float] = ..., clear_ttl: _Optional[bool] = ..., set_priority: _Optional[bool] = ..., priority: _Optional[int] = ..., require_all_tiers: _Optional[bool] = ...) -> None: ...

class SetRetentionResponse(_message.Message):
    __slots__ = ("applied", "missing", "not_enforced")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    NOT_ENFORCED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    missing: int
    not_enforced: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, applied: _Optional[int] = ..., missing: _Optional[int] = ..., not_enforced: _Optional[_Iterable[str]] = ...) -> None: ...

class BlockBytes(_message.Message):
    __slots__ = ("namespace", "key", "data")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    data: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlockReply(_message.Message):
    __slots__ = ("index", "status", "reason", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    status: BlockStatus
    reason: str
    data: bytes
    def __init__(self, index: _Optional[int] = ..., status: _Optional[_Union[BlockStatus, str]] = ..., reason: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksReply(_message.Message):
    __slots__ = ("block_status", "reasons")
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    BLOCK_STATUS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    block_status: _containers.RepeatedScalarFieldContainer[BlockStatus]
    reasons: _containers.ScalarMap[int, str]
    def __init__(self, block_status: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., reasons: _Optional[_Mapping[int, str]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "kind", "blocks", "bytes", "capacity_bytes", "hits", "misses", "evictions", "read_bytes", "write_bytes", "errors", "corrupt", "persistent", "shared", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    read_bytes: int
    write_bytes: int
    errors: int
    corrupt: int
    persistent: bool
    shared: bool
    extra: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., read_bytes: _Optional[int] = ..., write_bytes: _Optional[int] = ..., errors: _Optional[int] = ..., corrupt: _Optional[int] = ..., persistent: _Optional[bool] = ..., shared: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "tiers", "sessions", "regions", "region_bytes", "tasks_running", "tasks_queued", "lookups", "lookup_keys", "lookup_hits", "pending_writeback", "store_pipeline", "session_list", "pinned_blocks", "retention_rules", "expired_blocks")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    TASKS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    PENDING_WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    STORE_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    SESSION_LIST_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_RULES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    sessions: int
    regions: int
    region_bytes: int
    tasks_running: int
    tasks_queued: int
    lookups: int
    lookup_keys: int
    lookup_hits: int
    pending_writeback: int
    store_pipeline: str
    session_list: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    pinned_blocks: int
    retention_rules: int
    expired_blocks: int
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., regions: _Optional[int] = ..., region_bytes: _Optional[int] = ..., tasks_running: _Optional[int] = ..., tasks_queued: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_keys: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., pending_writeback: _Optional[int] = ..., store_pipeline: _Optional[str] = ..., session_list: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., pinned_blocks: _Optional[int] = ..., retention_rules: _Optional[int] = ..., expired_blocks: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("client_name", "pid", "tenant", "age_s")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    tenant: str
    age_s: float
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., tenant: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("namespace", "key", "size", "tiers", "stored_at", "checksum", "has_checksum", "retention")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    size: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    stored_at: float
    checksum: int
    has_checksum: bool
    retention: Retention
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ..., size: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., stored_at: _Optional[float] = ..., checksum: _Optional[int] = ..., has_checksum: _Optional[bool] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("namespace", "tier", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    tier: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[bytes] = ..., tier: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "total")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    total: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("namespace", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    key: bytes
    def __init__(self, namespace: _Optional[bytes] = ..., key: _Optional[bytes] = ...) -> None: ...

class InspectResponse(_message.Message):
    __slots__ = ("block",)
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    block: BlockInfo
    def __init__(self, block: _Optional[_Union[BlockInfo, _Mapping]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tier", "min_bytes", "namespace", "keys", "all")
    TIER_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    tier: str
    min_bytes: int
    namespace: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    all: bool
    def __init__(self, tier: _Optional[str] = ..., min_bytes: _Optional[int] = ..., namespace: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., all: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("tier", "namespace", "quarantine")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_FIELD_NUMBER: _ClassVar[int]
    tier: str
    namespace: bytes
    quarantine: bool
    def __init__(self, tier: _Optional[str] = ..., namespace: _Optional[bytes] = ..., quarantine: _Optional[bool] = ...) -> None: ...

class VerifyProgress(_message.Message):
    __slots__ = ("checked", "total", "corrupt", "corrupt_keys", "done")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    checked: int
    total: int
    corrupt: int
    corrupt_keys: _containers.RepeatedScalarFieldContainer[str]
    done: bool
    def __init__(self, checked: _Optional[int] = ..., total: _Optional[int] = ..., corrupt: _Optional[int] = ..., corrupt_keys: _Optional[_Iterable[str]] = ..., done: _Optional[bool] = ...) -> None: ...

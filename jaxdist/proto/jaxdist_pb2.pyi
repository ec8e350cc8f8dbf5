from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    F32: _ClassVar[DType]
    F16: _ClassVar[DType]
    BF16: _ClassVar[DType]
    F64: _ClassVar[DType]
    I8: _ClassVar[DType]
    I16: _ClassVar[DType]
    I32: _ClassVar[DType]
    I64: _ClassVar[DType]
    U8: _ClassVar[DType]
    U16: _ClassVar[DType]
    U32: _ClassVar[DType]
    U64: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Layout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYOUT_AS_STORED: _ClassVar[Layout]
    LAYOUT_TRANSPOSE: _ClassVar[Layout]

class FrameKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAME_DATA: _ClassVar[FrameKind]
    FRAME_ERROR: _ClassVar[FrameKind]
    FRAME_END_SESSION: _ClassVar[FrameKind]
DTYPE_UNSPECIFIED: DType
F32: DType
F16: DType
BF16: DType
F64: DType
I8: DType
I16: DType
I32: DType
I64: DType
U8: DType
U16: DType
U32: DType
U64: DType
BOOL: DType
LAYOUT_AS_STORED: Layout
LAYOUT_TRANSPOSE: Layout
FRAME_DATA: FrameKind
FRAME_ERROR: FrameKind
FRAME_END_SESSION: FrameKind

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "offset", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    offset: int
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class TensorSig(_message.Message):
    __slots__ = ("name", "dtype", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    dims: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., dims: _Optional[_Iterable[str]] = ...) -> None: ...

class StateSig(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightRef(_message.Message):
    __slots__ = ("param", "uri", "shape", "dtype", "sha256", "packed", "layout", "quant")
    PARAM_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    param: str
    uri: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    sha256: str
    packed: bool
    layout: Layout
    quant: str
    def __init__(self, param: _Optional[str] = ..., uri: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., sha256: _Optional[str] = ..., packed: _Optional[bool] = ..., layout: _Optional[_Union[Layout, str]] = ..., quant: _Optional[str] = ...) -> None: ...

class ShapeBucket(_message.Message):
    __slots__ = ("dims",)
    class DimsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.ScalarMap[str, int]
    def __init__(self, dims: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("spec", "jax", "jaxlib", "serialization_version", "calling_convention_version", "stablehlo")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    JAX_FIELD_NUMBER: _ClassVar[int]
    JAXLIB_FIELD_NUMBER: _ClassVar[int]
    SERIALIZATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLING_CONVENTION_VERSION_FIELD_NUMBER: _ClassVar[int]
    STABLEHLO_FIELD_NUMBER: _ClassVar[int]
    spec: str
    jax: str
    jaxlib: str
    serialization_version: int
    calling_convention_version: int
    stablehlo: str
    def __init__(self, spec: _Optional[str] = ..., jax: _Optional[str] = ..., jaxlib: _Optional[str] = ..., serialization_version: _Optional[int] = ..., calling_convention_version: _Optional[int] = ..., stablehlo: _Optional[str] = ...) -> None: ...

class StageSpec(_message.Message):
    __slots__ = ("spec_version", "model", "stage_index", "num_stages", "artifact_digest", "artifact", "inputs", "outputs", "state", "weights", "device", "next_hop", "buckets", "versions", "platforms", "stage_id", "control", "next_data_hop", "any_shape")
    SPEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NEXT_HOP_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PLATFORMS_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    NEXT_DATA_HOP_FIELD_NUMBER: _ClassVar[int]
    ANY_SHAPE_FIELD_NUMBER: _ClassVar[int]
    spec_version: str
    model: str
    stage_index: int
    num_stages: int
    artifact_digest: str
    artifact: bytes
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSig]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSig]
    state: _containers.RepeatedCompositeFieldContainer[StateSig]
    weights: _containers.RepeatedCompositeFieldContainer[WeightRef]
    device: str
    next_hop: str
    buckets: _containers.RepeatedCompositeFieldContainer[ShapeBucket]
    versions: Versions
    platforms: _containers.RepeatedScalarFieldContainer[str]
    stage_id: str
    control: _containers.RepeatedScalarFieldContainer[str]
    next_data_hop: str
    any_shape: bool
    def __init__(self, spec_version: _Optional[str] = ..., model: _Optional[str] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., artifact_digest: _Optional[str] = ..., artifact: _Optional[bytes] = ..., inputs: _Optional[_Iterable[_Union[TensorSig, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSig, _Mapping]]] = ..., state: _Optional[_Iterable[_Union[StateSig, _Mapping]]] = ..., weights: _Optional[_Iterable[_Union[WeightRef, _Mapping]]] = ..., device: _Optional[str] = ..., next_hop: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[ShapeBucket, _Mapping]]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., platforms: _Optional[_Iterable[str]] = ..., stage_id: _Optional[str] = ..., control: _Optional[_Iterable[str]] = ..., next_data_hop: _Optional[str] = ..., any_shape: _Optional[bool] = ...) -> None: ...

class RemoteError(_message.Message):
    __slots__ = ("code", "type", "message", "traceback", "stage", "address")
    CODE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    code: str
    type: str
    message: str
    traceback: str
    stage: int
    address: str
    def __init__(self, code: _Optional[str] = ..., type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ..., stage: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class StepControl(_message.Message):
    __slots__ = ("slot", "pos", "length", "temperature", "top_k", "top_p", "seed")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    slot: _containers.RepeatedScalarFieldContainer[int]
    pos: _containers.RepeatedScalarFieldContainer[int]
    length: _containers.RepeatedScalarFieldContainer[int]
    temperature: _containers.RepeatedScalarFieldContainer[float]
    top_k: _containers.RepeatedScalarFieldContainer[int]
    top_p: _containers.RepeatedScalarFieldContainer[float]
    seed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[_Iterable[int]] = ..., pos: _Optional[_Iterable[int]] = ..., length: _Optional[_Iterable[int]] = ..., temperature: _Optional[_Iterable[float]] = ..., top_k: _Optional[_Iterable[int]] = ..., top_p: _Optional[_Iterable[float]] = ..., seed: _Optional[_Iterable[int]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("pipeline_id", "session_id", "step", "kind", "tensors", "error", "last_chunk", "request_id", "reply_to", "stage", "control", "pipeline_key")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_KEY_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    session_id: str
    step: int
    kind: FrameKind
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    error: RemoteError
    last_chunk: bool
    request_id: int
    reply_to: str
    stage: int
    control: StepControl
    pipeline_key: bytes
    def __init__(self, pipeline_id: _Optional[str] = ..., session_id: _Optional[str] = ..., step: _Optional[int] = ..., kind: _Optional[_Union[FrameKind, str]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., error: _Optional[_Union[RemoteError, _Mapping]] = ..., last_chunk: _Optional[bool] = ..., request_id: _Optional[int] = ..., reply_to: _Optional[str] = ..., stage: _Optional[int] = ..., control: _Optional[_Union[StepControl, _Mapping]] = ..., pipeline_key: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("platform", "index", "kind", "memory_total", "memory_free", "memory_source", "memory_used")
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    platform: str
    index: int
    kind: str
    memory_total: int
    memory_free: int
    memory_source: str
    memory_used: int
    def __init__(self, platform: _Optional[str] = ..., index: _Optional[int] = ..., kind: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_free: _Optional[int] = ..., memory_source: _Optional[str] = ..., memory_used: _Optional[int] = ...) -> None: ...

class LoadedStage(_message.Message):
    __slots__ = ("stage_id", "pipeline_id", "stage_index", "artifact_digest", "model", "weight_bytes", "sessions", "device", "packed_bytes", "dequantized_types", "threaded_shapes", "frames", "compute_seconds", "bytes_in", "bytes_out", "in_flight", "route")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PACKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEQUANTIZED_TYPES_FIELD_NUMBER: _ClassVar[int]
    THREADED_SHAPES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    pipeline_id: str
    stage_index: int
    artifact_digest: str
    model: str
    weight_bytes: int
    sessions: int
    device: str
    packed_bytes: int
    dequantized_types: _containers.RepeatedScalarFieldContainer[str]
    threaded_shapes: _containers.RepeatedScalarFieldContainer[str]
    frames: int
    compute_seconds: float
    bytes_in: int
    bytes_out: int
    in_flight: int
    route: str
    def __init__(self, stage_id: _Optional[str] = ..., pipeline_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., artifact_digest: _Optional[str] = ..., model: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., device: _Optional[str] = ..., packed_bytes: _Optional[int] = ..., dequantized_types: _Optional[_Iterable[str]] = ..., threaded_shapes: _Optional[_Iterable[str]] = ..., frames: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., in_flight: _Optional[int] = ..., route: _Optional[str] = ...) -> None: ...

class StageLoading(_message.Message):
    __slots__ = ("stage_id", "pipeline_id", "stage_index", "phase", "phase_seconds", "seconds", "buckets_done", "buckets", "abandoned")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_DONE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    pipeline_id: str
    stage_index: int
    phase: str
    phase_seconds: float
    seconds: float
    buckets_done: int
    buckets: int
    abandoned: bool
    def __init__(self, stage_id: _Optional[str] = ..., pipeline_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., phase: _Optional[str] = ..., phase_seconds: _Optional[float] = ..., seconds: _Optional[float] = ..., buckets_done: _Optional[int] = ..., buckets: _Optional[int] = ..., abandoned: _Optional[bool] = ...) -> None: ...

class KernelInfo(_message.Message):
    __slots__ = ("version", "types", "targets", "threads", "unavailable_reason", "isa", "cpus")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    ISA_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    version: str
    types: _containers.RepeatedScalarFieldContainer[str]
    targets: _containers.RepeatedScalarFieldContainer[str]
    threads: int
    unavailable_reason: str
    isa: str
    cpus: int
    def __init__(self, version: _Optional[str] = ..., types: _Optional[_Iterable[str]] = ..., targets: _Optional[_Iterable[str]] = ..., threads: _Optional[int] = ..., unavailable_reason: _Optional[str] = ..., isa: _Optional[str] = ..., cpus: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("address", "worker_version", "versions", "devices", "default_device", "stages", "sessions", "max_sessions", "rss_bytes", "uptime_s", "artifacts", "min_serialization_version", "max_serialization_version", "kernels", "loading", "data_port", "upload_bytes", "inflight_bytes", "streams", "artifact_cache_bytes", "artifact_cache_max_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DEVICE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    MIN_SERIALIZATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SERIALIZATION_VERSION_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_CACHE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_version: str
    versions: Versions
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    default_device: str
    stages: _containers.RepeatedCompositeFieldContainer[LoadedStage]
    sessions: int
    max_sessions: int
    rss_bytes: int
    uptime_s: float
    artifacts: _containers.RepeatedScalarFieldContainer[str]
    min_serialization_version: int
    max_serialization_version: int
    kernels: KernelInfo
    loading: _containers.RepeatedCompositeFieldContainer[StageLoading]
    data_port: int
    upload_bytes: int
    inflight_bytes: int
    streams: int
    artifact_cache_bytes: int
    artifact_cache_max_bytes: int
    def __init__(self, address: _Optional[str] = ..., worker_version: _Optional[str] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., default_device: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[LoadedStage, _Mapping]]] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., artifacts: _Optional[_Iterable[str]] = ..., min_serialization_version: _Optional[int] = ..., max_serialization_version: _Optional[int] = ..., kernels: _Optional[_Union[KernelInfo, _Mapping]] = ..., loading: _Optional[_Iterable[_Union[StageLoading, _Mapping]]] = ..., data_port: _Optional[int] = ..., upload_bytes: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., streams: _Optional[int] = ..., artifact_cache_bytes: _Optional[int] = ..., artifact_cache_max_bytes: _Optional[int] = ...) -> None: ...

class ArtifactQuery(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class ArtifactPresence(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: bool
    def __init__(self, present: _Optional[bool] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("digest", "data", "total_bytes")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    digest: str
    data: bytes
    total_bytes: int
    def __init__(self, digest: _Optional[str] = ..., data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("digest", "stored", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    stored: bool
    size: int
    def __init__(self, digest: _Optional[str] = ..., stored: _Optional[bool] = ..., size: _Optional[int] = ...) -> None: ...

class LoadStageRequest(_message.Message):
    __slots__ = ("spec", "pipeline_id", "lease_s", "pipeline_key")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_KEY_FIELD_NUMBER: _ClassVar[int]
    spec: StageSpec
    pipeline_id: str
    lease_s: float
    pipeline_key: bytes
    def __init__(self, spec: _Optional[_Union[StageSpec, _Mapping]] = ..., pipeline_id: _Optional[str] = ..., lease_s: _Optional[float] = ..., pipeline_key: _Optional[bytes] = ...) -> None: ...

class LoadStageReply(_message.Message):
    __slots__ = ("stage_id", "already_loaded", "bind_s", "compile_s", "weight_bytes", "device", "load_s")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    BIND_S_FIELD_NUMBER: _ClassVar[int]
    COMPILE_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    already_loaded: bool
    bind_s: float
    compile_s: float
    weight_bytes: int
    device: str
    load_s: float
    def __init__(self, stage_id: _Optional[str] = ..., already_loaded: _Optional[bool] = ..., bind_s: _Optional[float] = ..., compile_s: _Optional[float] = ..., weight_bytes: _Optional[int] = ..., device: _Optional[str] = ..., load_s: _Optional[float] = ...) -> None: ...

class UnloadStageRequest(_message.Message):
    __slots__ = ("stage_id",)
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    stage_id: str
    def __init__(self, stage_id: _Optional[str] = ...) -> None: ...

class UnloadStageReply(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class DescribeWeightsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class WeightInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "quant", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    quant: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., quant: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class DescribeWeightsReply(_message.Message):
    __slots__ = ("tensors", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[WeightInfo]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, tensors: _Optional[_Iterable[_Union[WeightInfo, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("pipeline_id", "session_id", "pipeline_key")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_KEY_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    session_id: str
    pipeline_key: bytes
    def __init__(self, pipeline_id: _Optional[str] = ..., session_id: _Optional[str] = ..., pipeline_key: _Optional[bytes] = ...) -> None: ...

class EndSessionReply(_message.Message):
    __slots__ = ("freed_stages", "freed_bytes")
    FREED_STAGES_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_stages: int
    freed_bytes: int
    def __init__(self, freed_stages: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: int
    def __init__(self, frames: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("pipeline_id", "reply_to", "pipeline_key")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_KEY_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    reply_to: str
    pipeline_key: bytes
    def __init__(self, pipeline_id: _Optional[str] = ..., reply_to: _Optional[str] = ..., pipeline_key: _Optional[bytes] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("result", "error", "heartbeat", "request_id", "session_id")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    result: Frame
    error: RemoteError
    heartbeat: float
    request_id: int
    session_id: str
    def __init__(self, result: _Optional[_Union[Frame, _Mapping]] = ..., error: _Optional[_Union[RemoteError, _Mapping]] = ..., heartbeat: _Optional[float] = ..., request_id: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

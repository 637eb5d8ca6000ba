from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_STANDARD: _ClassVar[Priority]
    PRIORITY_CRITICAL: _ClassVar[Priority]
    PRIORITY_SHEDDABLE: _ClassVar[Priority]
PRIORITY_STANDARD: Priority
PRIORITY_CRITICAL: Priority
PRIORITY_SHEDDABLE: Priority

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "structured")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "grammar", "choice")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    choice: ChoiceList
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Slo(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "chat", "prompt_token_ids", "sampling", "slo", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    chat: Chat
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    slo: Slo
    priority: Priority
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., slo: _Optional[_Union[Slo, _Mapping]] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "decode_s", "ttft_s", "e2e_s", "prefill_instance", "decode_instance", "predicted_ttft_s", "predicted_tpot_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    ttft_s: float
    e2e_s: float
    prefill_instance: str
    decode_instance: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_tpot_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "usage", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: str
    usage: Usage
    timings: Timings
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "role", "kv_address", "healthy", "num_running", "num_waiting", "kv_cache_usage", "tensor_parallel_size", "pipeline_parallel_size", "heartbeat_age_s", "num_free_blocks", "num_total_blocks", "latency_model", "kv_paths", "kv_tiers")
    class KvPathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class KvTiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_PATHS_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    kv_address: str
    healthy: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    heartbeat_age_s: float
    num_free_blocks: int
    num_total_blocks: int
    latency_model: LatencyModel
    kv_paths: _containers.ScalarMap[str, str]
    kv_tiers: _containers.ScalarMap[str, float]
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., kv_address: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., latency_model: _Optional[_Union[LatencyModel, _Mapping]] = ..., kv_paths: _Optional[_Mapping[str, str]] = ..., kv_tiers: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LatencyModel(_message.Message):
    __slots__ = ("prefill", "decode", "recent_error", "num_steps", "calibrated")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    RECENT_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    prefill: _containers.RepeatedScalarFieldContainer[float]
    decode: _containers.RepeatedScalarFieldContainer[float]
    recent_error: float
    num_steps: int
    calibrated: bool
    def __init__(self, prefill: _Optional[_Iterable[float]] = ..., decode: _Optional[_Iterable[float]] = ..., recent_error: _Optional[float] = ..., num_steps: _Optional[int] = ..., calibrated: _Optional[bool] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("role", "instances")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    role: str
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, role: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("pools", "model", "mode", "default_slo", "replan", "replan_decisions")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SLO_FIELD_NUMBER: _ClassVar[int]
    REPLAN_FIELD_NUMBER: _ClassVar[int]
    REPLAN_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    model: str
    mode: str
    default_slo: Slo
    replan: bool
    replan_decisions: _containers.RepeatedCompositeFieldContainer[ReplanDecision]
    def __init__(self, pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., model: _Optional[str] = ..., mode: _Optional[str] = ..., default_slo: _Optional[_Union[Slo, _Mapping]] = ..., replan: _Optional[bool] = ..., replan_decisions: _Optional[_Iterable[_Union[ReplanDecision, _Mapping]]] = ...) -> None: ...

class ReplanDecision(_message.Message):
    __slots__ = ("unix_time", "current", "best", "predicted_gain", "reason", "switched_instance", "switch_outcome", "switch_seconds", "check_outcome", "predicted_attainment", "measured_attainment", "predicted_goodput", "measured_goodput", "stay_attainment", "predicted_stay_attainment", "step_kind")
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECK_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    STAY_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STAY_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    STEP_KIND_FIELD_NUMBER: _ClassVar[int]
    unix_time: float
    current: str
    best: str
    predicted_gain: float
    reason: str
    switched_instance: str
    switch_outcome: str
    switch_seconds: float
    check_outcome: str
    predicted_attainment: float
    measured_attainment: float
    predicted_goodput: float
    measured_goodput: float
    stay_attainment: float
    predicted_stay_attainment: float
    step_kind: str
    def __init__(self, unix_time: _Optional[float] = ..., current: _Optional[str] = ..., best: _Optional[str] = ..., predicted_gain: _Optional[float] = ..., reason: _Optional[str] = ..., switched_instance: _Optional[str] = ..., switch_outcome: _Optional[str] = ..., switch_seconds: _Optional[float] = ..., check_outcome: _Optional[str] = ..., predicted_attainment: _Optional[float] = ..., measured_attainment: _Optional[float] = ..., predicted_goodput: _Optional[float] = ..., measured_goodput: _Optional[float] = ..., stay_attainment: _Optional[float] = ..., predicted_stay_attainment: _Optional[float] = ..., step_kind: _Optional[str] = ...) -> None: ...

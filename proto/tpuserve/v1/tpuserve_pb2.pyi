from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "chat_template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    chat_template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "lark_grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    lark_grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., lark_grammar: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str: bool
    def __init__(self, max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str: _Optional[bool] = ...) -> None: ...

class LogprobOptions(_message.Message):
    __slots__ = ("enabled", "top_logprobs", "prompt_logprobs")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    top_logprobs: int
    prompt_logprobs: bool
    def __init__(self, enabled: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "stopping", "logprobs", "n", "add_special_tokens", "cache_salt", "guided", "return_prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    stopping: StoppingCriteria
    logprobs: LogprobOptions
    n: int
    add_special_tokens: bool
    cache_salt: str
    guided: GuidedDecoding
    return_prompt_token_ids: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., logprobs: _Optional[_Union[LogprobOptions, _Mapping]] = ..., n: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token_bytes", "logprob", "special_text", "special")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token_bytes: bytes
    logprob: float
    special_text: str
    special: bool
    def __init__(self, token_id: _Optional[int] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., special_text: _Optional[str] = ..., special: _Optional[bool] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("index", "token_id", "token_bytes", "special_text", "logprob", "special", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_id: int
    token_bytes: bytes
    special_text: str
    logprob: float
    special: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, index: _Optional[int] = ..., token_id: _Optional[int] = ..., token_bytes: _Optional[bytes] = ..., special_text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "tokens", "text", "prompt_tokens", "finish_reason", "stop_reason", "stop_token_id", "finished", "prompt_tokens_count", "cached_prompt_tokens_count", "completion_tokens_count", "error_message", "prompt_token_ids", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COUNT_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    text: str
    prompt_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: FinishReason
    stop_reason: str
    stop_token_id: int
    finished: bool
    prompt_tokens_count: int
    cached_prompt_tokens_count: int
    completion_tokens_count: int
    error_message: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., text: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., prompt_tokens_count: _Optional[int] = ..., cached_prompt_tokens_count: _Optional[int] = ..., completion_tokens_count: _Optional[int] = ..., error_message: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("chat",)
    CHAT_FIELD_NUMBER: _ClassVar[int]
    chat: ChatMessages
    def __init__(self, chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("prompt", "token_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "context_length", "max_top_logprobs", "eos_token_ids", "dtype", "mesh_shape", "mesh_axes", "slots", "max_n", "created", "readiness", "weight_bytes", "quantization", "num_processes", "pages", "weight_version", "served_model_names")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MESH_SHAPE_FIELD_NUMBER: _ClassVar[int]
    MESH_AXES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    READINESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    context_length: int
    max_top_logprobs: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    mesh_shape: _containers.RepeatedScalarFieldContainer[int]
    mesh_axes: _containers.RepeatedScalarFieldContainer[str]
    slots: int
    max_n: int
    created: int
    readiness: str
    weight_bytes: int
    quantization: str
    num_processes: int
    pages: PageCounts
    weight_version: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., max_top_logprobs: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., mesh_shape: _Optional[_Iterable[int]] = ..., mesh_axes: _Optional[_Iterable[str]] = ..., slots: _Optional[int] = ..., max_n: _Optional[int] = ..., created: _Optional[int] = ..., readiness: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., quantization: _Optional[str] = ..., num_processes: _Optional[int] = ..., pages: _Optional[_Union[PageCounts, _Mapping]] = ..., weight_version: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path", "weight_version", "abort_in_flight")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    abort_in_flight: bool
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ..., abort_in_flight: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("success", "message", "weight_version", "num_aborted")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    weight_version: str
    num_aborted: int
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., weight_version: _Optional[str] = ..., num_aborted: _Optional[int] = ...) -> None: ...

class PageCounts(_message.Message):
    __slots__ = ("page_tokens", "total", "used", "shared", "cached", "free", "preemptions")
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    page_tokens: int
    total: int
    used: int
    shared: int
    cached: int
    free: int
    preemptions: int
    def __init__(self, page_tokens: _Optional[int] = ..., total: _Optional[int] = ..., used: _Optional[int] = ..., shared: _Optional[int] = ..., cached: _Optional[int] = ..., free: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

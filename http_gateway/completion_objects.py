"""The bodies the chat and completions endpoints answer with, in OpenAI's shapes (chat.completion and its chunk,
text_completion, usage, logprobs), plus /v1/models' model list and the error body. `OpenAIObject` is the base of
every answer object, the Responses API's (responses_objects.py) included.

Serialize with `dump()`: fields left unset are omitted (a chunk's `delta` holds only what it carries, `usage`
appears only when asked); every field the spec requires is always set explicitly by the renderers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class OpenAIObject(BaseModel):
    def dump(self) -> str:
        return self.model_dump_json(exclude_unset=True)


class TopLogprob(OpenAIObject):
    token: str
    bytes: list[int] | None  # None: a special token, which has no bytes representation
    logprob: float


class TokenLogprob(OpenAIObject):
    token: str
    bytes: list[int] | None
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIObject):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class PromptTokensDetails(OpenAIObject):
    cached_tokens: int  # prompt tokens whose KV came from the backend's prefix cache


class Usage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class FunctionCallOut(OpenAIObject):
    name: str
    arguments: str  # JSON text


class ToolCallOut(OpenAIObject):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(OpenAIObject):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCallOut] | None = None  # set only when the model called tools


class ChatChoice(OpenAIObject):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    token_ids: list[int] | None = None  # vLLM's return_token_ids: set only when asked


class PromptLogprob(OpenAIObject):
    """vLLM's `Logprob` of a prompt position's token: its rank in the whole vocabulary (1 = most likely; null
    when beyond the backend's top-20, where the exact rank is not known here)."""

    logprob: float
    rank: int | None
    decoded_token: str


class ChatCompletion(OpenAIObject):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    # the weights' version (UpdateWeights' weight_version): changes when the served weights do
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's extensions, set only when asked: keys are token ids (JSON object keys are strings)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None


class FunctionCallChunk(OpenAIObject):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(OpenAIObject):
    """A streamed fragment of tool call `index`: id, type and name come on its first fragment."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallChunk | None = None


class Delta(OpenAIObject):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(OpenAIObject):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None  # return_token_ids: the ids of this chunk's tokens


class ChatCompletionChunk(OpenAIObject):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    # the weights' version (UpdateWeights' weight_version): changes when the served weights do
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on each choice's first chunk


class CompletionLogprobsOut(OpenAIObject):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(OpenAIObject):
    index: int
    text: str
    logprobs: CompletionLogprobsOut | None
    finish_reason: str | None
    # vLLM's return_token_ids, set only when asked (streamed: prompt ids on the choice's first chunk)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(OpenAIObject):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    # the weights' version (UpdateWeights' weight_version): changes when the served weights do
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(OpenAIObject):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(OpenAIObject):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(OpenAIObject):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(OpenAIObject):
    """Every error body (errors.APIError renders it); here for the OpenAPI document."""

    error: ErrorDetail

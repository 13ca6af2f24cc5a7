"""/v1/responses (the OpenAI Responses API): the Response object and its output items, as the gateway sends them
(responses_answer.py fills them in; its stream events are in responses_events.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer
from tpuserve.http_gateway.completion_objects import OpenAIObject, TokenLogprob


class ResponsesObject(OpenAIObject):
    """The base of the Responses API's objects: dumped with every field, nulls included (the spec requires many
    nullable keys to be present)."""

    def dump(self) -> str:
        return self.model_dump_json(by_alias=True)


class ResponseOutputText(ResponsesObject):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class ResponseOutputMessage(ResponsesObject):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(ResponsesObject):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = ResponseOutputMessage | ResponseFunctionCall


class ResponseInputTokensDetails(ResponsesObject):
    cached_tokens: int  # prompt tokens whose KV came from the backend's prefix cache
    cache_write_tokens: int = 0


class ResponseOutputTokensDetails(ResponsesObject):
    reasoning_tokens: int = 0


class ResponseUsage(ResponsesObject):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached: int) -> ResponseUsage:
        return cls(
            input_tokens=input_tokens,
            input_tokens_details=ResponseInputTokensDetails(cached_tokens=cached),
            output_tokens=output_tokens,
            output_tokens_details=ResponseOutputTokensDetails(),
            total_tokens=input_tokens + output_tokens,
        )


class ResponseIncompleteDetails(ResponsesObject):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseReasoning(ResponsesObject):
    effort: None = None
    summary: None = None


class ResponseText(ResponsesObject):
    format: dict[str, Any]
    verbosity: Literal["medium"] = "medium"


class ResponseFunctionTool(ResponsesObject):
    type: Literal["function"] = "function"
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class Response(ResponsesObject):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "in_progress", "incomplete", "failed"]
    completed_at: int | None = None
    background: bool = False
    error: None = None
    incomplete_details: ResponseIncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None = None
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: ResponseReasoning = Field(default_factory=ResponseReasoning)
    safety_identifier: str | None
    service_tier: Literal["default"] = "default"
    store: bool = False
    temperature: float
    text: ResponseText
    tool_choice: str | dict[str, Any]
    tools: list[ResponseFunctionTool]
    top_logprobs: int
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None  # None (left out) until the response is finished
    user: str | None = None
    metadata: dict[str, str]
    # the weights' version, as chat completions carry it (an extension: the spec's response has no such field)
    system_fingerprint: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls_the_spec_refuses(self, handler):
        """`usage`, `user` and `system_fingerprint` are left out when None: the spec's are an object and strings,
        not nullable. (Unannotated on purpose: with a return annotation the JSON schema would be that type, not
        the model's.)"""
        data = handler(self)
        for key in ("usage", "user", "system_fingerprint"):
            if key in data and data[key] is None:
                del data[key]
        return data

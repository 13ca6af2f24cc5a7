"""Request bodies of /v1/chat/completions and /v1/completions with the OpenAI spec's bounds.

`extra="forbid"`: a field we do not implement is a 400 naming it, never silently dropped. Fields that SDKs and
LangChain send with neutral defaults (penalties 0, empty `logit_bias`, `response_format` text) are accepted and
anything else in them is rejected by `check_supported`, which also checks what one field says of another (tool
messages answer earlier calls, a named tool_choice names a given tool).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.errors import invalid_request, missing_parameter, unsupported
from tpuserve.http_gateway.structured import ResponseFormat

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 16  # OpenAI allows 4; more is harmless here

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
N = Annotated[int, Field(ge=1, le=128)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
INT32_MAX = 2**31 - 1  # the proto's int32 max_tokens: a larger value would fail as a 500 when mapped
MAX_CACHE_SALT = 256  # characters (the backend's bound too)
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)]  # vLLM rejects an empty salt too


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(_Strict):
    """An earlier assistant turn's call, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCallIn


class ChatMessage(_Strict):
    """One message of any role. `content` may be null (or absent) only on an assistant turn with `tool_calls`;
    `tool_calls` belong to assistant turns, `tool_call_id` (required) and `name` to tool turns: `check` says so
    with the field named."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(min_length=1)] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def check(self, where: str) -> None:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise missing_parameter(f"{where}.content")
        if self.tool_calls is not None and self.role != "assistant":
            raise _not_for_role(where, "tool_calls", "assistant")
        for k, call in enumerate(self.tool_calls or []):
            try:
                json.loads(call.function.arguments)
            except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply for the parser
                param = f"{where}.tool_calls[{k}].function.arguments"
                raise invalid_request(f"Invalid '{param}': not valid JSON.", param, "invalid_value") from None
        if self.role == "tool":
            if self.tool_call_id is None:
                raise missing_parameter(f"{where}.tool_call_id")
        else:
            for name in ("tool_call_id", "name"):
                if getattr(self, name) is not None:
                    raise _not_for_role(where, name, "tool")


def _not_for_role(where: str, name: str, role: str) -> Exception:
    return invalid_request(
        f"Invalid parameter: '{where}.{name}' is only allowed on messages with role '{role}'.",
        f"{where}.{name}",
        "invalid_value",
    )


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Each message's own rules, and every `tool` message answers a call of an earlier assistant turn (an
    orphan result cannot be rendered as the answer to anything)."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        m.check(f"messages[{i}]")
        if m.tool_calls:
            calls.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in calls:
            raise invalid_request(
                f"Invalid parameter: messages with role 'tool' must be a response to a preceding message with "
                f"'tool_calls'; 'messages[{i}].tool_call_id' ('{str(m.tool_call_id)[:80]}') answers none.",
                f"messages[{i}].tool_call_id",
                "invalid_value",
            )


class _Common(_Strict):
    """Fields shared by both endpoints."""

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: N | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # end-user id for abuse tracking: accepted, not used for generation
    logit_bias: dict[str, int] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    cache_salt: CacheSalt | None = Field(
        None,
        description="vLLM's cache_salt: requests with different salts never share cached prompt prefixes "
        "(tenants cannot learn of each other's prompts from timing). Absent: the shared default namespace.",
    )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        if self.logit_bias:
            raise unsupported("logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, "Only 0 is accepted.")
        if self.stream_options is not None and not self.stream:
            raise invalid_request(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options"
            )


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[fn_tools.ChatTool], Field(max_length=fn_tools.MAX_TOOLS)] | None = None
    tool_choice: fn_tools.ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's extension: `prompt_token_ids` (the rendered prompt) and each choice's `token_ids` (the "
        "ids of exactly the tokens `logprobs.content` would list); streamed: prompt ids on each choice's first "
        "chunk, token ids of each chunk's tokens.",
    )
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = Field(
        None,
        description="vLLM's extension: `prompt_logprobs`, one entry per prompt token (the first null), each "
        "{token id: {logprob, rank, decoded_token}} for the prompt token and the k most likely. Not streamed.",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's extension: further variables for the model's chat template, e.g. "
        '{"enable_thinking": false} for Qwen3. They may not set messages, tools or add_generation_prompt.',
    )

    def check_supported(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
        check_tool_messages(self.messages)
        if self.response_format is not None:
            self.response_format.check()
        specs = self.functions()
        fn_tools.check_functions(specs)
        fn_tools.check_choice(self.tool_choice, specs)
        if self.forced_tool_call() and self.structured():
            raise invalid_request(
                "'response_format' cannot be combined with a forced tool call ('tool_choice' \"required\" or a "
                "named function): the output is then the call.",
                "response_format",
                "invalid_value",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise invalid_request(
                "'prompt_logprobs' is not available when 'stream' is true.",
                "prompt_logprobs",
                "invalid_value",
            )

    def functions(self) -> list[fn_tools.FunctionSpec]:
        return fn_tools.chat_functions(self.tools or [])

    def choice(self) -> fn_tools.ToolChoice:
        """`tool_choice` with OpenAI's default ("auto" with tools, else "none")."""
        return fn_tools.effective_choice(self.tool_choice, self.functions())

    def forced_tool_call(self) -> bool:
        return self.choice() not in ("none", "auto")

    def structured(self) -> bool:
        """A `response_format` other than text: the output is constrained JSON, never parsed for calls."""
        return self.response_format is not None and self.response_format.type != "text"

    def offers_tools(self) -> bool:
        """Tools are rendered for the model (and its output parsed for calls): tools given, choice not "none",
        and no structured format taking over the output."""
        return bool(self.tools) and self.choice() != "none" and not self.structured()

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    suffix: str | None = None
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's extension: each choice gets `prompt_token_ids` (its prompt's ids) and `token_ids` (the "
        "generated ids, the EOS included, as in `logprobs`; echoed prompt tokens are in `prompt_token_ids`).",
    )

    def check_supported(self) -> None:
        self.check_common()
        if self.suffix is not None:
            raise unsupported("suffix")
        if self.best_of is not None:
            if self.best_of < (self.n or 1):
                raise invalid_request("'best_of' must be greater than or equal to 'n'.", "best_of")
            if self.stream and self.best_of > (self.n or 1):
                raise invalid_request("'best_of' cannot be used with 'stream'.", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

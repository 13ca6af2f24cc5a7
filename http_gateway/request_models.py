"""Request bodies of /v1/chat/completions and /v1/completions with the OpenAI spec's bounds.

`extra="forbid"`: a field we do not implement is a 400 naming it, never silently dropped. Fields that SDKs and
LangChain send with neutral defaults (penalties 0, empty `logit_bias`, `response_format` text) are accepted and
anything else in them is rejected by `check_supported`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from tpuserve.http_gateway.errors import invalid_request, unsupported

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


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

    def check_supported(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")

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

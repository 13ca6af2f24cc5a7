"""/v1/chat/completions: request -> `GenerateRequest.chat`, backend stream -> chat completion or SSE chunks.

EOS (or another special token) that ended a sample is neither in `content`, nor in `logprobs.content`, nor
counted in `completion_tokens`, as OpenAI does; the backend sends it as the sample's last token and counts it.
`ShownTokens` holds that rule for both the JSON and the SSE answer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from tpuserve.http_gateway import observability, proto_mapping
from tpuserve.http_gateway.backends import BackendPool, GenerateStream
from tpuserve.http_gateway.logprobs import chat_logprobs
from tpuserve.http_gateway.request_models import ChatCompletionRequest
from tpuserve.http_gateway.response_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessageOut,
    Delta,
    Usage,
)
from tpuserve.http_gateway.samples import collect, finish_reason, messages
from tpuserve.http_gateway.sse import sse_stream
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn


def to_proto(req: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text()) for m in req.messages]
    )
    msg = pb.GenerateRequest(
        request_id=request_id,
        chat=chat,
        sampling=proto_mapping.sampling(req.temperature, req.top_p, req.seed),
        stopping=proto_mapping.stopping(req.token_limit(), req.stop_list()),
        logprobs=pb.LogprobOptions(enabled=bool(req.logprobs), top_logprobs=req.top_logprobs or 0),
        n=req.n or 1,
    )
    return proto_mapping.cache_salt(msg, req.cache_salt)


class ShownTokens:
    """One sample's tokens as chat shows them, fed message by message (or all at once with the final message).

    A trailing special token waits for the sample's next message: it may be the EOS (or stop token) that ends
    the sample, which is dropped from the entries and from `completion_tokens`.
    """

    def __init__(self) -> None:
        self._held: list[pb.Token] = []
        self._dropped = 0

    def feed(self, tokens: Sequence[pb.Token], final: pb.GenerateResponse | None) -> list[pb.Token]:
        """The tokens to show now; `final` is the sample's finishing message when `tokens` end the sample."""
        shown = self._held + list(tokens)
        self._held = []
        if final is None:
            if shown and shown[-1].special:
                self._held = [shown.pop()]
        elif _ends_with_stop_token(shown, final):
            shown.pop()
            self._dropped = 1
        return shown

    def completion_tokens(self, final: pb.GenerateResponse) -> int:
        """The sample's `completion_tokens`: the backend's count less the dropped EOS."""
        return final.completion_tokens_count - self._dropped


def _ends_with_stop_token(tokens: list[pb.Token], final: pb.GenerateResponse) -> bool:
    """True when the last token is the special token (EOS or a stop token id) that ended the sample."""
    return (
        bool(tokens)
        and tokens[-1].special
        and final.finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP)
        and not final.stop_reason
    )


async def create(pool: BackendPool, req: ChatCompletionRequest) -> ChatCompletion | AsyncIterator[str]:
    request_id = observability.new_request_id("chatcmpl")
    stream = await pool.generate(req.model, to_proto(req, request_id))
    if req.stream:
        return sse_stream(_chunks(stream, req, request_id))
    return await _complete(stream, req, request_id)


async def _complete(stream: GenerateStream, req: ChatCompletionRequest, request_id: str) -> ChatCompletion:
    gen = await collect(stream, req.n or 1)
    choices: list[ChatChoice] = []
    completion_tokens = 0
    for i in sorted(gen.samples):
        s = gen.samples[i]
        assert s.final is not None
        shown = ShownTokens()
        tokens = shown.feed(s.tokens, s.final)
        completion_tokens += shown.completion_tokens(s.final)
        choices.append(
            ChatChoice(
                index=i,
                message=ChatMessageOut(role="assistant", content=s.text, refusal=None),
                logprobs=chat_logprobs(tokens, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish_reason(s.final),
            )
        )
    return ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=Usage.of(gen.prompt_tokens_count, completion_tokens, gen.cached_prompt_tokens_count),
    )


async def _chunks(stream: GenerateStream, req: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage()

    def chunk(choices: list[ChatChunkChoice]) -> str:
        c = ChatCompletionChunk(
            id=request_id, object="chat.completion.chunk", created=created, model=req.model, choices=choices
        )
        if include_usage:
            c.usage = None  # present (null) on every chunk but the last, as OpenAI sends it
        return c.dump()

    for i in range(req.n or 1):
        yield chunk(
            [
                ChatChunkChoice(
                    index=i, delta=Delta(role="assistant", content=""), logprobs=None, finish_reason=None
                )
            ]
        )
    prompt_tokens = cached_tokens = completion_tokens = 0
    shown: dict[int, ShownTokens] = {}
    async for msg in messages(stream):
        sample = shown.setdefault(msg.index, ShownTokens())
        tokens = sample.feed(msg.tokens, msg if msg.finished else None)
        if msg.text or tokens:
            logprobs = chat_logprobs(tokens, req.top_logprobs or 0) if req.logprobs else None
            yield chunk(
                [
                    ChatChunkChoice(
                        index=msg.index, delta=Delta(content=msg.text), logprobs=logprobs, finish_reason=None
                    )
                ]
            )
        if msg.finished:
            prompt_tokens = max(prompt_tokens, msg.prompt_tokens_count)
            cached_tokens = max(cached_tokens, msg.cached_prompt_tokens_count)  # one prompt: the same on each
            completion_tokens += sample.completion_tokens(msg)
            yield chunk(
                [
                    ChatChunkChoice(
                        index=msg.index, delta=Delta(), logprobs=None, finish_reason=finish_reason(msg)
                    )
                ]
            )
    if include_usage:
        yield ChatCompletionChunk(
            id=request_id,
            object="chat.completion.chunk",
            created=created,
            model=req.model,
            choices=[],
            usage=Usage.of(prompt_tokens, completion_tokens, cached_tokens),
        ).dump()

"""/v1/chat/completions: request -> `GenerateRequest.chat`, backend stream -> chat completion or SSE chunks.

EOS (or another special token) that ended a sample is neither in `content`, nor in `logprobs.content`, nor
counted in `completion_tokens`, as OpenAI does; the backend sends it as the sample's last token and counts it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

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
from tpuserve.http_gateway.samples import collect, ends_with_stop_token, finish_reason, messages
from tpuserve.http_gateway.sse import sse_stream
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn


def to_proto(req: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text()) for m in req.messages]
    )
    return pb.GenerateRequest(
        request_id=request_id,
        chat=chat,
        sampling=proto_mapping.sampling(req.temperature, req.top_p, req.seed),
        stopping=proto_mapping.stopping(req.token_limit(), req.stop_list()),
        logprobs=pb.LogprobOptions(enabled=bool(req.logprobs), top_logprobs=req.top_logprobs or 0),
        n=req.n or 1,
    )


def _visible(tokens: list[pb.Token], final: pb.GenerateResponse | None) -> tuple[list[pb.Token], int]:
    """The tokens shown in content, and how many (0 or 1) ending special tokens were dropped."""
    if final is not None and ends_with_stop_token(tokens, final):
        return tokens[:-1], 1
    return tokens, 0


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
        tokens, dropped = _visible(s.tokens, s.final)
        completion_tokens += s.final.completion_tokens_count - dropped
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
        usage=Usage.of(gen.prompt_tokens_count, completion_tokens),
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
    prompt_tokens = completion_tokens = 0
    # A trailing special token waits for the sample's next message: it may be the EOS that ends the sample.
    held: dict[int, list[pb.Token]] = {}
    async for msg in messages(stream):
        tokens = held.pop(msg.index, []) + list(msg.tokens)
        if not msg.finished and tokens and tokens[-1].special:
            held[msg.index] = [tokens.pop()]
        tokens, dropped = _visible(tokens, msg if msg.finished else None)
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
            completion_tokens += msg.completion_tokens_count - dropped
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
            usage=Usage.of(prompt_tokens, completion_tokens),
        ).dump()

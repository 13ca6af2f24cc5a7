"""/v1/chat/completions: request -> `GenerateRequest.chat`, backend stream -> chat completion or SSE chunks.

EOS (or another special token) that ended a sample is neither in `content`, nor in `logprobs.content`, nor
counted in `completion_tokens`, as OpenAI does; the backend sends it as the sample's last token and counts it.
`ShownTokens` holds that rule for both the JSON and the SSE answer.

Structured outputs (`response_format`) and forced tool calls go to the backend as a grammar (`guided`); tools
go as `tools_json`. When tools are offered, each sample's text is parsed for calls (tools.py); streamed, the
text that may be a call is held until the sample ends (`ToolCallStream`), everything else streams as it comes;
the calls then come as `delta.tool_calls` fragments (per call: id, type and name with empty arguments, then the
arguments), the first carrying the held tokens' logprobs. `return_token_ids` and `prompt_logprobs` are vLLM's
extensions, in vLLM's shapes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

from tpuserve.http_gateway import observability, proto_mapping
from tpuserve.http_gateway.backend_messages import collect, finish_reason, messages
from tpuserve.http_gateway.backends import BackendPool, GenerateStream
from tpuserve.http_gateway.completion_objects import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessageOut,
    Delta,
    FunctionCallChunk,
    FunctionCallOut,
    PromptLogprob,
    ToolCallChunk,
    ToolCallOut,
    Usage,
)
from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.logprobs import chat_logprobs, finite, token_text
from tpuserve.http_gateway.request_models import ChatCompletionRequest, ChatMessage
from tpuserve.http_gateway.sse import sse_stream
from tpuserve.http_gateway.structured import name_guided_error
from tpuserve.http_gateway.tools import (
    ParsedOutput,
    Piece,
    ToolCallStream,
    forced_call_grammar,
    new_call_id,
    parse_tool_calls,
    tools_json,
)
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn
PROMPT_RANK_K = 20  # alternatives asked for prompt_logprobs: the prompt token's rank is exact up to this


def _message(m: ChatMessage) -> pb.ChatMessage:
    msg = pb.ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text())
    for call in m.tool_calls or []:
        msg.tool_calls.append(
            pb.ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
        )
    if m.tool_call_id is not None:
        msg.tool_call_id = m.tool_call_id
    if m.name is not None:
        msg.name = m.name
    return msg


def _guided(req: ChatCompletionRequest) -> pb.GuidedDecoding | None:
    """The grammar: a forced tool call's, else the response format's, else none."""
    if req.forced_tool_call():
        return forced_call_grammar(req.functions(), req.choice(), req.parallel_tool_calls is not False)
    if req.response_format is not None:
        return req.response_format.guided()
    return None


def _guided_param(req: ChatCompletionRequest) -> str:
    """The request field a backend's refusal of the grammar is about."""
    return "tools" if req.forced_tool_call() else "response_format"


def to_proto(req: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=[_message(m) for m in req.messages])
    if req.offers_tools():
        chat.tools_json = tools_json(req.functions())
    if req.chat_template_kwargs:
        chat.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)
    prompt_logprobs = req.prompt_logprobs is not None
    msg = pb.GenerateRequest(
        request_id=request_id,
        chat=chat,
        sampling=proto_mapping.sampling(req.temperature, req.top_p, req.seed),
        stopping=proto_mapping.stopping(req.token_limit(), req.stop_list()),
        logprobs=pb.LogprobOptions(
            enabled=bool(req.logprobs) or prompt_logprobs,
            # one k for both: the prompt's asks the most (ranks); chat entries are trimmed to top_logprobs
            top_logprobs=PROMPT_RANK_K if prompt_logprobs else req.top_logprobs or 0,
            prompt_logprobs=prompt_logprobs,
        ),
        n=req.n or 1,
        return_prompt_token_ids=bool(req.return_token_ids),
    )
    guided = _guided(req)
    if guided is not None:
        msg.guided.CopyFrom(guided)
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
    try:
        stream = await pool.generate(req.model, to_proto(req, request_id))
    except APIError as e:
        raise name_guided_error(e, _guided_param(req)) from None
    if req.stream:
        return sse_stream(_chunks(stream, req, request_id))
    return await _complete(stream, req, request_id)


def _tool_calls(parsed: ParsedOutput) -> list[ToolCallOut]:
    return [
        ToolCallOut(
            id=new_call_id(), type="function", function=FunctionCallOut(name=c.name, arguments=c.arguments)
        )
        for c in parsed.calls
    ]


def _token_ids(tokens: Sequence[pb.Token]) -> list[int]:
    return [t.token_id for t in tokens]


def prompt_logprobs(tokens: Sequence[pb.Token], k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token (no prefix), then per token a dict keyed by token
    id (as a string) with the prompt token itself first and the k most likely after it (k or k + 1 keys)."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for t in tokens[1:]:
        ranked = sorted(t.top_logprobs, key=lambda a: -finite(a.logprob))
        own = PromptLogprob(logprob=finite(t.logprob), rank=_rank(t, ranked), decoded_token=token_text(t))
        entry = {str(t.token_id): own}
        for rank, alt in enumerate(ranked[:k], 1):
            entry.setdefault(
                str(alt.token_id),
                PromptLogprob(logprob=finite(alt.logprob), rank=rank, decoded_token=token_text(alt)),
            )
        out.append(entry)
    return out


def _rank(token: pb.Token, ranked: list[pb.TopLogprob]) -> int | None:
    """1 + the number of tokens more likely than `token`: exact when some listed alternative is not more likely
    (then every more likely token is listed); None when all are (the rank is beyond the list)."""
    lp = finite(token.logprob)
    above = sum(1 for a in ranked if finite(a.logprob) > lp)
    return above + 1 if above < len(ranked) else None


async def _complete(stream: GenerateStream, req: ChatCompletionRequest, request_id: str) -> ChatCompletion:
    tap = proto_mapping.PromptIdsTap(stream)
    gen = await collect(tap, req.n or 1)  # type: ignore[arg-type]
    names = [f.name for f in req.functions()] if req.offers_tools() else []
    choices: list[ChatChoice] = []
    completion_tokens = 0
    for i in sorted(gen.samples):
        s = gen.samples[i]
        assert s.final is not None
        shown = ShownTokens()
        tokens = shown.feed(s.tokens, s.final)
        completion_tokens += shown.completion_tokens(s.final)
        message = ChatMessageOut(role="assistant", content=s.text, refusal=None)
        reason = finish_reason(s.final)
        parsed = parse_tool_calls(s.text, names) if names else None
        if parsed is not None:
            message.content = parsed.content
            message.tool_calls = _tool_calls(parsed)
            reason = "tool_calls"
        choice = ChatChoice(
            index=i,
            message=message,
            logprobs=chat_logprobs(tokens, req.top_logprobs or 0) if req.logprobs else None,
            finish_reason=reason,
        )
        if req.return_token_ids:
            choice.token_ids = _token_ids(tokens)
        choices.append(choice)
    completion = ChatCompletion(
        id=request_id,
        object="chat.completion",
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=Usage.of(gen.prompt_tokens_count, completion_tokens, gen.cached_prompt_tokens_count),
    )
    if stream.first.weight_version:
        completion.system_fingerprint = stream.first.weight_version
    if req.prompt_logprobs is not None:
        completion.prompt_logprobs = prompt_logprobs(gen.prompt_tokens, req.prompt_logprobs)
    if req.return_token_ids:
        completion.prompt_token_ids = tap.ids
    return completion


class _ChunkMaker:
    """The chunks of one streamed request: shared id, created, model; usage null until the last chunk."""

    def __init__(self, req: ChatCompletionRequest, request_id: str, fingerprint: str) -> None:
        self.req = req
        self.request_id = request_id
        self.created = int(time.time())
        self.fingerprint = fingerprint  # the weights' version: one per request (a swap waits for it to end)

    def chunk(self, choices: list[ChatChunkChoice], prompt_token_ids: list[int] | None = None) -> str:
        c = ChatCompletionChunk(
            id=self.request_id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.req.model,
            choices=choices,
        )
        if self.fingerprint:
            c.system_fingerprint = self.fingerprint
        if self.req.include_usage():
            c.usage = None  # present (null) on every chunk but the last, as OpenAI sends it
        if prompt_token_ids is not None:
            c.prompt_token_ids = prompt_token_ids
        return c.dump()

    def role(self, index: int, prompt_token_ids: list[int] | None = None) -> str:
        return self.chunk([self.bare(index, Delta(role="assistant", content=""))], prompt_token_ids)

    def choice(self, index: int, delta: Delta, tokens: Sequence[pb.Token]) -> ChatChunkChoice:
        """A choice carrying `tokens` (their logprobs and ids, when asked)."""
        logprobs = chat_logprobs(list(tokens), self.req.top_logprobs or 0) if self.req.logprobs else None
        c = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=None)
        if self.req.return_token_ids:
            c.token_ids = _token_ids(tokens)
        return c

    def content(self, index: int, text: str, tokens: Sequence[pb.Token]) -> str:
        return self.chunk([self.choice(index, Delta(content=text), tokens)])

    def calls(self, index: int, parsed: ParsedOutput, rest: Piece) -> list[str]:
        """The tool calls as fragments; the first also carries the content not yet sent and the held tokens."""
        out = []
        for j, call in enumerate(_tool_calls(parsed)):
            head = ToolCallChunk(
                index=j,
                id=call.id,
                type="function",
                function=FunctionCallChunk(name=call.function.name, arguments=""),
            )
            delta = Delta(tool_calls=[head])
            if j == 0:
                if rest.text:
                    delta.content = rest.text
                out.append(self.chunk([self.choice(index, delta, rest.tokens)]))
            else:
                out.append(self.chunk([self.bare(index, delta)]))
            args = ToolCallChunk(index=j, function=FunctionCallChunk(arguments=call.function.arguments))
            out.append(self.chunk([self.bare(index, Delta(tool_calls=[args]))]))
        return out

    @staticmethod
    def bare(index: int, delta: Delta, reason: str | None = None) -> ChatChunkChoice:
        """A choice without tokens."""
        return ChatChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=reason)

    def finish(self, index: int, reason: str) -> str:
        return self.chunk([self.bare(index, Delta(), reason)])


async def _chunks(stream: GenerateStream, req: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
    make = _ChunkMaker(req, request_id, stream.first.weight_version)
    names = [f.name for f in req.functions()] if req.offers_tools() else []
    lazy_role = bool(
        req.return_token_ids
    )  # role chunks wait for the prompt ids (each sample's first message)
    if not lazy_role:
        for i in range(req.n or 1):
            yield make.role(i)
    prompt_tokens = cached_tokens = completion_tokens = 0
    shown: dict[int, ShownTokens] = {}
    calls: dict[int, ToolCallStream] = {}
    async for msg in messages(stream):
        if msg.prompt_tokens and not (msg.tokens or msg.text or msg.finished):
            continue  # prompt logprobs: not streamed (refused with stream)
        if msg.index not in shown and lazy_role:
            yield make.role(msg.index, list(msg.prompt_token_ids))
        sample = shown.setdefault(msg.index, ShownTokens())
        tokens = sample.feed(msg.tokens, msg if msg.finished else None)
        reason = finish_reason(msg) if msg.finished else None
        if names:
            held = calls.setdefault(msg.index, ToolCallStream(names))
            pieces = held.feed(Piece(msg.text, list(tokens)))
            if pieces:
                yield make.content(
                    msg.index, "".join(p.text for p in pieces), [t for p in pieces for t in p.tokens]
                )
            if msg.finished:
                parsed, rest = held.finish()
                if parsed is not None:
                    for c in make.calls(msg.index, parsed, rest):
                        yield c
                    reason = "tool_calls"
                elif rest.text or rest.tokens:
                    yield make.content(msg.index, rest.text, rest.tokens)
        elif msg.text or tokens:
            yield make.content(msg.index, msg.text, tokens)
        if msg.finished:
            prompt_tokens = max(prompt_tokens, msg.prompt_tokens_count)
            cached_tokens = max(cached_tokens, msg.cached_prompt_tokens_count)  # one prompt: the same on each
            completion_tokens += sample.completion_tokens(msg)
            assert reason is not None
            yield make.finish(msg.index, reason)
    if req.include_usage():
        last = ChatCompletionChunk(
            id=request_id,
            object="chat.completion.chunk",
            created=make.created,
            model=req.model,
            choices=[],
            usage=Usage.of(prompt_tokens, completion_tokens, cached_tokens),
        )
        if make.fingerprint:
            last.system_fingerprint = make.fingerprint
        yield last.dump()

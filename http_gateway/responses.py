"""/v1/responses (the OpenAI Responses API): request -> `GenerateRequest.chat`, backend stream -> a Response
object or its stream of events.

The input items become chat messages (`instructions` first, as a system turn); the answer is one assistant
`message` output item with one `output_text` part. Its logprob entries have the chat entry shape (logprobs.py)
and are `[]` unless `include` has "message.output_text.logprobs"; the EOS that ended the sample is neither in
them nor in `output_tokens`, as in chat (chat.ShownTokens holds that rule). A sample cut by
`max_output_tokens` makes the Response `incomplete` with `incomplete_details.reason: "max_output_tokens"`.

Streaming sends the spec's events, each with its `sequence_number` from 0: response.created,
response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta (the
logprobs of exactly its text), response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed or response.incomplete. Each is framed `event: <type>` +
`data: <json>` as OpenAI sends them, without a final `[DONE]`. A failure after the stream started is an `error`
event (the spec's fields, plus OpenAI's nested `error` object on which the SDKs raise).

Function tools use chat's machinery (tools.py): the tools go to the backend as `tools_json`, a forced call
(`tool_choice` "required" or a named function) as a grammar, and the answer is parsed for calls. Each call is a
`function_call` output item (after the message, which is left out when the answer is only calls; its text is
the content before the calls, its logprobs those of that text's tokens). Streamed, text that may be a call is
held back as chat holds it; the calls come at the end: output_item.added, function_call_arguments.delta and
.done, output_item.done. A `text.format` other than text takes over from "auto" tools, as on chat.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence

from tpuserve.http_gateway import observability, proto_mapping, structured
from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.backends import BackendPool, GenerateStream
from tpuserve.http_gateway.chat import ShownTokens
from tpuserve.http_gateway.errors import APIError, invalid_request
from tpuserve.http_gateway.logprobs import chat_entry
from tpuserve.http_gateway.response_models import TokenLogprob
from tpuserve.http_gateway.responses_models import (
    ContentPartEvent,
    CreateResponseRequest,
    ErrorEvent,
    ErrorEventDetail,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    OutputItemEvent,
    Response,
    ResponseEvent,
    ResponseFunctionCall,
    ResponseFunctionTool,
    ResponseIncompleteDetails,
    ResponseLifecycleEvent,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseText,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from tpuserve.http_gateway.samples import collect, messages
from tpuserve.http_gateway.sse import data_event, stream_failure
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn
FORMAT_PARAM = "text.format"
TOOLS_PARAM = "tools"


# ---- request -> proto -------------------------------------------------------------------------------------


def chat_messages(req: CreateResponseRequest) -> list[pb.ChatMessage]:
    """`instructions` (a system turn) and the input items as chat messages. Function calls join the assistant
    turn before them (or start one); a function_call_output becomes a `tool` message answering its call."""
    out: list[pb.ChatMessage] = []
    if req.instructions is not None:
        out.append(pb.ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        out.append(pb.ChatMessage(role="user", content=req.input))
        return out
    calls: dict[str, str] = {}  # call_id -> function name, of the calls made so far
    for i, item in enumerate(req.input):
        if isinstance(item, InputMessage):
            out.append(pb.ChatMessage(role=_ROLES.get(item.role, item.role), content=item.text()))
        elif isinstance(item, FunctionCallItem):
            if item.call_id in calls:
                raise invalid_request(
                    f"Duplicate function call id '{item.call_id}'.", f"input[{i}].call_id", "invalid_value"
                )
            calls[item.call_id] = item.name
            call = pb.ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
            if out and out[-1].role == "assistant":
                out[-1].tool_calls.append(call)
            else:
                out.append(pb.ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise invalid_request(
                    f"No function_call item with call_id '{item.call_id}' comes before this "
                    "function_call_output.",
                    f"input[{i}].call_id",
                    "invalid_value",
                )
            out.append(
                pb.ChatMessage(
                    role="tool", content=item.text(), tool_call_id=item.call_id, name=calls[item.call_id]
                )
            )
    return out


def _guided(req: CreateResponseRequest) -> pb.GuidedDecoding | None:
    """The grammar: a forced tool call's, else text.format's, else none."""
    if req.forced_tool_call():
        parallel = req.parallel_tool_calls is not False
        return fn_tools.forced_call_grammar(req.functions(), req.choice(), parallel, TOOLS_PARAM)
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return structured.guided_json_object()
    return structured.guided_json_schema(fmt.schema_, f"{FORMAT_PARAM}.schema")


def _guided_param(req: CreateResponseRequest) -> str:
    """The request field a backend's refusal of the grammar is about."""
    return TOOLS_PARAM if req.forced_tool_call() else f"{FORMAT_PARAM}.schema"


def to_proto(req: CreateResponseRequest, request_id: str) -> pb.GenerateRequest:
    chat = pb.ChatMessages(messages=chat_messages(req))
    if req.offers_tools():
        chat.tools_json = fn_tools.tools_json(req.functions())
    msg = pb.GenerateRequest(
        request_id=request_id,
        chat=chat,
        sampling=proto_mapping.sampling(req.temperature, req.top_p, req.seed),
        stopping=proto_mapping.stopping(req.max_output_tokens, []),
        logprobs=pb.LogprobOptions(enabled=req.logprobs(), top_logprobs=req.top_logprobs or 0),
        n=1,
    )
    guided = _guided(req)
    if guided is not None:
        msg.guided.CopyFrom(guided)
    return proto_mapping.cache_salt(msg, req.cache_salt)


# ---- the Response object ------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_tokens(tokens: Sequence[pb.Token], size: int) -> list[pb.Token]:
    """The tokens that make the first `size` bytes of their text: those that begin before that point (a token
    across it is kept, as a cut character's token is)."""
    out, offset = [], 0
    for t in tokens:
        if offset >= size:
            break
        out.append(t)
        offset += len(t.token_bytes)
    return out


class _Turn:
    """One request's answer, built message by message: the text and shown tokens so far, then (at the end) the
    tool calls parsed from it. Output items: the assistant message (unless the answer is only tool calls), then
    one `function_call` per call."""

    def __init__(self, req: CreateResponseRequest, response_id: str) -> None:
        self.req = req
        self.id = response_id
        self.created_at = int(time.time())
        self.message_id = _new_id("msg")
        self.logprobs = req.logprobs()
        self.top_k = req.top_logprobs or 0
        self.names = [f.name for f in req.functions()] if req.offers_tools() else []
        self.shown = ShownTokens()
        self.text = ""
        self.tokens: list[pb.Token] = []
        self.final: pb.GenerateResponse | None = None
        self.parsed: fn_tools.ParsedOutput | None = None
        self.call_ids: list[tuple[str, str]] = []  # (item id, call id) per parsed call

    def feed(
        self, text: str, tokens: Sequence[pb.Token], final: pb.GenerateResponse | None
    ) -> list[pb.Token]:
        """Adds one backend message's text and tokens; returns the tokens shown for it (the ending EOS is not)."""
        shown = self.shown.feed(tokens, final)
        self.text += text
        self.tokens += shown
        if final is not None:
            self.final = final
        return shown

    def finish(self, parsed: fn_tools.ParsedOutput | None) -> None:
        """The sample ended: its tool calls (`parse_tool_calls` of the whole text, None: no calls)."""
        self.parsed = parsed
        self.call_ids = [(_new_id("fc"), fn_tools.new_call_id()) for _ in (parsed.calls if parsed else [])]

    def entries(self, tokens: Sequence[pb.Token]) -> list[TokenLogprob]:
        return [chat_entry(t, self.top_k) for t in tokens] if self.logprobs else []

    @property
    def incomplete(self) -> bool:
        return self.final is not None and self.final.finish_reason == pb.FINISH_REASON_LENGTH

    @property
    def has_message(self) -> bool:
        return self.parsed is None or self.parsed.content is not None

    @property
    def message_text(self) -> str:
        return self.text if self.parsed is None else self.parsed.content or ""

    def message_tokens(self) -> list[pb.Token]:
        """The tokens of the message's text: all of them, or with calls those of the content before them."""
        if self.parsed is None:
            return self.tokens
        return _text_tokens(self.tokens, len(self.message_text.encode()))

    def part(self) -> ResponseOutputText:
        return ResponseOutputText(
            text=self.message_text, annotations=[], logprobs=self.entries(self.message_tokens())
        )

    def message(self, done: bool) -> ResponseOutputMessage:
        if not done:
            return ResponseOutputMessage(id=self.message_id, status="in_progress", content=[])
        return ResponseOutputMessage(
            id=self.message_id, status="incomplete" if self.incomplete else "completed", content=[self.part()]
        )

    def calls(self, done: bool) -> list[ResponseFunctionCall]:
        assert self.parsed is not None or not self.call_ids
        return [
            ResponseFunctionCall(
                id=item_id,
                call_id=call_id,
                name=call.name,
                arguments=call.arguments if done else "",
                status="completed" if done else "in_progress",
            )
            for (item_id, call_id), call in zip(
                self.call_ids, self.parsed.calls if self.parsed else [], strict=True
            )
        ]

    def output(self) -> list[ResponseOutputItem]:
        message: list[ResponseOutputItem] = [self.message(done=True)] if self.has_message else []
        return message + list(self.calls(done=True))

    def response(self, done: bool) -> Response:
        """The Response object: in progress (no output yet) or finished."""
        req = self.req
        fmt = req.text.format if req.text else None
        status = "in_progress"
        completed_at = usage = incomplete = None
        output: list[ResponseOutputItem] = []
        if done:
            assert self.final is not None
            status = "incomplete" if self.incomplete else "completed"
            if self.incomplete:
                incomplete = ResponseIncompleteDetails(reason="max_output_tokens")
            else:
                completed_at = int(time.time())
            output = self.output()
            usage = ResponseUsage.of(
                self.final.prompt_tokens_count,
                self.shown.completion_tokens(self.final),
                self.final.cached_prompt_tokens_count,
            )
        tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
        return Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            completed_at=completed_at,
            incomplete_details=incomplete,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=req.model,
            output=output,
            parallel_tool_calls=req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            safety_identifier=req.safety_identifier,
            temperature=proto_mapping.DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            text=ResponseText(format=fmt.echo() if fmt else {"type": "text"}),
            tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
            tools=[
                ResponseFunctionTool(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
                for t in req.function_tools()
            ],
            top_logprobs=req.top_logprobs or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            usage=usage,
            user=req.user,
            metadata=dict(req.metadata or {}),
        )


async def create(pool: BackendPool, req: CreateResponseRequest) -> Response | AsyncIterator[str]:
    response_id = observability.new_request_id("resp")
    msg = to_proto(req, response_id)
    try:
        stream = await pool.generate(req.model, msg)
    except APIError as e:
        raise structured.name_guided_error(e, _guided_param(req)) from None
    turn = _Turn(req, response_id)
    if req.stream:
        return _events(stream, turn)
    gen = await collect(stream, 1)
    sample = gen.samples[0]
    assert sample.final is not None
    turn.feed(sample.text, sample.tokens, sample.final)
    turn.finish(fn_tools.parse_tool_calls(turn.text, turn.names) if turn.names else None)
    return turn.response(done=True)


# ---- streaming ----------------------------------------------------------------------------------------------


class _Sequencer:
    """Numbers the events from 0 and frames them as OpenAI does (`event:` line, `data:` line)."""

    def __init__(self) -> None:
        self.next = 0

    def frame(self, event: ResponseEvent) -> str:
        return f"event: {event.type}\n{data_event(event.dump())}"

    def number(self) -> int:
        n = self.next
        self.next += 1
        return n


async def _events(stream: GenerateStream, turn: _Turn) -> AsyncIterator[str]:
    seq = _Sequencer()
    try:
        async for frame in _StreamedTurn(turn, seq).events(stream):
            yield frame
    except Exception as exc:  # noqa: BLE001 - any failure becomes an error event (stream_failure logs it)
        yield seq.frame(_error_event(seq.number(), stream_failure(exc)))


def _error_event(number: int, e: APIError) -> ErrorEvent:
    return ErrorEvent(
        type="error",
        sequence_number=number,
        code=e.code,
        message=e.message,
        param=e.param,
        error=ErrorEventDetail(type=e.type, code=e.code, message=e.message, param=e.param),
    )


class _StreamedTurn:
    """The events of one streamed answer. Without tools the message opens at once and each backend message's
    text is a delta. With tools, text that may be a call is held (tools.ToolCallStream, as chat streams): the
    message opens with the first text that is surely content; at the end the rest of the content comes as a
    delta, then the message closes and each call follows as a function_call item (added, its arguments as one
    delta, done). The final Response has exactly what the events built."""

    def __init__(self, turn: _Turn, seq: _Sequencer) -> None:
        self.turn = turn
        self.seq = seq
        self.opened = False

    def frame(self, event: ResponseEvent) -> str:
        return self.seq.frame(event)

    def lifecycle(self, kind: str, done: bool) -> str:
        return self.frame(
            ResponseLifecycleEvent(
                type=kind, sequence_number=self.seq.number(), response=self.turn.response(done)
            )
        )

    def open(self) -> list[str]:
        """The message's output_item.added and content_part.added, once."""
        if self.opened:
            return []
        self.opened = True
        turn = self.turn
        return [
            self.frame(
                OutputItemEvent(
                    type="response.output_item.added",
                    sequence_number=self.seq.number(),
                    output_index=0,
                    item=turn.message(done=False),
                )
            ),
            self.frame(
                ContentPartEvent(
                    type="response.content_part.added",
                    sequence_number=self.seq.number(),
                    item_id=turn.message_id,
                    output_index=0,
                    content_index=0,
                    part=ResponseOutputText(text="", annotations=[], logprobs=[]),
                )
            ),
        ]

    def delta(self, text: str, tokens: Sequence[pb.Token]) -> str:
        return self.frame(
            TextDeltaEvent(
                type="response.output_text.delta",
                sequence_number=self.seq.number(),
                item_id=self.turn.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=self.turn.entries(tokens),
            )
        )

    def close(self) -> list[str]:
        """output_text.done, content_part.done, output_item.done of the message."""
        turn = self.turn
        part = turn.part()
        where = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}
        return [
            self.frame(
                TextDoneEvent(
                    type="response.output_text.done",
                    sequence_number=self.seq.number(),
                    text=part.text,
                    logprobs=part.logprobs,
                    **where,
                )
            ),
            self.frame(
                ContentPartEvent(
                    type="response.content_part.done", sequence_number=self.seq.number(), part=part, **where
                )
            ),
            self.frame(
                OutputItemEvent(
                    type="response.output_item.done",
                    sequence_number=self.seq.number(),
                    output_index=0,
                    item=turn.message(done=True),
                )
            ),
        ]

    def call_events(self, first_index: int) -> list[str]:
        out = []
        for j, (added, done) in enumerate(
            zip(self.turn.calls(done=False), self.turn.calls(done=True), strict=True)
        ):
            index = first_index + j
            out.append(
                self.frame(
                    OutputItemEvent(
                        type="response.output_item.added",
                        sequence_number=self.seq.number(),
                        output_index=index,
                        item=added,
                    )
                )
            )
            out.append(
                self.frame(
                    FunctionCallArgumentsDeltaEvent(
                        type="response.function_call_arguments.delta",
                        sequence_number=self.seq.number(),
                        item_id=done.id,
                        output_index=index,
                        delta=done.arguments,
                    )
                )
            )
            out.append(
                self.frame(
                    FunctionCallArgumentsDoneEvent(
                        type="response.function_call_arguments.done",
                        sequence_number=self.seq.number(),
                        item_id=done.id,
                        name=done.name,
                        output_index=index,
                        arguments=done.arguments,
                    )
                )
            )
            out.append(
                self.frame(
                    OutputItemEvent(
                        type="response.output_item.done",
                        sequence_number=self.seq.number(),
                        output_index=index,
                        item=done,
                    )
                )
            )
        return out

    async def events(self, stream: GenerateStream) -> AsyncIterator[str]:
        turn = self.turn
        yield self.lifecycle("response.created", done=False)
        yield self.lifecycle("response.in_progress", done=False)
        held = fn_tools.ToolCallStream(turn.names) if turn.names else None
        if held is None:
            for frame in self.open():
                yield frame
        async for msg in messages(stream):  # n = 1: every message is sample 0's, the finished one the last
            tokens = turn.feed(msg.text, msg.tokens, msg if msg.finished else None)
            if held is None:
                if msg.text or tokens:
                    yield self.delta(msg.text, tokens)
                continue
            for piece in held.feed(fn_tools.Piece(msg.text, list(tokens))):
                for frame in self.open():
                    yield frame
                yield self.delta(piece.text, piece.tokens)
        if turn.final is None:
            raise APIError(
                502,
                "The backend ended the stream before the response finished.",
                "server_error",
                None,
                "backend_error",
            )
        if held is None:
            turn.finish(None)
        else:
            parsed, rest = held.finish()
            turn.finish(parsed)
            if turn.has_message:
                for frame in self.open():
                    yield frame
                # without calls every held token is content; with calls, those of the content's rest
                tokens = rest.tokens if parsed is None else _text_tokens(rest.tokens, len(rest.text.encode()))
                if rest.text or tokens:
                    yield self.delta(rest.text, tokens)
        if turn.has_message:
            for frame in self.close():
                yield frame
        for frame in self.call_events(first_index=1 if turn.has_message else 0):
            yield frame
        yield self.lifecycle("response.incomplete" if turn.incomplete else "response.completed", done=True)


def request_summary(req: CreateResponseRequest) -> object:
    """The request's prompt as the log line shows it (only when prompts are logged): the text of each item, not
    what a client sent back along with it (annotations, logprobs: any JSON, however deep)."""
    items: object = req.input
    if isinstance(req.input, list):
        items = []
        for item in req.input:
            if isinstance(item, InputMessage):
                items.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                items.append(
                    {
                        "type": item.type,
                        "call_id": item.call_id,
                        "name": item.name,
                        "arguments": item.arguments,
                    }
                )
            elif isinstance(item, FunctionCallOutputItem):
                items.append({"type": item.type, "call_id": item.call_id, "output": item.text()})
    return {"instructions": req.instructions, "input": items}

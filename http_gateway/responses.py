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
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from tpuserve.http_gateway import observability, proto_mapping, structured
from tpuserve.http_gateway.backends import BackendPool, GenerateStream
from tpuserve.http_gateway.chat import ShownTokens
from tpuserve.http_gateway.errors import APIError, invalid_request
from tpuserve.http_gateway.logprobs import chat_entry
from tpuserve.http_gateway.observability import on_stream_error
from tpuserve.http_gateway.response_models import TokenLogprob
from tpuserve.http_gateway.responses_models import (
    ContentPartEvent,
    CreateResponseRequest,
    ErrorEvent,
    ErrorEventDetail,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
    OutputItemEvent,
    Response,
    ResponseEvent,
    ResponseFunctionTool,
    ResponseIncompleteDetails,
    ResponseLifecycleEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseText,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from tpuserve.http_gateway.samples import collect, messages
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

log = logging.getLogger(__name__)

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn
FORMAT_PARAM = "text.format"


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
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return structured.guided_json_object()
    return structured.guided_json_schema(fmt.schema_, f"{FORMAT_PARAM}.schema")


def to_proto(req: CreateResponseRequest, request_id: str) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=request_id,
        chat=pb.ChatMessages(messages=chat_messages(req)),
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


class _Turn:
    """One request's answer, built message by message: the shown text and logprob entries so far."""

    def __init__(self, req: CreateResponseRequest, response_id: str) -> None:
        self.req = req
        self.id = response_id
        self.created_at = int(time.time())
        self.message_id = _new_id("msg")
        self.logprobs = req.logprobs()
        self.top_k = req.top_logprobs or 0
        self.shown = ShownTokens()
        self.text = ""
        self.entries: list[TokenLogprob] = []
        self.final: pb.GenerateResponse | None = None

    def feed(
        self, text: str, tokens: Sequence[pb.Token], final: pb.GenerateResponse | None
    ) -> list[TokenLogprob]:
        """Adds one backend message's text and tokens; returns the logprob entries of exactly them."""
        shown = self.shown.feed(tokens, final)
        entries = [chat_entry(t, self.top_k) for t in shown] if self.logprobs else []
        self.text += text
        self.entries += entries
        if final is not None:
            self.final = final
        return entries

    @property
    def incomplete(self) -> bool:
        return self.final is not None and self.final.finish_reason == pb.FINISH_REASON_LENGTH

    def part(self) -> ResponseOutputText:
        return ResponseOutputText(text=self.text, annotations=[], logprobs=list(self.entries))

    def message(self, done: bool) -> ResponseOutputMessage:
        if not done:
            return ResponseOutputMessage(id=self.message_id, status="in_progress", content=[])
        return ResponseOutputMessage(
            id=self.message_id, status="incomplete" if self.incomplete else "completed", content=[self.part()]
        )

    def response(self, done: bool) -> Response:
        """The Response object: in progress (no output yet) or finished."""
        req = self.req
        fmt = req.text.format if req.text else None
        status = "in_progress"
        completed_at = usage = incomplete = None
        output = []
        if done:
            assert self.final is not None
            status = "incomplete" if self.incomplete else "completed"
            if self.incomplete:
                incomplete = ResponseIncompleteDetails(reason="max_output_tokens")
            else:
                completed_at = int(time.time())
            output = [self.message(done=True)]
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
        raise structured.name_guided_error(e, f"{FORMAT_PARAM}.schema") from None
    turn = _Turn(req, response_id)
    if req.stream:
        return _events(stream, turn)
    gen = await collect(stream, 1)
    sample = gen.samples[0]
    assert sample.final is not None
    turn.feed(sample.text, sample.tokens, sample.final)
    return turn.response(done=True)


# ---- streaming ----------------------------------------------------------------------------------------------


class _Sequencer:
    """Numbers the events from 0 and frames them as OpenAI does (`event:` line, `data:` line)."""

    def __init__(self) -> None:
        self.next = 0

    def frame(self, event: ResponseEvent) -> str:
        return f"event: {event.type}\ndata: {event.dump()}\n\n"

    def number(self) -> int:
        n = self.next
        self.next += 1
        return n


async def _events(stream: GenerateStream, turn: _Turn) -> AsyncIterator[str]:
    seq = _Sequencer()
    try:
        async for frame in _turn_events(stream, turn, seq):
            yield frame
    except APIError as e:
        on_stream_error(e.code)
        yield seq.frame(_error_event(seq.number(), e))
    except Exception:
        log.exception("error while streaming a response")
        on_stream_error("internal_error")
        err = APIError(
            500,
            "The server had an error while processing your request.",
            "server_error",
            None,
            "internal_error",
        )
        yield seq.frame(_error_event(seq.number(), err))


def _error_event(number: int, e: APIError) -> ErrorEvent:
    return ErrorEvent(
        type="error",
        sequence_number=number,
        code=e.code,
        message=e.message,
        param=e.param,
        error=ErrorEventDetail(type=e.type, code=e.code, message=e.message, param=e.param),
    )


async def _turn_events(stream: GenerateStream, turn: _Turn, seq: _Sequencer) -> AsyncIterator[str]:
    def lifecycle(kind: str, done: bool) -> str:
        event = ResponseLifecycleEvent(type=kind, sequence_number=seq.number(), response=turn.response(done))
        return seq.frame(event)

    def part_event(kind: str) -> str:
        part = (
            turn.part() if kind.endswith("done") else ResponseOutputText(text="", annotations=[], logprobs=[])
        )
        event = ContentPartEvent(
            type=kind,
            sequence_number=seq.number(),
            item_id=turn.message_id,
            output_index=0,
            content_index=0,
            part=part,
        )
        return seq.frame(event)

    yield lifecycle("response.created", done=False)
    yield lifecycle("response.in_progress", done=False)
    yield seq.frame(
        OutputItemEvent(
            type="response.output_item.added",
            sequence_number=seq.number(),
            output_index=0,
            item=turn.message(done=False),
        )
    )
    yield part_event("response.content_part.added")
    async for msg in messages(stream):  # n = 1: every message is sample 0's, the finished one the last
        entries = turn.feed(msg.text, msg.tokens, msg if msg.finished else None)
        if msg.text or entries:
            yield seq.frame(
                TextDeltaEvent(
                    type="response.output_text.delta",
                    sequence_number=seq.number(),
                    item_id=turn.message_id,
                    output_index=0,
                    content_index=0,
                    delta=msg.text,
                    logprobs=entries,
                )
            )
    if turn.final is None:
        raise APIError(
            502,
            "The backend ended the stream before the response finished.",
            "server_error",
            None,
            "backend_error",
        )
    yield seq.frame(
        TextDoneEvent(
            type="response.output_text.done",
            sequence_number=seq.number(),
            item_id=turn.message_id,
            output_index=0,
            content_index=0,
            text=turn.text,
            logprobs=list(turn.entries),
        )
    )
    yield part_event("response.content_part.done")
    yield seq.frame(
        OutputItemEvent(
            type="response.output_item.done",
            sequence_number=seq.number(),
            output_index=0,
            item=turn.message(done=True),
        )
    )
    yield lifecycle("response.incomplete" if turn.incomplete else "response.completed", done=True)


def request_summary(req: CreateResponseRequest) -> object:
    """The request's prompt as the log line shows it (only when prompts are logged)."""
    if isinstance(req.input, str):
        return {"instructions": req.instructions, "input": req.input}
    return {"instructions": req.instructions, "input": [json.loads(i.model_dump_json()) for i in req.input]}

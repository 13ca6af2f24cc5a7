"""/v1/responses (the OpenAI Responses API) streamed: the spec's events, and the order one answer sends them in.

Each event carries its `sequence_number` from 0: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (the logprobs of exactly
its text), response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed or response.incomplete. Each is framed `event: <type>` + `data: <json>` as OpenAI sends
them, without a final `[DONE]`. A failure after the stream started is an `error` event (the spec's fields, plus
OpenAI's nested `error` object on which the SDKs raise).

With function tools, text that may be a call is held back as chat holds it; the calls come at the end:
output_item.added, function_call_arguments.delta and .done, output_item.done.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.backend_messages import messages
from tpuserve.http_gateway.backends import GenerateStream
from tpuserve.http_gateway.completion_objects import TokenLogprob
from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.responses_answer import Answer, text_tokens
from tpuserve.http_gateway.responses_objects import (
    Response,
    ResponseOutputItem,
    ResponseOutputText,
    ResponsesObject,
)
from tpuserve.http_gateway.sse import data_event, stream_failure
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

# ---- the events ---------------------------------------------------------------------------------------------


class ResponseEvent(ResponsesObject):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseEvent):
    """response.created / in_progress / completed / incomplete."""

    response: Response


class OutputItemEvent(ResponseEvent):
    """response.output_item.added / done."""

    output_index: int
    item: ResponseOutputItem


class ContentPartEvent(ResponseEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class TextDeltaEvent(ResponseEvent):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprob]


class TextDoneEvent(ResponseEvent):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[TokenLogprob]


class FunctionCallArgumentsDeltaEvent(ResponseEvent):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(ResponseEvent):
    item_id: str
    name: str
    output_index: int
    arguments: str


class ErrorEventDetail(ResponsesObject):
    type: str
    code: str | None
    message: str
    param: str | None


class ErrorEvent(ResponseEvent):
    """The spec's ResponseErrorEvent (code, message, param at the top), plus OpenAI's observed nested `error`
    object, on which the official SDKs raise."""

    code: str | None
    message: str
    param: str | None
    error: ErrorEventDetail


# ---- one answer's events, in order ----------------------------------------------------------------------


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


async def stream_events(stream: GenerateStream, answer: Answer) -> AsyncIterator[str]:
    seq = _Sequencer()
    try:
        async for frame in _StreamedAnswer(answer, seq).events(stream):
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


class _StreamedAnswer:
    """The events of one streamed answer. Without tools the message opens at once and each backend message's
    text is a delta. With tools, text that may be a call is held (tools.ToolCallStream, as chat streams): the
    message opens with the first text that is surely content; at the end the rest of the content comes as a
    delta, then the message closes and each call follows as a function_call item (added, its arguments as one
    delta, done). The final Response has exactly what the events built."""

    def __init__(self, answer: Answer, seq: _Sequencer) -> None:
        self.answer = answer
        self.seq = seq
        self.opened = False

    def frame(self, event: ResponseEvent) -> str:
        return self.seq.frame(event)

    def lifecycle(self, kind: str, done: bool) -> str:
        return self.frame(
            ResponseLifecycleEvent(
                type=kind, sequence_number=self.seq.number(), response=self.answer.response(done)
            )
        )

    def open(self) -> list[str]:
        """The message's output_item.added and content_part.added, once."""
        if self.opened:
            return []
        self.opened = True
        answer = self.answer
        return [
            self.frame(
                OutputItemEvent(
                    type="response.output_item.added",
                    sequence_number=self.seq.number(),
                    output_index=0,
                    item=answer.message(done=False),
                )
            ),
            self.frame(
                ContentPartEvent(
                    type="response.content_part.added",
                    sequence_number=self.seq.number(),
                    item_id=answer.message_id,
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
                item_id=self.answer.message_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=self.answer.entries(tokens),
            )
        )

    def close(self) -> list[str]:
        """output_text.done, content_part.done, output_item.done of the message."""
        answer = self.answer
        part = answer.part()
        where = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}
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
                    item=answer.message(done=True),
                )
            ),
        ]

    def call_events(self, first_index: int) -> list[str]:
        out = []
        for j, (added, done) in enumerate(
            zip(self.answer.calls(done=False), self.answer.calls(done=True), strict=True)
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
        answer = self.answer
        yield self.lifecycle("response.created", done=False)
        yield self.lifecycle("response.in_progress", done=False)
        held = fn_tools.ToolCallStream(answer.names) if answer.names else None
        if held is None:
            for frame in self.open():
                yield frame
        async for msg in messages(stream):  # n = 1: every message is sample 0's, the finished one the last
            tokens = answer.feed(msg.text, msg.tokens, msg if msg.finished else None)
            if held is None:
                if msg.text or tokens:
                    yield self.delta(msg.text, tokens)
                continue
            for piece in held.feed(fn_tools.Piece(msg.text, list(tokens))):
                for frame in self.open():
                    yield frame
                yield self.delta(piece.text, piece.tokens)
        if answer.final is None:
            raise APIError(
                502,
                "The backend ended the stream before the response finished.",
                "server_error",
                None,
                "backend_error",
            )
        if held is None:
            answer.finish(None)
        else:
            parsed, rest = held.finish()
            answer.finish(parsed)
            if answer.has_message:
                for frame in self.open():
                    yield frame
                # without calls every held token is content; with calls, those of the content's rest
                tokens = rest.tokens if parsed is None else text_tokens(rest.tokens, len(rest.text.encode()))
                if rest.text or tokens:
                    yield self.delta(rest.text, tokens)
        if answer.has_message:
            for frame in self.close():
                yield frame
        for frame in self.call_events(first_index=1 if answer.has_message else 0):
            yield frame
        yield self.lifecycle("response.incomplete" if answer.incomplete else "response.completed", done=True)

"""/v1/responses (the OpenAI Responses API): one request's answer, built from the backend's messages, as a
Response object and its output items.

The answer is one assistant `message` output item with one `output_text` part. Its logprob entries have the chat
entry shape (logprobs.py) and are `[]` unless `include` has "message.output_text.logprobs"; the EOS that ended
the sample is neither in them nor in `output_tokens`, as in chat (chat.ShownTokens holds that rule). A sample
cut by `max_output_tokens` makes the Response `incomplete` with `incomplete_details.reason:
"max_output_tokens"`. Each tool call parsed from the answer is a `function_call` output item after the message,
which is left out when the answer is only calls; its text is then the content before the calls, its logprobs
those of that text's tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from tpuserve.http_gateway import proto_mapping
from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.chat import ShownTokens
from tpuserve.http_gateway.completion_objects import TokenLogprob
from tpuserve.http_gateway.logprobs import chat_entry
from tpuserve.http_gateway.responses_objects import (
    Response,
    ResponseFunctionCall,
    ResponseFunctionTool,
    ResponseIncompleteDetails,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseText,
    ResponseUsage,
)
from tpuserve.http_gateway.responses_request import CreateResponseRequest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_tokens(tokens: Sequence[pb.Token], size: int) -> list[pb.Token]:
    """The tokens that make the first `size` bytes of their text: those that begin before that point (a token
    across it is kept, as a cut character's token is)."""
    out, offset = [], 0
    for t in tokens:
        if offset >= size:
            break
        out.append(t)
        offset += len(t.token_bytes)
    return out


class Answer:
    """One request's answer, built backend message by backend message: the text and shown tokens so far, then (at
    the end) the tool calls parsed from it. Output items: the assistant message (unless the answer is only tool
    calls), then one `function_call` per call."""

    def __init__(self, req: CreateResponseRequest, response_id: str, fingerprint: str = "") -> None:
        self.req = req
        self.id = response_id
        self.fingerprint = fingerprint or None  # the weights' version (chat's system_fingerprint)
        self.created_at = int(time.time())
        self.message_id = new_id("msg")
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
        self.call_ids = [(new_id("fc"), fn_tools.new_call_id()) for _ in (parsed.calls if parsed else [])]

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
        return text_tokens(self.tokens, len(self.message_text.encode()))

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
            system_fingerprint=self.fingerprint,
        )

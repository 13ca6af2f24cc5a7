"""/v1/responses (the OpenAI Responses API), the endpoint: request -> `GenerateRequest.chat`, backend stream ->
a Response object (responses_answer.py) or its stream of events (responses_events.py).

The input items become chat messages (`instructions` first, as a system message); a function call joins the
assistant message before it and a function_call_output becomes a `tool` message. Function tools use chat's
machinery (tools.py): the tools go to the backend as `tools_json`, a forced call (`tool_choice` "required" or a
named function) as a grammar, and the answer is parsed for calls. A `text.format` other than text takes over
from "auto" tools, as on chat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from tpuserve.http_gateway import observability, proto_mapping, structured
from tpuserve.http_gateway import tools as fn_tools
from tpuserve.http_gateway.backend_messages import collect
from tpuserve.http_gateway.backends import BackendPool
from tpuserve.http_gateway.errors import APIError, invalid_request
from tpuserve.http_gateway.responses_answer import Answer
from tpuserve.http_gateway.responses_events import stream_events
from tpuserve.http_gateway.responses_objects import Response
from tpuserve.http_gateway.responses_request import (
    CreateResponseRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputMessage,
)
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
FORMAT_PARAM = "text.format"
TOOLS_PARAM = "tools"


# ---- request -> proto -------------------------------------------------------------------------------------


def chat_messages(req: CreateResponseRequest) -> list[pb.ChatMessage]:
    """`instructions` (a system message) and the input items as chat messages. Function calls join the assistant
    message before them (or start one); a function_call_output becomes a `tool` message answering its call."""
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


async def create(pool: BackendPool, req: CreateResponseRequest) -> Response | AsyncIterator[str]:
    response_id = observability.new_request_id("resp")
    msg = to_proto(req, response_id)
    try:
        stream = await pool.generate(req.model, msg)
    except APIError as e:
        raise structured.name_guided_error(e, _guided_param(req)) from None
    answer = Answer(req, response_id, stream.first.weight_version)
    if req.stream:
        return stream_events(stream, answer)
    gen = await collect(stream, 1)
    sample = gen.samples[0]
    assert sample.final is not None
    answer.feed(sample.text, sample.tokens, sample.final)
    answer.finish(fn_tools.parse_tool_calls(answer.text, answer.names) if answer.names else None)
    return answer.response(done=True)


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

"""/v1/responses (the OpenAI Responses API) over the scripted backend: bodies and stream events against the spec,
the mapping to the backend's chat request, logprobs (the chat entry shape, `[]` without `include`), streamed ==
plain, `max_output_tokens` -> incomplete, the official SDK, and bad input as 400s naming the parameter.

scripted_backend.py: `say:<text>` replies <text> then EOS; no directive: DEFAULT_REPLY (9 tokens) then EOS;
`loop:<text>` never ends by itself; token j has logprob -(0.1*(j%5+1)); its alternatives include the EOS (a
special token: `bytes` null) and a -inf one.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import time

import httpx
import jsonschema
import openai
import openai_spec
import pydantic
import pytest
import referencing
from gateway_checks import check_chat_entry, entry_bytes, error, strict_json
from gateway_harness import GatewayServer
from scripted_backend import DEFAULT_REPLY, EOS, MODEL_ID, SPECIALS, logprob, render_chat
from tpuserve.http_gateway import openapi
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

RESPONSES = "/v1/responses"
LOGPROBS = ["message.output_text.logprobs"]
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta ...
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


# ---- spec checks --------------------------------------------------------------------------------------------


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    """The spec's schema `name`, with one relaxation: a Responses logprob entry's `bytes` (LogProb, TopLogProb)
    may be null. The spec types it as an integer array only, but docs/http-api.md gives a special token (e.g.
    `<|im_end|>` as an alternative) `bytes: null` in chat and Responses entries alike: it has no bytes."""
    uri = "urn:openai-openapi"
    contents = copy.deepcopy(openai_spec._registry()[uri].contents)
    schemas = contents["components"]["schemas"]
    for entry in ("LogProb", "TopLogProb"):
        bytes_schema = schemas[entry]["properties"]["bytes"]
        schemas[entry]["properties"]["bytes"] = {"anyOf": [bytes_schema, {"type": "null"}]}
    resource = referencing.Resource.from_contents(
        contents, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource(uri, resource)
    return jsonschema.Draft202012Validator({"$ref": f"{uri}#/components/schemas/{name}"}, registry=registry)


def validate(obj: dict, name: str) -> None:
    _validator(name).validate(obj)


def test_the_relaxed_validator_still_checks_entries(spec) -> None:
    """The relaxation is exactly `bytes` null: a missing or wrong `bytes` still fails, and the unrelaxed spec
    refuses null (so the relaxation is needed, and no wider than said)."""
    entry = {"token": "<|im_end|>", "bytes": None, "logprob": -1.0, "top_logprobs": []}
    validate(entry, "LogProb")
    with pytest.raises(jsonschema.ValidationError):
        spec.validate(entry, "LogProb")
    for bad in (
        {k: v for k, v in entry.items() if k != "bytes"},
        {**entry, "bytes": "x"},
        {**entry, "logprob": None},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, "LogProb")


# ---- request helpers ----------------------------------------------------------------------------------------


def body(gw, input: object = "Hi!", **kw) -> dict:
    return {"model": gw.model, "input": input, **kw}


def post(http: httpx.Client, req: dict) -> dict:
    r = http.post(RESPONSES, json=req)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    data = strict_json(r.text)
    validate(data, "Response")
    check_response(data)
    return data


def check_response(data: dict) -> None:
    """What every finished Response holds, beyond its schema: at most one message, first, then the calls."""
    assert data["object"] == "response" and data["id"].startswith("resp")
    assert data["status"] in ("completed", "incomplete") and data["error"] is None
    kinds = [item["type"] for item in data["output"]]
    assert kinds and set(kinds) <= {"message", "function_call"} and "message" not in kinds[1:]
    if data["status"] == "completed":
        assert data["incomplete_details"] is None and data["completed_at"] >= data["created_at"]
    else:
        assert data["incomplete_details"] == {"reason": "max_output_tokens"} and data["completed_at"] is None
    usage = data["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]
    calls = [item for item in data["output"] if item["type"] == "function_call"]
    for call in calls:
        assert (
            call["id"].startswith("fc_")
            and call["call_id"].startswith("call_")
            and call["status"] == "completed"
        )
        assert isinstance(json.loads(call["arguments"]), dict)
    if kinds[0] != "message":
        return
    message = data["output"][0]
    assert message["role"] == "assistant" and message["id"].startswith("msg_")
    assert message["status"] == data["status"]
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    for e in part["logprobs"]:
        check_chat_entry(e, data["top_logprobs"] or None)
    if part["logprobs"]:
        if not calls:
            assert (
                len(part["logprobs"]) == usage["output_tokens"]
            )  # the ending EOS is neither an entry nor counted
        if data["status"] == "completed" and not calls:
            assert entry_bytes(part["logprobs"]) == part["text"].encode()
        else:  # a cut character's token, or the token across the start of the calls, is kept
            assert entry_bytes(part["logprobs"]).startswith(part["text"].encode())


def sse(text: str) -> list[dict]:
    """The events of a Responses SSE body: each `event:` line names its data's `type`; no `[DONE]`."""
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = strict_json(lines[1][len("data: ") :])
        assert data["type"] == lines[0][len("event: ") :]
        out.append(data)
    return out


_EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "error": "ResponseErrorEvent",
}


def events(http: httpx.Client, req: dict) -> list[dict]:
    """POSTs with stream: true; every event checked against the spec, numbered 0, 1, 2, ..."""
    r = http.post(RESPONSES, json={**req, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    out = sse(r.text)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    for e in out:
        validate(e, "ResponseStreamEvent")
        validate(e, _EVENT_SCHEMAS[e["type"]])
    return out


def built_output(evs: list[dict]) -> list[dict]:
    """The output items as the events between in_progress and the last one build them, checking their order:
    each item is added (in progress, empty), filled by its deltas, and done; a message's text part is added,
    filled, and done; the done events repeat exactly what the deltas built. Deltas carry the logprobs of exactly
    their text (the last one of a part may hold a cut character's token)."""
    items: dict[int, dict] = {}
    finished: dict[int, dict] = {}
    pieces: dict[int, list[tuple[bytes, bytes]]] = {}
    for e in evs:
        kind, index = e["type"], e.get("output_index")
        assert index not in finished, f"{kind} after its item was done"
        if kind == "response.output_item.added":
            assert index == len(items) and e["item"]["status"] == "in_progress"
            item = items[index] = copy.deepcopy(e["item"])
            assert item.get("content", []) == [] and item.get("arguments", "") == ""
            continue
        item = items[index]
        if "item_id" in e:
            assert e["item_id"] == item["id"]
        if kind == "response.content_part.added":
            assert e["content_index"] == len(item["content"]) == 0
            assert e["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(copy.deepcopy(e["part"]))
        elif kind == "response.output_text.delta":
            part = item["content"][e["content_index"]]
            part["text"] += e["delta"]
            part["logprobs"] += e["logprobs"]
            pieces.setdefault(index, []).append((e["delta"].encode(), entry_bytes(e["logprobs"])))
        elif kind == "response.output_text.done":
            part = item["content"][e["content_index"]]
            assert (e["text"], e["logprobs"]) == (part["text"], part["logprobs"])
        elif kind == "response.content_part.done":
            assert e["part"] == item["content"][e["content_index"]]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert (e["arguments"], e["name"]) == (item["arguments"], item["name"])
        elif kind == "response.output_item.done":
            assert e["item"] == {**item, "status": e["item"]["status"]}
            finished[index] = e["item"]
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert set(finished) == set(items)
    for parts in pieces.values():
        if any(data for _, data in parts):
            for text, data in parts[:-1]:
                assert data == text
            assert parts[-1][1].startswith(parts[-1][0])
    return [finished[i] for i in sorted(finished)]


def streamed(http: httpx.Client, req: dict) -> tuple[dict, list[dict]]:
    """The final Response of a stream and its text delta events, after checking that the events come in order
    and build exactly that Response."""
    evs = events(http, req)
    kinds = [e["type"] for e in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    final = evs[-1]["response"]
    assert kinds[-1] == ("response.completed" if final["status"] == "completed" else "response.incomplete")
    check_response(final)
    for r in (evs[0]["response"], evs[1]["response"]):
        assert (
            r["id"] == final["id"] and r["status"] == "in_progress" and r["output"] == [] and "usage" not in r
        )
    assert built_output(evs[2:-1]) == final["output"]
    return final, [e for e in evs if e["type"] == "response.output_text.delta"]


def backend_request(gw, response_id: str) -> pb.GenerateRequest:
    [req] = [r for r in gw.scripted.servicer.requests if r.request_id == response_id]
    return req


def same_response(a: dict, b: dict) -> None:
    """Equal but for ids, times and the prompt tokens the prefix cache had (the later request may find the
    earlier one's blocks)."""

    def strip(r: dict) -> dict:
        r = copy.deepcopy(r)
        for key in ("id", "created_at", "completed_at"):
            r.pop(key)
        r["usage"]["input_tokens_details"].pop("cached_tokens")
        for item in r["output"]:
            item.pop("id")
            item.pop("call_id", None)
        return r

    assert strip(a) == strip(b)


# ---- plain and streamed -------------------------------------------------------------------------------------


def test_string_input_answers_one_message_without_logprobs(scripted_gateway) -> None:
    data = post(scripted_gateway.http, body(scripted_gateway))
    assert data["status"] == "completed" and data["model"] == MODEL_ID
    part = data["output"][0]["content"][0]
    assert part["text"] == DEFAULT_REPLY and part["logprobs"] == []
    prompt = render_chat([pb.ChatMessage(role="user", content="Hi!")])
    assert data["usage"]["input_tokens"] == len(prompt)
    assert data["usage"]["output_tokens"] == 9  # the EOS that ended it is not counted, as in chat
    assert data["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    # the request's settings echoed, with OpenAI's defaults where it gave none
    assert data["temperature"] == 1.0 and data["top_p"] == 1.0 and data["top_logprobs"] == 0
    assert data["tools"] == [] and data["tool_choice"] == "auto" and data["parallel_tool_calls"] is True
    assert data["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert data["store"] is False and data["metadata"] == {} and data["instructions"] is None
    req = backend_request(scripted_gateway, data["id"])
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "Hi!")]
    assert not req.logprobs.enabled and not req.HasField("guided") and req.n == 1


def test_request_fields_map_to_the_backend_request(scripted_gateway) -> None:
    gw = scripted_gateway
    history = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "one "}, {"type": "input_text", "text": "two"}],
        },
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}],
        },
        {"type": "message", "role": "user", "content": "say:ok"},
    ]
    data = post(
        gw.http,
        body(
            gw,
            history,
            instructions="You are terse.",
            temperature=0.5,
            top_p=0.9,
            max_output_tokens=7,
            seed=-1,
            metadata={"k": "v"},
            user="u1",
            safety_identifier="s1",
            store=False,
            cache_salt="tenant",
        ),
    )
    assert data["output"][0]["content"][0]["text"] == "ok"
    assert data["instructions"] == "You are terse." and data["metadata"] == {"k": "v"}
    assert data["temperature"] == 0.5 and data["top_p"] == 0.9 and data["max_output_tokens"] == 7
    assert data["user"] == "u1" and data["safety_identifier"] == "s1"
    req = backend_request(gw, data["id"])
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "You are terse."),
        ("system", "Be brief."),
        ("user", "one two"),
        ("assistant", "Hi there"),
        ("user", "say:ok"),
    ]
    assert req.sampling.temperature == 0.5 and abs(req.sampling.top_p - 0.9) < 1e-6
    assert req.sampling.seed == 2**64 - 1 and req.stopping.max_tokens == 7 and req.cache_salt == "tenant"


def test_function_call_items_become_assistant_tool_calls_and_tool_messages(scripted_gateway) -> None:
    gw = scripted_gateway
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {
            "type": "function_call",
            "id": "fc_2",
            "call_id": "call_2",
            "name": "get_time",
            "arguments": "{}",
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
        {"role": "user", "content": "say:thanks"},
    ]
    data = post(gw.http, body(gw, items))
    assert data["output"][0]["content"][0]["text"] == "thanks"
    messages = backend_request(gw, data["id"]).chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assert [(c.id, c.name, c.arguments) for c in messages[1].tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "get_time", "{}"),
    ]
    assert [(m.tool_call_id, m.name, m.content) for m in messages[2:4]] == [
        ("call_1", "get_weather", "sunny"),
        ("call_2", "get_time", "noon"),
    ]


@pytest.mark.parametrize("k", [None, 0, 3, 20])
def test_included_logprobs_equal_the_chat_endpoints(scripted_gateway, k) -> None:
    gw = scripted_gateway
    extra = {} if k is None else {"top_logprobs": k}
    data = post(gw.http, body(gw, include=LOGPROBS, **extra))
    part = data["output"][0]["content"][0]
    chat = gw.http.post(
        "/v1/chat/completions",
        json={"model": gw.model, "messages": [{"role": "user", "content": "Hi!"}], "logprobs": True, **extra},
    ).json()
    assert part["logprobs"] == chat["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in part["logprobs"]] == pytest.approx([logprob(j, 0) for j in range(9)])
    assert all(len(e["top_logprobs"]) == (k or 0) for e in part["logprobs"])
    req = backend_request(gw, data["id"])
    assert req.logprobs.enabled and req.logprobs.top_logprobs == (k or 0)


def test_a_special_alternative_has_null_bytes(scripted_gateway) -> None:
    data = post(scripted_gateway.http, body(scripted_gateway, include=LOGPROBS, top_logprobs=20))
    alternatives = [t for e in data["output"][0]["content"][0]["logprobs"] for t in e["top_logprobs"]]
    eos = [t for t in alternatives if t["token"] == SPECIALS[EOS]]
    assert eos and all(t["bytes"] is None for t in eos)
    assert any(t["logprob"] == -9999.0 for t in alternatives)  # -inf, as everywhere


def test_top_logprobs_without_include_gives_empty_logprobs(scripted_gateway) -> None:
    data = post(scripted_gateway.http, body(scripted_gateway, top_logprobs=5))
    assert data["output"][0]["content"][0]["logprobs"] == [] and data["top_logprobs"] == 5
    assert not backend_request(scripted_gateway, data["id"]).logprobs.enabled


@pytest.mark.parametrize("include", [None, LOGPROBS])
def test_streamed_events_build_the_plain_response(scripted_gateway, include) -> None:
    req = body(scripted_gateway, include=include, top_logprobs=2)
    final, deltas = streamed(scripted_gateway.http, req)
    plain = post(scripted_gateway.http, req)
    same_response(final, plain)
    assert len(deltas) > 1 and final["output"][0]["content"][0]["text"] == DEFAULT_REPLY
    kinds = [e["type"] for e in events(scripted_gateway.http, req)]
    assert kinds == [*TEXT_EVENTS[:4], *["response.output_text.delta"] * len(deltas), *TEXT_EVENTS[4:]] + [
        "response.completed"
    ]
    assert all((e["logprobs"] == []) == (include is None) for e in deltas)


def test_split_characters_stream_with_their_tokens(scripted_gateway) -> None:
    """An emoji is four byte tokens: the delta that completes it carries all four entries."""
    req = body(scripted_gateway, "say:a😀b", include=LOGPROBS)
    final, deltas = streamed(scripted_gateway.http, req)
    assert [e["delta"] for e in deltas] == ["a", "😀", "b"]
    assert [len(e["logprobs"]) for e in deltas] == [1, 4, 1]
    assert deltas[1]["logprobs"][0]["token"] == "\\xf0"
    same_response(final, post(scripted_gateway.http, req))


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_makes_the_response_incomplete(scripted_gateway, stream) -> None:
    req = body(scripted_gateway, "loop:ab", max_output_tokens=5, include=LOGPROBS)
    data = streamed(scripted_gateway.http, req)[0] if stream else post(scripted_gateway.http, req)
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["output"][0]["status"] == "incomplete"
    assert data["output"][0]["content"][0]["text"] == "ababa" and data["usage"]["output_tokens"] == 5


def test_cut_inside_a_character_keeps_the_token_but_not_the_half_character(scripted_gateway) -> None:
    req = body(scripted_gateway, "say:a😀", max_output_tokens=3, include=LOGPROBS)
    for data in (post(scripted_gateway.http, req), streamed(scripted_gateway.http, req)[0]):
        part = data["output"][0]["content"][0]
        assert data["status"] == "incomplete" and part["text"] == "a"
        assert entry_bytes(part["logprobs"]) == "a😀".encode()[:3]


def test_cached_prompt_tokens_are_reported(scripted_gateway) -> None:
    data = post(scripted_gateway.http, body(scripted_gateway, "cached:4 say:x"))
    assert data["usage"]["input_tokens_details"]["cached_tokens"] == 4


# ---- structured outputs ---------------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("fmt", "guided"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, pb.GuidedDecoding(json_object=True)),
        (
            {"type": "json_schema", "name": "place", "schema": SCHEMA, "strict": True},
            pb.GuidedDecoding(json_schema=json.dumps(SCHEMA)),
        ),
    ],
    ids=["text", "json_object", "json_schema"],
)
def test_text_format_maps_to_guided_decoding_and_is_echoed(scripted_gateway, fmt, guided) -> None:
    data = post(scripted_gateway.http, body(scripted_gateway, 'say:{"city": "Paris"}', text={"format": fmt}))
    assert data["text"] == {"format": fmt, "verbosity": "medium"}
    req = backend_request(scripted_gateway, data["id"])
    if guided is None:
        assert not req.HasField("guided")
    else:
        assert req.guided.WhichOneof("kind") == guided.WhichOneof("kind")
        if guided.HasField("json_schema"):
            assert json.loads(req.guided.json_schema) == SCHEMA
        else:
            assert req.guided.json_object


# ---- tools ----------------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
TIME = {"type": "function", "name": "get_time", "parameters": None, "strict": None}
ARGS = '{"city": "Paris"}'
CALL = f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'


def both(gw, req: dict) -> dict:
    """The plain Response, after checking that the streamed one is the same (ids aside)."""
    plain = post(gw.http, req)
    same_response(streamed(gw.http, req)[0], plain)
    return plain


def test_a_tool_call_is_a_function_call_item(scripted_gateway) -> None:
    gw = scripted_gateway
    data = both(gw, body(gw, f"say:{CALL}", tools=[WEATHER], include=LOGPROBS))
    [call] = data["output"]
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "get_weather", ARGS)
    assert data["status"] == "completed" and data["usage"]["output_tokens"] == len(CALL.encode())
    assert data["tools"] == [WEATHER] and data["tool_choice"] == "auto"
    req = backend_request(gw, data["id"])
    assert json.loads(req.chat.tools_json) == [
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    ]
    assert not req.HasField("guided")  # auto: the model chooses, nothing is forced


def test_a_call_streams_as_function_call_events(scripted_gateway) -> None:
    gw = scripted_gateway
    evs = events(gw.http, body(gw, f"say:{CALL}", tools=[WEATHER]))
    assert [e["type"] for e in evs] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert evs[2]["item"]["arguments"] == "" and evs[3]["delta"] == ARGS
    assert evs[4]["name"] == "get_weather" and evs[5]["item"]["call_id"] == evs[2]["item"]["call_id"]


def test_content_before_calls_is_a_message_with_its_own_logprobs(scripted_gateway) -> None:
    gw = scripted_gateway
    two = f'Sure! {CALL} <tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    data = both(gw, body(gw, f"say:{two}", tools=[WEATHER, TIME], include=LOGPROBS, top_logprobs=1))
    message, weather, time_call = data["output"]
    part = message["content"][0]
    assert part["text"] == "Sure! " and entry_bytes(part["logprobs"]) == b"Sure! "
    assert [(c["name"], c["arguments"]) for c in (weather, time_call)] == [
        ("get_weather", ARGS),
        ("get_time", "{}"),
    ]
    assert weather["call_id"] != time_call["call_id"]
    evs = events(gw.http, body(gw, f"say:{two}", tools=[WEATHER, TIME]))
    first_call = next(i for i, e in enumerate(evs) if e["type"] == "response.function_call_arguments.delta")
    text = "".join(e["delta"] for e in evs[:first_call] if e["type"] == "response.output_text.delta")
    assert text == "Sure! "  # streamed before the calls


@pytest.mark.parametrize(
    "reply",
    [
        DEFAULT_REPLY,
        '{"answer": 42}',
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "x", "arguments": {}}',
    ],
    ids=["text", "other-json", "bad-json", "unknown-function"],
)
def test_text_that_is_no_call_stays_a_message(scripted_gateway, reply) -> None:
    gw = scripted_gateway
    data = both(gw, body(gw, f"say:{reply}", tools=[WEATHER], include=LOGPROBS))
    [message] = data["output"]
    assert message["content"][0]["text"] == reply
    assert entry_bytes(message["content"][0]["logprobs"]) == reply.encode()


def test_tool_choice_none_offers_no_tools(scripted_gateway) -> None:
    gw = scripted_gateway
    data = both(gw, body(gw, f"say:{CALL}", tools=[WEATHER], tool_choice="none"))
    assert [item["type"] for item in data["output"]] == ["message"] and data["tool_choice"] == "none"
    assert backend_request(gw, data["id"]).chat.tools_json == ""


@pytest.mark.parametrize(
    ("choice", "parallel", "names", "many"),
    [
        ("required", None, ["get_weather", "get_time"], True),
        ("required", False, ["get_weather", "get_time"], False),
        ({"type": "function", "name": "get_time"}, None, ["get_time"], False),
    ],
    ids=["required", "required-one", "named"],
)
def test_forced_calls_are_constrained_by_a_grammar(scripted_gateway, choice, parallel, names, many) -> None:
    gw = scripted_gateway
    reply = '{"name": "get_time", "arguments": {}}'
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    data = both(gw, body(gw, f"say:{reply}", tools=[WEATHER, TIME], tool_choice=choice, **extra))
    [call] = data["output"]
    assert (call["name"], call["arguments"]) == ("get_time", "{}") and data["tool_choice"] == choice
    schema = json.loads(backend_request(gw, data["id"]).guided.json_schema)
    one = schema["items"] if many else schema
    alternatives = one.get("anyOf", [one])
    assert [a["properties"]["name"]["const"] for a in alternatives] == names
    assert (schema.get("type") == "array") == many


def test_structured_output_takes_over_from_auto_tools(scripted_gateway) -> None:
    gw = scripted_gateway
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA}
    data = post(gw.http, body(gw, f"say:{CALL}", tools=[WEATHER], text={"format": fmt}))
    assert [item["type"] for item in data["output"]] == ["message"]
    req = backend_request(gw, data["id"])
    assert req.chat.tools_json == "" and json.loads(req.guided.json_schema) == SCHEMA


def test_function_call_round_trip_with_the_sdk_objects(scripted_gateway, client) -> None:
    r = client.responses.create(model=MODEL_ID, input=f"say:Sure! {CALL}", tools=[WEATHER])
    assert [o.type for o in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert (call.name, call.arguments) == ("get_weather", ARGS)
    again = client.responses.create(
        model=MODEL_ID,
        input=[
            {"role": "user", "content": "weather?"},
            *r.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            {"role": "user", "content": "say:It is sunny."},
        ],
        tools=[WEATHER],
    )
    assert again.output_text == "It is sunny."
    messages = backend_request(scripted_gateway, again.id).chat.messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1].content == "Sure! " and messages[1].tool_calls[0].id == call.call_id
    assert (messages[2].tool_call_id, messages[2].name, messages[2].content) == (
        call.call_id,
        "get_weather",
        "sunny",
    )


def test_sdk_stream_helper_builds_function_calls(client) -> None:
    with client.responses.stream(model=MODEL_ID, input=f"say:{CALL}", tools=[WEATHER]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    [call] = final.output
    assert call.type == "function_call" and call.arguments == ARGS


# ---- the official SDK ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(scripted_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_sdk_create_reads_text_usage_and_typed_logprobs(client) -> None:
    r = client.responses.create(
        model=MODEL_ID, input="Hi!", include=["message.output_text.logprobs"], top_logprobs=2
    )
    assert r.status == "completed" and r.output_text == DEFAULT_REPLY
    entries = r.output[0].content[0].logprobs
    assert [e.token for e in entries][:3] == ["Hello", "!", " How"]
    assert all(len(e.top_logprobs) == 2 for e in entries) and r.usage.output_tokens == len(entries) == 9
    assert b"".join(bytes(e.bytes) for e in entries) == DEFAULT_REPLY.encode()


def test_sdk_plain_call_needs_nothing_but_model_and_input(client) -> None:
    r = client.responses.create(model=MODEL_ID, input="say:fine")
    assert r.output_text == "fine" and r.output[0].content[0].logprobs == []


def test_sdk_stream_parses_every_event(client) -> None:
    stream = client.responses.create(model=MODEL_ID, input="Hi!", stream=True, include=LOGPROBS)
    evs = list(stream)
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[-1].type == "response.completed"
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == DEFAULT_REPLY == evs[-1].response.output_text
    assert sum(len(e.logprobs) for e in evs if e.type == "response.output_text.delta") == 9


def test_sdk_stream_helper_accumulates_the_final_response(client) -> None:
    with client.responses.stream(model=MODEL_ID, input="say:streamed") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == "streamed"


def test_sdk_stream_helper_ends_on_an_incomplete_response(client) -> None:
    with client.responses.stream(model=MODEL_ID, input="loop:ab", max_output_tokens=3) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


class Place(pydantic.BaseModel):
    city: str


def test_sdk_parse_with_a_pydantic_text_format(scripted_gateway, client) -> None:
    r = client.responses.parse(model=MODEL_ID, input='say:{"city": "Paris"}', text_format=Place)
    assert r.output_parsed == Place(city="Paris")
    req = backend_request(scripted_gateway, r.id)
    schema = json.loads(req.guided.json_schema)
    assert schema["properties"]["city"]["type"] == "string" and schema["required"] == ["city"]


def test_sdk_stream_helper_parses_a_text_format(client) -> None:
    with client.responses.stream(model=MODEL_ID, input='say:{"city": "Rome"}', text_format=Place) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == Place(city="Rome")


# ---- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}, "bogus": 1}]}, "tools[0].bogus"),
        ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
        ({"tools": [{**WEATHER, "name": f"f{i}"} for i in range(129)]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
            "text.format",
        ),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"temperature": 2.5}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 2**31}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "text", "schema": {}}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"verbosity": "high"}}, "text.verbosity"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                ]
            },
            "input[1].call_id",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
            "input[0].arguments",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_or_unsupported_input_is_400_naming_the_parameter(scripted_gateway, extra, param, stream) -> None:
    req = {**body(scripted_gateway), **extra}
    if stream:
        req["stream"] = True
    err = error(scripted_gateway.http, RESPONSES, req, 400, param)
    assert err["type"] == "invalid_request_error"


def test_stream_options_only_with_stream(scripted_gateway) -> None:
    req = body(scripted_gateway, "say:x", stream_options={"include_obfuscation": False})
    error(scripted_gateway.http, RESPONSES, req, 400, "stream_options")
    final, _ = streamed(scripted_gateway.http, req)
    assert final["output"][0]["content"][0]["text"] == "x"


def test_missing_model_or_input_is_400(scripted_gateway) -> None:
    error(scripted_gateway.http, RESPONSES, {"input": "x"}, 400, "model")
    error(scripted_gateway.http, RESPONSES, {"model": MODEL_ID}, 400, "input")


def test_unknown_model_is_404(scripted_gateway) -> None:
    err = error(scripted_gateway.http, RESPONSES, {"model": "nope", "input": "x"}, 404)
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_backend_refusal_before_output_is_its_http_status(scripted_gateway, stream) -> None:
    req = body(scripted_gateway, "fail:INVALID_ARGUMENT:guided: not a schema", stream=stream)
    err = error(scripted_gateway.http, RESPONSES, req, 400)
    assert "not a schema" in err["message"]
    req["text"] = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    err = error(scripted_gateway.http, RESPONSES, req, 400, "text.format.schema")  # a grammar error names it
    req = body(scripted_gateway, "fail:RESOURCE_EXHAUSTED:queue full", stream=stream)
    error(scripted_gateway.http, RESPONSES, req, 429)


def test_failure_after_streaming_started_is_an_error_event(scripted_gateway, client) -> None:
    evs = events(scripted_gateway.http, body(scripted_gateway, "failmid: go"))
    assert [e["type"] for e in evs[:4]] == TEXT_EVENTS[:4] and evs[-1]["type"] == "error"
    last = evs[-1]
    assert last["message"] == last["error"]["message"] and last["error"]["type"] == "server_error"
    assert "response.completed" not in [e["type"] for e in evs]
    with pytest.raises(openai.APIError):  # the SDK raises on it
        list(client.responses.create(model=MODEL_ID, input="failmid: go", stream=True))


@pytest.mark.parametrize(("reason", "status"), [("ERROR", 500), ("CANCELLED", 503)])
def test_a_sample_ended_by_error_is_not_a_response(scripted_gateway, reason, status) -> None:
    error(scripted_gateway.http, RESPONSES, body(scripted_gateway, f"endwith:{reason}"), status)
    evs = events(scripted_gateway.http, body(scripted_gateway, f"endwith:{reason}"))
    assert evs[-1]["type"] == "error" and "response.completed" not in [e["type"] for e in evs]


# ---- logs -------------------------------------------------------------------------------------------------------


def _fields(record: logging.LogRecord) -> dict:
    return getattr(record, "fields", {})


def test_logged_prompt_is_the_items_text_whatever_else_they_carry(scripted) -> None:
    """With log_prompts the request's log line holds instructions and each item's text; what a client sends back
    with an earlier output (annotations, logprobs: any JSON, here nested 900 deep) is not serialized there."""
    deep: list = []
    for _ in range(900):
        deep = [deep]
    items = [
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "before", "annotations": [{"x": deep}]}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"role": "user", "content": "say:ok"},
    ]
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append  # type: ignore[method-assign]
    logger = logging.getLogger("tpuserve.gateway.requests")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    server = GatewayServer([scripted.address], log_prompts=True).start()
    try:
        r = httpx.post(
            server.url + RESPONSES,
            json={"model": MODEL_ID, "input": items, "instructions": "Sys"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 5
        while (
            not [x for x in lines if _fields(x).get("request_id") == r.json()["id"]]
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
    finally:
        server.stop()
        logger.removeHandler(handler)
        logger.setLevel(level)
    [record] = [x for x in lines if _fields(x).get("request_id") == r.json()["id"]]
    assert _fields(record)["prompt"] == {
        "instructions": "Sys",
        "input": [
            {"role": "assistant", "content": "before"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "out"},
            {"role": "user", "content": "say:ok"},
        ],
    }


# ---- the gateway's own OpenAPI document -----------------------------------------------------------------------


def test_openapi_document_describes_responses() -> None:
    doc = openapi.build()
    op = doc["paths"][RESPONSES]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "CreateResponseRequest"
    )
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Response")
    request = doc["components"]["schemas"]["CreateResponseRequest"]
    assert request["additionalProperties"] is False and set(request["required"]) == {"model", "input"}


def test_prompt_as_the_backend_renders_it(scripted_gateway) -> None:
    """input_tokens are the backend's count of the rendered chat prompt (instructions included)."""
    data = post(scripted_gateway.http, body(scripted_gateway, "say:x", instructions="Sys"))
    prompt = render_chat(
        [pb.ChatMessage(role="system", content="Sys"), pb.ChatMessage(role="user", content="say:x")]
    )
    assert data["usage"]["input_tokens"] == len(prompt)

"""Tool calls on /v1/chat/completions over the scripted backend: what the backend gets (tools_json, the forced-call
grammar), how replies become `tool_calls` (plain and streamed as `delta.tool_calls` fragments), tool turns sent
back, and every malformed tool field as a 400 naming it.

scripted_backend.py replies what `say:<text>` says (then EOS): these tests script the model's tool-call text.
"""

from __future__ import annotations

import json

import openai
import pytest
from gateway_checks import error, post, stream
from scripted_backend import DEFAULT_REPLY, encode
from tpuserve.http_gateway.tools import Piece, ToolCallStream, parse_tool_calls

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any arguments object
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ARGS = '{"city": "Paris"}'


def body(gw, content: str, **kw) -> dict:
    return {"model": gw.model, "messages": [{"role": "user", "content": content}], "max_tokens": 256, **kw}


def sent(gw):
    """The last GenerateRequest the scripted backend got."""
    return gw.scripted.servicer.requests[-1]


def assemble(chunks: list[dict]) -> dict[int, dict]:
    """Per choice: content, tool calls (fragments joined by `index`), logprob entries, token ids, finish reason.
    Checks the fragment rules: id, type and name only on a call's first fragment, indexes in order."""
    out: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            acc = out.setdefault(
                ch["index"],
                {"content": None, "calls": [], "entries": [], "token_ids": [], "finish_reason": None},
            )
            assert acc["finish_reason"] is None, "a chunk after the choice finished"
            delta = ch["delta"]
            if delta.get("content"):
                acc["content"] = (acc["content"] or "") + delta["content"]
            for frag in delta.get("tool_calls", []):
                if frag["index"] == len(acc["calls"]):  # a new call: its first fragment names it
                    assert frag["id"].startswith("call_") and frag["type"] == "function", frag
                    acc["calls"].append({"id": frag["id"], "name": frag["function"]["name"], "arguments": ""})
                else:
                    assert frag["index"] == len(acc["calls"]) - 1 and set(frag) == {"index", "function"}, frag
                    assert set(frag["function"]) == {"arguments"}
                acc["calls"][-1]["arguments"] += frag["function"].get("arguments", "")
            if ch["logprobs"] is not None:
                acc["entries"] += ch["logprobs"]["content"]
            acc["token_ids"] += ch.get("token_ids", [])
            if ch["finish_reason"] is not None:
                acc["finish_reason"] = ch["finish_reason"]
    return out


def plain(data: dict) -> dict[int, dict]:
    """The same view of a non-streamed completion (ids kept for the callers that check them)."""
    out = {}
    for ch in data["choices"]:
        msg = ch["message"]
        calls = [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in msg.get("tool_calls", [])
        ]
        assert all(c["type"] == "function" for c in msg.get("tool_calls", []))
        entries = ch["logprobs"]["content"] if ch["logprobs"] else []
        out[ch["index"]] = {
            "content": msg["content"],
            "calls": calls,
            "entries": entries,
            "token_ids": ch.get("token_ids", []),
            "finish_reason": ch["finish_reason"],
        }
    return out


def without_ids(choices: dict[int, dict]) -> dict[int, dict]:
    return {i: {**c, "calls": [{**k, "id": None} for k in c["calls"]]} for i, c in choices.items()}


def both(gw, req: dict) -> dict[int, dict]:
    """Non-streamed and streamed answers, which must agree (call ids aside); the non-streamed one is returned."""
    data = plain(post(gw.http, CHAT, req))
    streamed = assemble(stream(gw.http, CHAT, req))
    assert without_ids(streamed) == without_ids(data)
    return data


# ---- auto ---------------------------------------------------------------------------------------------------


def test_auto_hermes_call_becomes_tool_calls(scripted_gateway) -> None:
    gw = scripted_gateway
    data = post(gw.http, CHAT, body(gw, f"say:{CALL}", tools=[WEATHER], logprobs=True))
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["refusal"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert call["id"].startswith("call_") and len(call["id"]) == len("call_") + 24
    # the generated tokens' logprobs stay: every token of the call text, the EOS dropped as always
    assert b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"]) == CALL.encode()
    req = sent(gw)
    assert json.loads(req.chat.tools_json) == [WEATHER]
    assert not req.HasField("guided")  # auto: the model chooses, nothing is forced


def test_auto_streams_and_agrees_with_the_plain_answer(scripted_gateway) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, f"say:{CALL}", tools=[WEATHER], logprobs=True, top_logprobs=2))
    assert got[0]["calls"][0]["name"] == "get_weather" and got[0]["calls"][0]["arguments"] == ARGS
    assert got[0]["content"] is None and got[0]["finish_reason"] == "tool_calls"


def test_streamed_call_fragments_have_the_openai_shape(scripted_gateway) -> None:
    gw = scripted_gateway
    chunks = stream(gw.http, CHAT, body(gw, f"say:{CALL}", tools=[WEATHER], logprobs=True))
    frags = [
        (c["choices"][0], f)
        for c in chunks
        if c["choices"]
        for f in c["choices"][0]["delta"].get("tool_calls", [])
    ]
    (first, head), (_, rest) = frags
    assert head == {
        "index": 0,
        "id": head["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert rest == {"index": 0, "function": {"arguments": ARGS}}
    assert first["logprobs"]["content"]  # the held tokens' entries come with the call
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(
        "content" not in c["choices"][0]["delta"]
        for c in chunks
        if c["choices"][0]["delta"].get("tool_calls")
    )


def test_content_before_a_call_is_content_and_streams_first(scripted_gateway) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, f"say:Sure! {CALL}", tools=[WEATHER], logprobs=True))
    assert got[0]["content"] == "Sure! " and got[0]["finish_reason"] == "tool_calls"
    assert [c["name"] for c in got[0]["calls"]] == ["get_weather"]
    chunks = stream(gw.http, CHAT, body(gw, f"say:Sure! {CALL}", tools=[WEATHER]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert (
        "".join(d.get("content") or "" for d in deltas[:first_call]) == "Sure! "
    )  # streamed before the call


def test_two_calls_in_one_answer(scripted_gateway) -> None:
    gw = scripted_gateway
    two = CALL + ' <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    got = both(gw, body(gw, f"say:{two}", tools=[WEATHER, TIME]))
    assert [(c["name"], c["arguments"]) for c in got[0]["calls"]] == [
        ("get_weather", ARGS),
        ("get_time", "{}"),
    ]
    assert len({c["id"] for c in got[0]["calls"]}) == 2


def test_a_bare_json_call_is_a_call(scripted_gateway) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, 'say:{"name": "get_weather", "arguments": {"city": "Paris"}}', tools=[WEATHER]))
    assert got[0]["calls"][0]["arguments"] == ARGS and got[0]["content"] is None


@pytest.mark.parametrize(
    "reply",
    [
        DEFAULT_REPLY,
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered function
        "<tool_call>{not json</tool_call>",
        '{"answer": 42}',  # JSON, but no call
        "a < b and <tool is not a tag",
    ],
    ids=["text", "unknown-function", "bad-json", "other-json", "angle-brackets"],
)
def test_text_that_is_no_call_stays_content(scripted_gateway, reply) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, f"say:{reply}", tools=[WEATHER], logprobs=True))
    assert got[0] == {**got[0], "content": reply, "calls": [], "finish_reason": "stop"}
    assert b"".join(bytes(e["bytes"]) for e in got[0]["entries"]) == reply.encode()


@pytest.mark.parametrize("depth", [999, 1001, 5000])
def test_json_nested_deeper_than_the_parser_goes_is_no_call(depth) -> None:
    """A model may write anything: JSON nested past Python's recursion limit is text, never a 500."""
    nested_args = "{" + '"a": {' * depth + "}" * (depth + 1)
    for text in (
        f'{{"name": "f", "arguments": {nested_args}}}',
        f'<tool_call>{{"name": "f", "arguments": {nested_args}}}',
    ):
        parsed = parse_tool_calls(text, ["f"])
        assert parsed is None or json.loads(parsed.calls[0].arguments)  # parsed only when it round-trips
        assert parsed is None or depth < 1000
        held = ToolCallStream(["f"])
        assert held.feed(Piece(text)) == []
        assert held.finish()[0] == parsed


def test_plain_answers_under_auto_still_stream_token_by_token(scripted_gateway) -> None:
    gw = scripted_gateway
    chunks = stream(gw.http, CHAT, body(gw, "Hi!", tools=[WEATHER]))
    pieces = [
        c["choices"][0]["delta"]["content"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert "".join(pieces) == DEFAULT_REPLY and len(pieces) >= len(encode(DEFAULT_REPLY, False)) - 1


def test_n_samples_are_parsed_each(scripted_gateway) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, f"say:{CALL}", tools=[WEATHER], n=2, seed=3))
    assert sorted(got) == [0, 1] and all(c["finish_reason"] == "tool_calls" for c in got.values())


# ---- none / required / named ------------------------------------------------------------------------------------


def test_none_offers_no_tools_and_parses_nothing(scripted_gateway) -> None:
    gw = scripted_gateway
    got = both(gw, body(gw, f"say:{CALL}", tools=[WEATHER], tool_choice="none"))
    assert got[0]["content"] == CALL and got[0]["calls"] == [] and got[0]["finish_reason"] == "stop"
    assert sent(gw).chat.tools_json == "" and not sent(gw).HasField("guided")


def _call_schema(name: str, arguments: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def test_required_constrains_to_a_list_of_calls(scripted_gateway) -> None:
    gw = scripted_gateway
    reply = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    got = both(gw, body(gw, f"say:{reply}", tools=[WEATHER, TIME], tool_choice="required"))
    assert [c["name"] for c in got[0]["calls"]] == ["get_weather", "get_time"]
    schema = json.loads(sent(gw).guided.json_schema)
    weather = _call_schema("get_weather", WEATHER["function"]["parameters"])
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [weather, _call_schema("get_time", {"type": "object", "properties": {}})]},
    }
    assert json.loads(sent(gw).chat.tools_json) == [
        WEATHER,
        {**TIME, "function": {**TIME["function"], "parameters": {"type": "object", "properties": {}}}},
    ]


def test_required_without_parallel_calls_is_one_object(scripted_gateway) -> None:
    gw = scripted_gateway
    reply = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    got = both(
        gw, body(gw, f"say:{reply}", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    )
    assert got[0]["calls"][0]["arguments"] == ARGS
    assert json.loads(sent(gw).guided.json_schema) == _call_schema(
        "get_weather", WEATHER["function"]["parameters"]
    )


def test_named_function_forces_one_call_of_it(scripted_gateway) -> None:
    gw = scripted_gateway
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    got = both(gw, body(gw, f"say:{reply}", tools=[TIME, WEATHER], tool_choice=choice))
    assert got[0]["calls"][0]["name"] == "get_weather" and got[0]["finish_reason"] == "tool_calls"
    assert json.loads(sent(gw).guided.json_schema) == _call_schema(
        "get_weather", WEATHER["function"]["parameters"]
    )


def test_defs_of_the_parameters_move_to_the_root_of_the_forced_grammar(scripted_gateway) -> None:
    gw = scripted_gateway
    params = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "$defs": {"Unit": {"enum": ["C", "F"]}},
    }
    tool = {"type": "function", "function": {"name": "temp", "parameters": params}}
    reply = '{"name": "temp", "arguments": {"unit": "C"}}'
    got = both(gw, body(gw, f"say:{reply}", tools=[tool], tool_choice="required", parallel_tool_calls=False))
    assert got[0]["calls"][0]["arguments"] == '{"unit": "C"}'
    schema = json.loads(sent(gw).guided.json_schema)
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}}
    assert "$defs" not in schema["properties"]["arguments"]


# ---- conversations with tool turns ------------------------------------------------------------------------------


def test_assistant_calls_and_tool_results_go_to_the_backend(scripted_gateway) -> None:
    gw = scripted_gateway
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "say:Sunny, 21 C."},
    ]
    data = post(
        gw.http, CHAT, {"model": gw.model, "messages": messages, "tools": [WEATHER], "max_tokens": 16}
    )
    assert data["choices"][0]["message"]["content"] == "Sunny, 21 C."
    m = sent(gw).chat.messages
    assert [x.role for x in m] == ["user", "assistant", "tool"]
    assert [(c.id, c.name, c.arguments) for c in m[1].tool_calls] == [("call_1", "get_weather", ARGS)]
    assert m[1].content == "" and m[2].tool_call_id == "call_1" and m[2].content == "say:Sunny, 21 C."


# ---- the official SDK ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(scripted_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_sdk_reads_tool_calls(client, scripted_gateway) -> None:
    out = client.chat.completions.create(
        model=scripted_gateway.model, messages=[{"role": "user", "content": f"say:{CALL}"}], tools=[WEATHER]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_sdk_stream_helper_accumulates_the_fragments(client, scripted_gateway) -> None:
    with client.chat.completions.stream(
        model=scripted_gateway.model, messages=[{"role": "user", "content": f"say:{CALL}"}], tools=[WEATHER]
    ) as events:
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        final = events.get_final_completion()
    assert [(e.name, e.arguments) for e in done] == [("get_weather", ARGS)]
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert final.choices[0].finish_reason == "tool_calls"


# ---- bad input -------------------------------------------------------------------------------------------------


CALL_1 = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(40)}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [WEATHER] * 129}, "tools"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "tool_call_id": "call_9", "content": "r"},
                ]
            },
            "messages[1].tool_call_id",
        ),
        ({"messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL_1]}]}, "messages[0].tool_calls"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
            "messages[0].tool_call_id",
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages[0].tool_calls"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{**CALL_1, "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{**CALL_1, "type": "custom"}]}]},
            "messages[0].tool_calls[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(scripted_gateway, extra, param) -> None:
    err = error(scripted_gateway.http, CHAT, body(scripted_gateway, "Hi!", **extra), 400, param)
    assert err["type"] == "invalid_request_error"


def test_orphan_tool_result_after_a_different_call_is_400(scripted_gateway) -> None:
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [CALL_1]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        {"role": "tool", "tool_call_id": "call_2", "content": "orphan"},
    ]
    error(
        scripted_gateway.http,
        CHAT,
        {"model": scripted_gateway.model, "messages": messages},
        400,
        "messages[2].tool_call_id",
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_a_parameters_schema_the_backend_refuses_is_400_naming_tools(scripted_gateway, streamed) -> None:
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}},
    }
    req = body(scripted_gateway, "Hi!", tools=[bad], tool_choice="required", stream=streamed)
    err = error(scripted_gateway.http, CHAT, req, 400, "tools")
    assert "guided" in err["message"]
    # under "auto" nothing is compiled: the schema is the model's reading only
    post(scripted_gateway.http, CHAT, body(scripted_gateway, "Hi!", tools=[bad]))

"""Structured outputs on /v1/chat/completions over the scripted backend: `response_format` becomes the proto's
`guided` grammar exactly, bad formats and schemas are 400s naming `response_format`, and the official SDK's
`parse` reads a reply into its pydantic model.

The scripted backend does not constrain anything: a test scripts a conforming reply with `say:` and checks what
the backend was asked; the real backend's constraint is tested in test_real_structured_tools.py. It does refuse
schemas as the real one does (scripted_backend.guided_error).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from gateway_checks import error, post, stream

CHAT = "/v1/chat/completions"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
REPLY = '{"city": "Paris", "population": 2}'


def body(gw, content: str = f"say:{REPLY}", **kw) -> dict:
    return {"model": gw.model, "messages": [{"role": "user", "content": content}], "max_tokens": 128, **kw}


def sent(gw):
    return gw.scripted.servicer.requests[-1]


def json_schema(schema: dict | None = SCHEMA, **kw) -> dict:
    spec = {"name": "city_facts", **kw}
    if schema is not None:
        spec["schema"] = schema
    return {"type": "json_schema", "json_schema": spec}


@pytest.mark.parametrize("strict", [True, False, None])
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_json_schema_is_sent_as_the_guided_schema(scripted_gateway, strict, streamed) -> None:
    gw = scripted_gateway
    fmt = json_schema(strict=strict) if strict is not None else json_schema()
    req = body(gw, response_format=fmt)
    if streamed:
        content = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in stream(gw.http, CHAT, req) if c["choices"]
        )
    else:
        content = post(gw.http, CHAT, req)["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)
    req = sent(gw)
    assert req.guided.WhichOneof("kind") == "json_schema"
    assert json.loads(req.guided.json_schema) == SCHEMA
    assert req.chat.tools_json == ""


def test_json_schema_without_a_schema_is_any_json_value(scripted_gateway) -> None:
    gw = scripted_gateway
    post(gw.http, CHAT, body(gw, response_format=json_schema(None, description="anything")))
    assert json.loads(sent(gw).guided.json_schema) == {}


def test_json_object_is_sent_as_json_object(scripted_gateway) -> None:
    gw = scripted_gateway
    data = post(gw.http, CHAT, body(gw, response_format={"type": "json_object"}))
    assert isinstance(json.loads(data["choices"][0]["message"]["content"]), dict)
    assert sent(gw).guided.WhichOneof("kind") == "json_object" and sent(gw).guided.json_object


def test_text_format_constrains_nothing(scripted_gateway) -> None:
    gw = scripted_gateway
    post(gw.http, CHAT, body(gw, "Hi!", response_format={"type": "text"}))
    assert not sent(gw).HasField("guided")


def test_structured_output_with_tools_under_auto_is_not_parsed_for_calls(scripted_gateway) -> None:
    """The format constrains the whole output: tools are not offered, and the JSON is content."""
    gw = scripted_gateway
    call = '{"name": "f", "arguments": {}}'
    tool = {"type": "function", "function": {"name": "f"}}
    data = post(gw.http, CHAT, body(gw, f"say:{call}", tools=[tool], response_format={"type": "json_object"}))
    assert data["choices"][0]["message"]["content"] == call and data["choices"][0]["finish_reason"] == "stop"
    assert sent(gw).chat.tools_json == "" and sent(gw).guided.json_object


def deep_list(depth: int) -> dict:
    """A schema whose `enum` value nests `depth` lists: a grammar nobody needs, and a recursion risk for all."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return {"enum": [value]}


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
        (
            json_schema(SCHEMA) | {"json_schema": {"name": "a b", "schema": SCHEMA}},
            "response_format.json_schema.name",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}},
            "response_format.json_schema.schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "n", "extra": 1}},
            "response_format.json_schema.extra",
        ),
        ({"type": "json_object", "json_schema": {"name": "n"}}, "response_format.json_schema"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "extra": 1}, "response_format.extra"),
        ({}, "response_format.type"),
        ("json", "response_format"),
        (json_schema(deep_list(70)), "response_format.json_schema.schema"),
    ],
)
def test_malformed_response_formats_are_400_naming_the_field(scripted_gateway, fmt, param) -> None:
    err = error(scripted_gateway.http, CHAT, body(scripted_gateway, response_format=fmt), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "nope"},
        {"type": "object", "properties": {"a": {"$ref": "https://example.com/schema.json"}}},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}},
        {"type": "object", "required": "a"},
    ],
    ids=["bad-type", "remote-ref", "dangling-ref", "required-not-a-list"],
)
@pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
def test_a_schema_the_backend_refuses_is_400_naming_response_format(
    scripted_gateway, schema, streamed
) -> None:
    err = error(
        scripted_gateway.http, CHAT, body(scripted_gateway, response_format=json_schema(schema), stream=streamed), 400,
        "response_format",
    )  # fmt: skip
    assert err["code"] == "invalid_value" and "guided" in err["message"]


def test_a_schema_with_nan_is_400(scripted_gateway) -> None:
    """NaN cannot come through JSON; the body parser refuses it before the schema is looked at."""
    raw = json.dumps(body(scripted_gateway, response_format=json_schema({"maximum": float("nan")})))
    error(scripted_gateway.http, CHAT, raw.encode(), 400)


# ---- the official SDK -------------------------------------------------------------------------------------------


class CityFacts(pydantic.BaseModel):
    city: str
    population: int


def test_sdk_parse_reads_the_reply_into_the_model(scripted_gateway) -> None:
    gw = scripted_gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.chat.completions.parse(
        model=gw.model, messages=[{"role": "user", "content": f"say:{REPLY}"}], response_format=CityFacts
    )
    assert out.choices[0].message.parsed == CityFacts(city="Paris", population=2)
    schema = json.loads(sent(gw).guided.json_schema)
    assert schema["properties"].keys() == {"city", "population"} and schema["additionalProperties"] is False

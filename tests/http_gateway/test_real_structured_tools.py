"""Structured outputs, tool calls and token ids against the REAL backend (the warmed engine, embedded SmolLM2-135M),
through the clients people use: the official SDK's `parse` and tools, LangChain's `with_structured_output(...,
method="json_schema")` and `bind_tools(..., tool_choice=...)`.

The model is tiny and not trained for tools, so every call here is forced (`required` or a named function): the
grammar, not the model, makes it a call. Schemas use enums where the model would otherwise ramble, so that
outputs end well inside max_tokens (the engine's context here is 256 tokens). Generation is on CPU: few
requests, short ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import pydantic
import pytest
from gateway_harness import real_gateway, sse_json

from tests.helpers import require_extra

CHAT = "/v1/chat/completions"
MAX_TOKENS = 48


class Capital(pydantic.BaseModel):
    country: Literal["France", "Germany", "Italy"]
    capital: Literal["Paris", "Berlin", "Rome"]


class GetWeather(pydantic.BaseModel):
    """Get the current weather in a city."""

    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["C", "F"]


# GetWeather's schema without pydantic's titles: the engine's context here is 256 tokens, and the generic tool
# prompt lists the schema
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "GetWeather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALL_TOKENS = 32  # {"name": "GetWeather", "arguments": {"city": "Tokyo", "unit": "C"}} and the EOS


@pytest.fixture(scope="module")
def real(real_backend_address) -> Iterator[tuple[str, str, httpx.Client]]:
    """(base url, model id, client) of a gateway whose only backend is the real one."""
    yield from real_gateway(real_backend_address, timeout=300)


def _post(http: httpx.Client, body: dict) -> dict:
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(http: httpx.Client, body: dict) -> dict:
    """A streamed answer assembled: content, calls (name, arguments), logprob entries, finish reason."""
    r = http.post(CHAT, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    out: dict = {"content": None, "calls": [], "entries": [], "finish_reason": None}
    for c in sse_json(r.text):
        assert "error" not in c, c
        for ch in c["choices"]:
            delta = ch["delta"]
            if delta.get("content"):
                out["content"] = (out["content"] or "") + delta["content"]
            for frag in delta.get("tool_calls", []):
                if frag["index"] == len(out["calls"]):
                    out["calls"].append([frag["function"]["name"], ""])
                out["calls"][frag["index"]][1] += frag["function"].get("arguments", "")
            out["entries"] += (ch["logprobs"] or {}).get("content") or []
            out["finish_reason"] = ch["finish_reason"] or out["finish_reason"]
    return out


def _plain(data: dict) -> dict:
    choice = data["choices"][0]
    calls = [
        [c["function"]["name"], c["function"]["arguments"]] for c in choice["message"].get("tool_calls", [])
    ]
    entries = choice["logprobs"]["content"] if choice["logprobs"] else []
    return {"content": choice["message"]["content"], "calls": calls, "entries": entries,
            "finish_reason": choice["finish_reason"]}  # fmt: skip


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- structured outputs ---------------------------------------------------------------------------------------


def test_sdk_parse_gives_the_model_and_streaming_agrees(real) -> None:
    openai = require_extra("openai")
    url, model, http = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.chat.completions.parse(
        model=model, messages=_messages("What is the capital of France?"), response_format=Capital,
        max_tokens=MAX_TOKENS, temperature=0,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Capital)
    # the same request, sampled with a seed, streamed and not: the same JSON and the same logprobs
    schema = {"name": "Capital", "schema": Capital.model_json_schema(), "strict": True}
    body = {"model": model, "messages": _messages("Name a country and its capital."), "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 11, "logprobs": True, "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": schema}}  # fmt: skip
    plain = _plain(_post(http, body))
    assert plain == _streamed(http, body)
    assert plain["finish_reason"] == "stop"
    jsonschema.validate(json.loads(plain["content"]), Capital.model_json_schema())
    assert b"".join(bytes(e["bytes"]) for e in plain["entries"]) == plain["content"].encode()


def test_json_object_is_an_object(real) -> None:
    _, model, http = real
    data = _post(http, {"model": model, "messages": _messages('Reply with the JSON object {"answer": "yes"}.'),
                        "max_tokens": MAX_TOKENS, "temperature": 0, "response_format": {"type": "json_object"}})  # fmt: skip
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_a_schema_the_backend_refuses_is_400_naming_response_format(real) -> None:
    _, model, http = real
    bad = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    r = http.post(CHAT, json={"model": model, "messages": _messages("Hi"), "max_tokens": 4,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": bad}}})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_langchain_with_structured_output_json_schema(real) -> None:
    langchain_openai = require_extra("langchain_openai")
    url, model, _ = real
    llm = langchain_openai.ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", max_tokens=MAX_TOKENS,
                                      temperature=0, max_retries=0)  # fmt: skip
    answer = llm.with_structured_output(Capital, method="json_schema").invoke("What is the capital of Italy?")
    assert isinstance(answer, Capital)


# ---- tool calls -------------------------------------------------------------------------------------------------


def test_langchain_bind_tools_named_and_required(real) -> None:
    langchain_openai = require_extra("langchain_openai")
    url, model, _ = real
    llm = langchain_openai.ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", max_tokens=MAX_TOKENS,
                                      temperature=0, max_retries=0)  # fmt: skip
    for choice in ("GetWeather", "required"):
        # strict: LangChain closes the schema (additionalProperties: false), as OpenAI's strict mode needs; an open
        # one lets this tiny model add keys until max_tokens
        tools = llm.bind_tools([GetWeather], tool_choice=choice, parallel_tool_calls=False, strict=True)
        msg = tools.invoke("What is the weather in Paris?")
        assert msg.response_metadata["finish_reason"] == "tool_calls", msg
        (call,) = msg.tool_calls
        assert call["name"] == "GetWeather" and call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])


def test_sdk_forced_call_streams_as_it_answers(real) -> None:
    _, model, http = real
    body = {"model": model, "messages": _messages("Weather in Tokyo, please."), "max_tokens": CALL_TOKENS,
            "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "GetWeather"}},
            "temperature": 1.0, "seed": 5, "logprobs": True}  # fmt: skip
    plain = _plain(_post(http, body))
    assert plain == _streamed(http, body)
    assert plain["finish_reason"] == "tool_calls" and plain["content"] is None
    ((name, arguments),) = plain["calls"]
    assert name == "GetWeather"
    GetWeather.model_validate_json(arguments)
    assert plain["entries"]  # the call's tokens keep their logprobs


def test_sdk_sends_the_call_and_its_result_back(real) -> None:
    openai = require_extra("openai")
    url, model, _ = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    first = client.chat.completions.create(
        model=model, messages=_messages("Weather in London?"), tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, max_tokens=CALL_TOKENS, temperature=0,
    )  # fmt: skip
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [*_messages("Weather in London?"), message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]  # fmt: skip
    second = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=8, temperature=0
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


# ---- token ids --------------------------------------------------------------------------------------------------


def test_token_ids_and_prompt_logprobs_match_the_tokenizer(real, embedded) -> None:
    _, model, http = real
    tok = embedded.tokenizer
    data = _post(http, {"model": model, "messages": _messages("Hi!"), "max_tokens": 8, "temperature": 0,
                        "logprobs": True, "return_token_ids": True, "prompt_logprobs": 1})  # fmt: skip
    prompt_ids = data["prompt_token_ids"]
    assert "Hi!" in "".join(tok.token_text(i) for i in prompt_ids)
    assert data["usage"]["prompt_tokens"] == len(prompt_ids) == len(data["prompt_logprobs"])
    assert data["prompt_logprobs"][0] is None
    for pid, entry in zip(prompt_ids[1:], data["prompt_logprobs"][1:], strict=True):
        own = entry[str(pid)]
        assert own["logprob"] <= 0 and (own["rank"] is None or own["rank"] >= 1)
        assert 1 <= len(entry) <= 2
    choice = data["choices"][0]
    entries = choice["logprobs"]["content"]
    assert [bytes(e["bytes"]) for e in entries] == [tok.token_bytes[i] for i in choice["token_ids"]]

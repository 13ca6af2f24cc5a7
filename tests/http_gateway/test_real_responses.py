"""/v1/responses over the REAL backend (the warmed engine with the embedded model), greedy:

1. The included logprobs equal the chat endpoint's for the same conversation, token for token (both are one chat
   request to the same engine); the streamed events build exactly the plain Response.
2. The official SDK, plain and streamed, and `max_output_tokens` making the Response incomplete.
3. `text.format` json_schema through the SDK's `parse`, and a forced function call (a named `tool_choice`):
   the backend's grammar, not this tiny model, makes the output valid; enums keep it short.

Generation is on CPU here: few requests, small max_output_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from gateway_checks import strict_json
from gateway_harness import real_gateway
from test_gateway_responses import LOGPROBS, RESPONSES, check_response, same_response, streamed, validate

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def real(real_backend_address) -> Iterator[tuple[str, str, httpx.Client]]:
    """(base url, model id, client) of a gateway whose only backend is the real one."""
    yield from real_gateway(real_backend_address)


def _post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return strict_json(r.text)  # type: ignore[return-value]


def test_logprobs_equal_the_chat_endpoints_and_streamed_equals_plain(real) -> None:
    _, model, http = real
    req = {
        "model": model,
        "instructions": "You are a concise assistant.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        "include": LOGPROBS,
        "top_logprobs": 3,
        "temperature": 0,
        "max_output_tokens": 12,
    }
    plain = _post(http, RESPONSES, req)
    validate(plain, "Response")
    check_response(plain)
    final, deltas = streamed(http, req)
    same_response(final, plain)
    assert len(deltas) > 1
    chat = _post(
        http,
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": QUESTION},
            ],
            "logprobs": True,
            "top_logprobs": 3,
            "temperature": 0,
            "max_tokens": 12,
        },
    )
    choice = chat["choices"][0]
    part = plain["output"][0]["content"][0]
    assert part["text"] == choice["message"]["content"] and part["text"]
    assert part["logprobs"] == choice["logprobs"]["content"]
    assert plain["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert plain["usage"]["output_tokens"] == chat["usage"]["completion_tokens"] == len(part["logprobs"])
    assert plain["status"] == ("completed" if choice["finish_reason"] == "stop" else "incomplete")


def test_sdk_create_and_stream_cut_by_max_output_tokens(real) -> None:
    url, model, _ = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = {
        "model": model,
        "input": "Write a long story about a dragon.",
        "temperature": 0,
        "max_output_tokens": 6,
    }
    r = client.responses.create(**ask)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.usage.output_tokens == 6 and r.output[0].content[0].logprobs == []
    events = list(client.responses.create(**ask, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == r.output_text


class Capital(pydantic.BaseModel):
    country: Literal["France", "Germany", "Italy"]
    capital: Literal["Paris", "Berlin", "Rome"]


# A closed schema (enums, no other keys): the grammar ends the call well inside max_output_tokens.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def test_sdk_parse_with_a_json_schema_text_format(real) -> None:
    url, model, _ = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.responses.parse(
        model=model,
        input="What is the capital of France? Answer in JSON.",
        text_format=Capital,
        temperature=0,
        max_output_tokens=32,
    )
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, Capital) and r.output_parsed == Capital.model_validate_json(
        r.output_text
    )


def test_a_forced_function_call_is_a_function_call_item(real) -> None:
    _, model, http = real
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    }
    req = {
        "model": model,
        "input": "What is the weather like in Paris?",
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 32,
    }
    plain = _post(http, RESPONSES, req)
    validate(plain, "Response")
    check_response(plain)
    [call] = plain["output"]
    assert (
        plain["status"] == "completed" and call["type"] == "function_call" and call["name"] == "get_weather"
    )
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
    final, _ = streamed(http, req)
    same_response(final, plain)

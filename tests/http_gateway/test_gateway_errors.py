"""Errors: always `{"error": {message, type, param, code}}` with OpenAI's status codes; never FastAPI's 422."""

from __future__ import annotations

import json

import pytest
from gateway_checks import check_spec, error, post, strict_json
from gateway_harness import sse_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(gw, **kw) -> dict:
    return {"model": gw.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}


def completion(gw, **kw) -> dict:
    return {"model": gw.model, "prompt": "Hi", "max_tokens": 4, **kw}


# ---- schema violations: 400 naming the field ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": 5}, "stop"),
        ({"seed": 2**63}, "seed"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stream": "true"}, "stream"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"model": 3}, "model"),
    ],
)
def test_chat_bounds_and_types_are_400_naming_the_field(gateway, extra, param) -> None:
    err = error(gateway.http, CHAT, chat(gateway, **extra), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 21}, "best_of"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt[1]"),
        ({"prompt": [[1], []]}, "prompt[1]"),
        ({"prompt": None}, "prompt"),
        ({"echo": 1}, "echo"),
    ],
)
def test_completion_bounds_and_types_are_400_naming_the_field(gateway, extra, param) -> None:
    error(gateway.http, COMPLETIONS, completion(gateway, **extra), 400, param)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_missing_required_fields_are_400(gateway, path) -> None:
    err = error(gateway.http, path, {"model": gateway.model}, 400)
    assert err["param"] in ("messages", "prompt")
    err = error(gateway.http, path, {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 400)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (CHAT, {"web_search_options": {}}),
        (CHAT, {"functions": [{"name": "f"}]}),
        (CHAT, {"modalities": ["text"]}),
        (CHAT, {"not_a_field": 1}),
        (COMPLETIONS, {"not_a_field": 1}),
        (COMPLETIONS, {"top_logprobs": 2}),
        # vLLM's extension: not a field here, so more stop ids than the engine holds (MAX_STOP_IDS) cannot come
        # over HTTP; over gRPC they are INVALID_ARGUMENT (grpc_service/test_validation.py, test_real_engine.py)
        (CHAT, {"stop_token_ids": list(range(9))}),
        (COMPLETIONS, {"stop_token_ids": list(range(9))}),
    ],
)
def test_unknown_or_unimplemented_fields_are_400_naming_the_field(gateway, path, field) -> None:
    body = (chat if path == CHAT else completion)(gateway, **field)
    (name,) = field
    err = error(gateway.http, path, body, 400, name)
    assert name in err["message"]


def test_unknown_field_inside_a_message_is_named(gateway) -> None:
    body = chat(gateway, messages=[{"role": "user", "content": "x", "name": "bob"}])
    error(gateway.http, CHAT, body, 400, "messages[0].name")


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"logit_bias": {"50256": -100}}, "logit_bias"),
        (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
        (CHAT, {"frequency_penalty": -1}, "frequency_penalty"),
        (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"suffix": "end"}, "suffix"),
        (COMPLETIONS, {"logit_bias": {"1": 5}}, "logit_bias"),
        (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),
        (COMPLETIONS, {"best_of": 3, "stream": True}, "best_of"),
    ],
)
def test_unsupported_values_are_400_naming_the_field(gateway, path, extra, param) -> None:
    body = (chat if path == CHAT else completion)(gateway, **extra)
    error(gateway.http, path, body, 400, param)


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (
            CHAT,
            {
                "logit_bias": {},
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "user": "u1",
                "response_format": {"type": "text"},
                "seed": -5,
                "stop": "x",
                "n": 1,
                "stream": False,
                "max_completion_tokens": 4,
                "top_p": 1,
                "temperature": 0,
            },
        ),
        (
            COMPLETIONS,
            {
                "logit_bias": None,
                "suffix": None,
                "presence_penalty": 0,
                "best_of": 1,
                "echo": False,
                "user": "u1",
                "seed": 2**63 - 1,
                "stop": ["x", "y"],
            },
        ),
    ],
)
def test_neutral_values_that_sdks_send_are_accepted(scripted_gateway, path, extra) -> None:
    body = (chat if path == CHAT else completion)(scripted_gateway, **extra)
    post(scripted_gateway.http, path, body)


# ---- malformed bodies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "raw", [b"{bad json", b"", b"[1, 2]", b'"text"', b'{"model": "m", "temperature": NaN}', b"\xff\xfe"]
)
def test_malformed_json_is_400_invalid_request(gateway, path, raw) -> None:
    err = error(gateway.http, path, raw, 400)
    assert err["type"] == "invalid_request_error"


# ---- model, auth ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("streamed", [False, True])
def test_unknown_model_is_404_model_not_found(gateway, path, streamed) -> None:
    body = (chat if path == CHAT else completion)(gateway, model="no-such-model", stream=streamed)
    err = error(gateway.http, path, body, 404, "model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/models", CHAT])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "sk-test-key", "Basic sk-test-key"])
def test_missing_or_wrong_bearer_is_401(keyed_gateway, path, auth) -> None:
    import httpx

    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(
        "POST" if path == CHAT else "GET", keyed_gateway.url + path, headers=headers, json=chat(keyed_gateway)
    )
    assert r.status_code == 401
    data = strict_json(r.text)
    check_spec(data, "ErrorResponse")
    assert data["error"]["code"] == "invalid_api_key"
    assert "sk-test-key" not in r.text


def test_right_bearer_passes_and_health_needs_none(keyed_gateway) -> None:
    import httpx

    post(keyed_gateway.http, CHAT, chat(keyed_gateway))
    assert httpx.get(keyed_gateway.url + "/health").status_code == 200


# ---- backend status codes --------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
        ("INVALID_ARGUMENT", 400, "invalid_request_error"),
        ("UNAVAILABLE", 503, "server_error"),
        ("INTERNAL", 500, "server_error"),
    ],
)
def test_backend_status_maps_to_http_status_before_any_output(
    scripted_gateway, streamed, code, status, type_
) -> None:
    message = f"max_tokens: too many for {code.lower()}"
    body = chat(
        scripted_gateway, messages=[{"role": "user", "content": f"fail:{code}:{message}"}], stream=streamed
    )
    err = error(scripted_gateway.http, CHAT, body, status)
    assert err["type"] == type_ and err["message"] == message


def test_n_over_the_limit_is_a_400_naming_it(scripted_gateway) -> None:
    # the gateway's max_n (default 16) answers before the backend's own limit (passed through as any
    # INVALID_ARGUMENT, see above)
    err = error(scripted_gateway.http, CHAT, chat(scripted_gateway, n=100), 400)
    assert "max_n" in err["message"] and err["param"] == "n"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_failure_after_streaming_started_is_an_error_event_then_done(scripted_gateway, path) -> None:
    body = (chat if path == CHAT else completion)(scripted_gateway, stream=True, max_tokens=20)
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "failmid:say:one two three"}]
    else:
        body["prompt"] = "failmid:say:one two three"
    r = scripted_gateway.http.post(path, json=body)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    check_spec(last, "ErrorResponse")
    assert last["error"]["message"] == "engine failed mid-stream"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("reason", "status"), [("ERROR", 500), ("CANCELLED", 503)])
def test_a_sample_ended_by_error_or_backend_shutdown_is_not_a_normal_finish(
    scripted_gateway, path, reason, status
) -> None:
    prompt = f"endwith:{reason}"
    body = (chat if path == CHAT else completion)(scripted_gateway, max_tokens=10)
    body.update({"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt})
    err = error(scripted_gateway.http, path, body, status)
    assert err["type"] == "server_error"
    r = scripted_gateway.http.post(path, json={**body, "stream": True})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"


def test_no_backend_is_503(dead_gateway) -> None:
    err = error(
        dead_gateway.http, CHAT, {"model": "any", "messages": [{"role": "user", "content": "x"}]}, 503
    )
    assert err["type"] == "server_error"
    r = dead_gateway.http.get("/health")
    assert r.status_code == 503
    check_spec(r.json(), "ErrorResponse")


# ---- routes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nope", 404), ("GET", CHAT, 405), ("DELETE", "/v1/models", 405)],
)
def test_unknown_routes_and_methods_use_the_error_shape(gateway, method, path, status) -> None:
    r = gateway.http.request(method, path)
    assert r.status_code == status
    data = strict_json(r.text)
    check_spec(data, "ErrorResponse")
    assert set(data["error"]) == {"message", "type", "param", "code"}

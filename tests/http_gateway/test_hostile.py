"""Hostile request bodies against a `tpuserve gateway` process (over the scripted backend): every answer is a 4xx
in the OpenAI error shape, the gateway keeps serving, and its memory stays bounded. The hypothesis fuzz of random
JSON bodies is test_hostile_fuzz.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hostile_gateway import CHAT, COMPLETIONS, VALID, GatewayProcess, serve
from test_faults import assert_openai_error

MAX_RSS_GROWTH = 100 * 1024 * 1024


@pytest.fixture(scope="module")
def gw(scripted) -> Iterator[GatewayProcess]:
    yield from serve(scripted.address)


def send(
    gw: GatewayProcess, path: str, body: bytes | dict, content_type: str = "application/json"
) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return gw.http.post(path, content=data, headers={"content-type": content_type})


def assert_4xx(r: httpx.Response) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    return assert_openai_error(r.json())


def with_field(path: str, raw_field: str, raw_value: str) -> bytes:
    """The valid body for `path` with one field set to raw JSON text (not expressible as a Python value)."""
    base = dict(VALID[path])
    base.pop(raw_field, None)
    text = json.dumps(base)
    return (text[:-1] + f', "{raw_field}": {raw_value}}}').encode()


def chat_with(**fields) -> dict:
    return {**VALID[CHAT], **fields}


def hostile_corpus() -> list[tuple[str, str, bytes | dict, str]]:
    """(name, path, body, content type)."""
    out: list[tuple[str, str, bytes | dict, str]] = []
    ct = "application/json"
    numeric = ["temperature", "top_p", "n", "max_tokens", "seed", "logprobs", "top_logprobs", "best_of"]
    for path in (CHAT, COMPLETIONS):
        for field in numeric + ["presence_penalty", "frequency_penalty", "max_completion_tokens"]:
            for raw in (
                "1e309",
                "-1e309",
                "10" + "0" * 400,
                "-1" + "0" * 400,
                "NaN",
                "Infinity",
                "-Infinity",
            ):
                out.append((f"{field}={raw[:8]}", path, with_field(path, field, raw), ct))
        out.append(("int with 5000 digits", path, with_field(path, "n", "9" * 5000), ct))
        out.append(("max_tokens=2**31", path, with_field(path, "max_tokens", str(2**31)), ct))
        out.append(("max_tokens=2**63", path, with_field(path, "max_tokens", str(2**63)), ct))
        out.append(("nested [ x100k", path, b"[" * 100_000, ct))
        out.append(("nested { x100k", path, b'{"a":' * 100_000, ct))
        out.append(("nested field", path, with_field(path, "stop", "[" * 50_000 + "]" * 50_000), ct))
        out.append(("invalid utf-8", path, b'{"model": "\xff\xfe", "prompt": "\xc3\x28"}', ct))
        for raw in ('"\\ud800"', '"a\\udfffb"', '"\\ude00\\ud83d"'):  # unpaired UTF-16 surrogates
            out.append((f"surrogate {raw} in model", path, with_field(path, "model", raw), ct))
            out.append((f"surrogate {raw} in stop", path, with_field(path, "stop", f"[{raw}]"), ct))
        surrogate_bytes = json.dumps(VALID[path]).encode().replace(b"say:ok", b"say:\xed\xa0\x80")
        out.append(("surrogate as UTF-8 bytes", path, surrogate_bytes, ct))
        out.append(
            (
                "surrogate escape in the prompt",
                path,
                json.dumps(VALID[path]).replace("say:ok", "\\ud800").encode(),
                ct,
            )
        )
        out.append(("huge n", path, {**VALID[path], "n": 10**9}, ct))
        out.append(("n=129", path, {**VALID[path], "n": 129}, ct))
        out.append(("stop list 10k", path, {**VALID[path], "stop": [f"s{i}" for i in range(10_000)]}, ct))
        out.append(("stop 1MB string list", path, {**VALID[path], "stop": ["x" * 1_000_000] * 20}, ct))
        out.append(("body not an object", path, b"[1, 2, 3]", ct))
        out.append(("body a string", path, b'"hello"', ct))
        out.append(("body null", path, b"null", ct))
        out.append(("empty body", path, b"", ct))
        out.append(("whitespace body", path, b"   \n", ct))
        out.append(("truncated json", path, b'{"model": "x", "messages": [', ct))
        out.append(("trailing garbage", path, json.dumps(VALID[path]).encode() + b" }", ct))
        out.append(("form body", path, b"model=x&prompt=y", "application/x-www-form-urlencoded"))
        out.append(("text/plain junk", path, b"hello there", "text/plain"))
        out.append(("multipart junk", path, b"--b\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b"))
        out.append(("no model", path, {k: v for k, v in VALID[path].items() if k != "model"}, ct))
        out.append(("unknown field", path, {**VALID[path], "bogus": 1}, ct))
        out.append(("unknown model", path, {**VALID[path], "model": "nope"}, ct))
        out.append(("model 1MB", path, {**VALID[path], "model": "m" * 1_000_000}, ct))
        out.append(("duplicate keys", path, json.dumps(VALID[path]).encode()[:-1] + b', "n": "x"}', ct))
        # wrong types for every field
        fields = list(VALID[path]) + numeric + ["stop", "stream", "stream_options", "user", "logit_bias",
                                                "response_format", "echo", "suffix", "presence_penalty"]  # fmt: skip
        for field in fields:
            for bad in (
                {"a": {"b": 1}},
                [[["x"]]],
                "not-a-number" if field not in ("model", "user", "stop", "suffix", "prompt") else 12.5,
            ):
                out.append((f"{field}={type(bad).__name__}", path, {**VALID[path], field: bad}, ct))
    # chat messages
    for name, messages in [
        ("empty messages", []),
        ("messages not a list", {"role": "user", "content": "x"}),
        ("message without role", [{"content": "hi"}]),
        ("message without content", [{"role": "user"}]),
        ("unknown role", [{"role": "root", "content": "hi"}]),
        ("role not a string", [{"role": 7, "content": "hi"}]),
        ("tool role", [{"role": "tool", "content": "hi", "tool_call_id": "x"}]),
        (
            "image part",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        ),
        (
            "audio part",
            [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                }
            ],
        ),
        ("part without type", [{"role": "user", "content": [{"text": "hi"}]}]),
        ("empty parts", [{"role": "user", "content": []}]),
        ("content a number", [{"role": "user", "content": 5}]),
        ("content an object", [{"role": "user", "content": {"type": "text", "text": "x"}}]),
        ("message a string", ["hello"]),
        ("message null", [None]),
        ("extra message field", [{"role": "user", "content": "hi", "evil": True}]),
        ("100k messages", [{"role": "user"}] * 100_000),
    ]:
        out.append((name, CHAT, chat_with(messages=messages), ct))
    # completion prompts
    for name, prompt in [
        ("empty prompt list", []),
        ("prompt null", None),
        ("prompt an object", {"a": 1}),
        ("negative token id", [-1]),
        ("token id 2**31", [2**31]),
        ("mixed prompt list", ["a", 1]),
        ("empty inner token list", [[]]),
        ("nested prompt lists", [[["a"]]]),
        ("float token ids", [1.5, 2.0]),
        ("bool token ids", [True]),
    ]:
        out.append((name, COMPLETIONS, {**VALID[COMPLETIONS], "prompt": prompt}, ct))
    return out


CORPUS = hostile_corpus()


def test_hostile_bodies_get_4xx_in_the_openai_shape_and_the_gateway_keeps_serving(gw: GatewayProcess) -> None:
    gw.check_serving()
    rss_before = gw.rss()
    failures = []
    for name, path, body, content_type in CORPUS:
        r = send(gw, path, body, content_type)
        try:
            assert_4xx(r)
        except AssertionError as e:
            failures.append(f"{path} {name}: {e}")
    assert not failures, "\n".join(failures[:20])
    gw.check_serving()
    growth = gw.rss() - rss_before
    assert growth < MAX_RSS_GROWTH, f"gateway RSS grew by {growth / 2**20:.0f} MiB over {len(CORPUS)} bodies"


def test_content_type_must_be_json(gw: GatewayProcess) -> None:
    """A body declared as something else (curl -d sends application/x-www-form-urlencoded) is a 415 that says
    what to send; JSON with parameters, a +json type, or no Content-Type at all is parsed as JSON."""
    for path, body in VALID.items():
        for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = send(gw, path, body, ct)
            assert r.status_code == 415, (ct, r.status_code, r.text)
            err = assert_openai_error(r.json())
            assert err["code"] == "unsupported_media_type" and "application/json" in err["message"], err
        for ct in ("application/json; charset=utf-8", "APPLICATION/JSON", "application/merge-patch+json", ""):
            r = send(gw, path, body, ct)
            assert r.status_code == 200, (ct, r.status_code, r.text)
        r = gw.http.post(path, content=json.dumps(body).encode())  # no Content-Type header
        assert r.status_code == 200, r.text


def test_hostile_requests_beyond_the_body(gw: GatewayProcess) -> None:
    for method in ("GET", "PUT", "DELETE"):
        assert_4xx(gw.http.request(method, CHAT))
    assert_4xx(gw.http.get("/v1/nope"))
    assert_4xx(gw.http.get("/v1/models/" + "x" * 5000))
    assert_4xx(gw.http.post(CHAT, content=b"{", params={"x" * 100: "y" * 1000}))
    gw.check_serving()


# ---- the parser's fixes, directly ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b"[" * 100_000, None),  # json raises RecursionError: must not become a 500
        (b'{"a":' * 100_000, None),
        (b'{"model": "\\ud800", "prompt": "x"}', None),  # unpaired surrogate: protobuf cannot encode it
        (b'{"model": "m", "prompt": "\xed\xa0\x80"}', None),
        (b'{"model": "m", "prompt": "x", "max_tokens": 2147483648}', "max_tokens"),  # past proto's int32
    ],
)
def test_parse_request_rejects_with_a_400(body: bytes, param: str | None) -> None:
    from tpuserve.http_gateway.errors import APIError
    from tpuserve.http_gateway.request_models import CompletionRequest
    from tpuserve.http_gateway.request_parsing import parse_request

    with pytest.raises(APIError) as e:
        parse_request(body, CompletionRequest)
    assert e.value.status == 400 and e.value.param == param


def test_parse_request_keeps_paired_surrogates() -> None:
    from tpuserve.http_gateway.request_models import CompletionRequest
    from tpuserve.http_gateway.request_parsing import parse_request

    req = parse_request(b'{"model": "m", "prompt": "\\ud83d\\ude00 \xf0\x9f\x98\x80"}', CompletionRequest)
    assert req.prompt == "\U0001f600 \U0001f600"

"""Request helpers that check every response against the OpenAI spec, and the logprob invariants that hold for
any backend (scripted or a real model)."""

from __future__ import annotations

import json

import httpx
import openai_spec
from gateway_harness import sse_json


def strict_json(text: str) -> object:
    """Parses JSON that must not contain NaN/Infinity (Python's json would accept them)."""

    def reject(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name} in response")

    return json.loads(text, parse_constant=reject)


def check_spec(obj: object, schema: str) -> None:
    """Validates against the spec's schema (an absent spec file fails every check)."""
    openai_spec.validate(obj, schema)  # type: ignore[arg-type]


_SCHEMAS = {
    ("/v1/chat/completions", False): "CreateChatCompletionResponse",
    ("/v1/chat/completions", True): "CreateChatCompletionStreamResponse",
    ("/v1/completions", False): "CreateCompletionResponse",
    ("/v1/completions", True): "CreateCompletionResponse",
}


def post(http: httpx.Client, path: str, body: dict | bytes, status: int = 200) -> dict:
    """POSTs a non-streamed request; checks status, the body's schema (or ErrorResponse), strict JSON."""
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code != 422
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    data = strict_json(r.text)
    check_spec(data, "ErrorResponse" if status >= 400 else _SCHEMAS[(path, False)])
    return data  # type: ignore[return-value]


def error(http: httpx.Client, path: str, body: dict | bytes, status: int, param: str | None = None) -> dict:
    """An error response: the OpenAI shape, `type`, and the offending `param`."""
    data = post(http, path, body, status)
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """POSTs with stream: true; returns the JSON chunks (each checked against the chunk schema)."""
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_json(r.text)
    for c in chunks:
        strict_json(json.dumps(c, allow_nan=False))
        assert "error" not in c, c
        check_spec(c, _SCHEMAS[(path, True)])
    return chunks


def entry_bytes(entries: list[dict]) -> bytes:
    return b"".join(bytes(e["bytes"] or b"") for e in entries)


def check_chat_entry(e: dict, k: int | None) -> None:
    assert set(e) == {"token", "bytes", "logprob", "top_logprobs"}
    assert "\ufffd" not in e["token"] and "Ġ" not in e["token"] and "Ċ" not in e["token"]
    raw = bytes(e["bytes"] or b"")
    assert e["token"] == raw.decode("utf-8", errors="backslashreplace") or not raw
    if k is None or k == 0:
        assert e["top_logprobs"] == []
    else:
        assert 1 <= len(e["top_logprobs"]) <= k
    lps = [t["logprob"] for t in e["top_logprobs"]]
    assert lps == sorted(lps, reverse=True)
    for t in e["top_logprobs"]:
        assert set(t) == {"token", "bytes", "logprob"}
        assert "\ufffd" not in t["token"] and "Ġ" not in t["token"]


def check_chat_choice(choice: dict, logprobs: bool, k: int | None) -> None:
    """The design's chat logprob rules, for any backend."""
    assert "logprobs" in choice
    if not logprobs:
        assert choice["logprobs"] is None
        return
    lp = choice["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None
    for e in lp["content"]:
        check_chat_entry(e, k)
    content = (choice["message"]["content"] if "message" in choice else choice["content"]).encode()
    if choice["finish_reason"] == "stop":
        assert entry_bytes(lp["content"]) == content  # EOS is not an entry
    else:
        assert entry_bytes(lp["content"]).startswith(content)  # a cut character keeps its token's bytes


def chat_stream_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: content, entries and finish_reason assembled from chunks. Checks that each chunk's
    entries carry exactly that chunk's text (the last one may hold a cut character's or stop's extra bytes)."""
    out: dict[int, dict] = {}
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        for ch in c["choices"]:
            acc = out.setdefault(
                ch["index"], {"content": "", "entries": [], "finish_reason": None, "role": None, "pieces": []}
            )
            assert acc["finish_reason"] is None, "chunk after the choice's finish"
            delta = ch["delta"]
            if "role" in delta:
                assert acc["role"] is None and not acc["pieces"]
                acc["role"] = delta["role"]
            text = delta.get("content") or ""
            acc["content"] += text
            if ch["logprobs"] is not None:
                assert ch["logprobs"]["refusal"] is None
                entries = ch["logprobs"]["content"]
                acc["entries"] += entries
                acc["pieces"].append((text.encode(), entry_bytes(entries)))
            if ch["finish_reason"] is not None:
                acc["finish_reason"] = ch["finish_reason"]
    for acc in out.values():
        assert acc["role"] == "assistant" and acc["finish_reason"] is not None
        pieces = acc.pop("pieces")
        for text, data in pieces[:-1]:
            assert data == text
        if pieces:
            assert pieces[-1][1].startswith(pieces[-1][0])
    return out

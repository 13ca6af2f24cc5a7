"""Load test: 64 streaming clients for 15 s against a `tpuserve gateway` process in front of the real backend
(the embedded model on the shared 64-slot engine, over loopback gRPC). Zero errors, and every request's text
complete: each client sends greedy requests (chat and completions, half of them with logprobs) whose streamed
text, finish reason and token count must equal those of the same request sent alone, non-streamed, before the
load (the engine is batch-invariant, so load may not change a single token). Afterwards every slot is free and
the queue empty. The longer soak with latency percentiles and RSS is bench/soak.py."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
import pytest
from test_faults import start_gateway_process

from tests.helpers import free_port, wait_until

CLIENTS = 64
SECONDS = 15.0  # 64 clients at once from the first second: ~150 requests on the 2-core dev machine
MAX_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Name the three primary colours.",
    "Why is the sky blue?",
]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# (path, prompt, logprobs): the request kinds the clients cycle through
KINDS = [(path, p, lp) for path in (CHAT, COMPLETIONS) for p in PROMPTS for lp in (False, True)]


def body_of(model: str, path: str, prompt: str, logprobs: bool, stream: bool) -> dict:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
        if logprobs:
            body |= {"logprobs": True, "top_logprobs": 2}
    else:
        body["prompt"] = prompt
        if logprobs:
            body["logprobs"] = 2
    return body


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str
    completion_tokens: int


async def reference(http: httpx.AsyncClient, model: str, path: str, prompt: str) -> Outcome:
    r = await http.post(path, json=body_of(model, path, prompt, False, stream=False))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    return Outcome(text, choice["finish_reason"], r.json()["usage"]["completion_tokens"])


async def streamed(http: httpx.AsyncClient, model: str, path: str, prompt: str, logprobs: bool) -> Outcome:
    """One streamed request; raises AssertionError on any protocol error (status, error event, no [DONE])."""
    text, finish, usage, entries, done = [], [], None, 0, False
    async with http.stream("POST", path, json=body_of(model, path, prompt, logprobs, stream=True)) as r:
        assert r.status_code == 200, (r.status_code, await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text.append((choice["delta"].get("content") if path == CHAT else choice["text"]) or "")
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
                lp = choice.get("logprobs") or {}
                entries += len((lp.get("content") if path == CHAT else lp.get("tokens")) or [])
    assert done and usage is not None and len(finish) == 1, (done, usage, finish)
    if logprobs:
        assert entries == usage, (entries, usage)
    return Outcome("".join(text), finish[0], usage)


@pytest.fixture(scope="module")
def gateway_url(real_backend):
    port = free_port()
    proc = start_gateway_process([real_backend.address], port)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    assert proc.wait(30) == 0


def test_64_streaming_clients_for_15_s_no_errors_and_every_text_complete(real_backend, gateway_url, figure):
    model = real_backend.server.servicer.model_id
    orch = real_backend.orchestrator

    async def main() -> tuple[dict, list[tuple[tuple, Outcome]], list[str]]:
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=gateway_url, timeout=600, limits=limits) as http:
            keys = sorted({(path, prompt) for path, prompt, _ in KINDS})
            refs = await asyncio.gather(*(reference(http, model, *key) for key in keys))
            expected = dict(zip(keys, refs, strict=True))
            done: list[tuple[tuple, Outcome]] = []
            errors: list[str] = []
            stop_at = time.monotonic() + SECONDS

            async def client(c: int) -> None:
                k = c
                while time.monotonic() < stop_at:
                    kind = KINDS[k % len(KINDS)]
                    try:
                        done.append((kind, await streamed(http, model, *kind)))
                    except (AssertionError, httpx.HTTPError) as e:
                        errors.append(f"{kind}: {type(e).__name__}: {e!r}"[:300])
                    k += 1

            await asyncio.gather(*(client(c) for c in range(CLIENTS)))
            return expected, done, errors

    expected, done, errors = asyncio.run(main())
    tokens = sum(o.completion_tokens for _, o in done)
    figure(
        f"load: {CLIENTS} clients x {SECONDS:.0f} s: {len(done)} requests, {tokens} tokens, {len(errors)} errors"
    )
    assert not errors, f"{len(errors)} errors, e.g. {errors[:3]}"
    # not vacuous: every client finished one request at least (~150 on the 2-core dev machine)
    assert len(done) >= CLIENTS, f"only {len(done)} requests finished in {SECONDS:.0f} s"
    wrong = [(kind, got) for kind, got in done if got != expected[kind[:2]]]
    assert not wrong, f"{len(wrong)} of {len(done)} differ from the idle reference, e.g. {wrong[:2]}"
    assert any(o.finish_reason == "length" for o in expected.values())  # at least some run the full budget
    assert wait_until(lambda: orch.free_slots == real_backend.engine.slots and orch.queued == 0, 30)

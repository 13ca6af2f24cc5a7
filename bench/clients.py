"""Streaming OpenAI clients as users run them: httpx.AsyncClient, POST with `"stream": true`, read the SSE `data:`
lines as they arrive. Times are time.perf_counter() in this process.

A stream's tokens are its `usage.completion_tokens` when the server sends usage (both tpuserve and llama-server do
with `stream_options.include_usage`), else its chunks that carry text. Its TTFT is request sent -> first chunk
with non-empty text (completions `choices[].text`, chat `choices[].delta.content`); its end is the arrival of
the last chunk that carries text or a finish reason (the last token), not of `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

TIMEOUT = httpx.Timeout(900.0, connect=30.0)


@dataclass
class StreamResult:
    sent: float
    first_text: float | None = None  # arrival of the first chunk with text
    last_token: float | None = None  # arrival of the last chunk with text or a finish reason
    text_chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None  # from the usage chunk
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server says
    finish_reason: str | None = None
    text: str = ""
    logprob_entries: int = 0  # completions `logprobs.tokens` / chat `logprobs.content` entries received
    error: str | None = None
    done: bool = False  # saw `data: [DONE]`

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.text_chunks

    @property
    def ttft(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.sent


@dataclass
class Batch:
    """Concurrent streams: wall time = first request sent -> last token received (of any stream)."""

    results: list[StreamResult] = field(default_factory=list)
    device_busy: float | None = None  # tpuserve: its decode calls' seconds over the wall time

    @property
    def start(self) -> float:
        return min(r.sent for r in self.results)

    @property
    def end(self) -> float:
        return max((r.last_token or r.sent) for r in self.results)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.results if r.error]


def chunk_text(obj: dict[str, Any]) -> str:
    """The text a completions or chat chunk carries (all choices)."""
    out = []
    for choice in obj.get("choices") or []:
        if "text" in choice:
            out.append(choice["text"] or "")
        else:
            out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def _logprob_entries(obj: dict[str, Any]) -> int:
    n = 0
    for choice in obj.get("choices") or []:
        lp = choice.get("logprobs") or {}
        n += len(lp.get("tokens") or lp.get("content") or [])
    return n


def _read_event(result: StreamResult, data: str, now: float) -> bool:
    """Apply one SSE `data:` payload to `result`; False at `[DONE]`."""
    if data.strip() == "[DONE]":
        result.done = True
        return False
    obj = json.loads(data)
    if "error" in obj:
        result.error = f"stream error: {obj['error']}"
        return False
    text = chunk_text(obj)
    finish = next((c.get("finish_reason") for c in obj.get("choices") or [] if c.get("finish_reason")), None)
    if text:
        result.text_chunks += 1
        result.text += text
        if result.first_text is None:
            result.first_text = now
    if text or finish:
        result.last_token = now
    if finish:
        result.finish_reason = finish
    result.logprob_entries += _logprob_entries(obj)
    if obj.get("usage"):
        usage = obj["usage"]
        result.usage_tokens = int(usage["completion_tokens"])
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return True


async def _sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The body's lines as SSE splits them: at CR, LF or CRLF only (httpx's `aiter_lines` also splits at U+2028,
    U+2029 and U+0085, which JSON may carry raw inside a string: a server that sends them so would have its events
    cut in two)."""
    rest = ""
    async for text in r.aiter_text():
        *lines, rest = re.split(r"\r\n|\r|\n", rest + text)
        for line in lines:
            yield line
    if rest:
        yield rest


async def stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    first_text: asyncio.Event | None = None,
    result: StreamResult | None = None,
) -> StreamResult:
    """POST `body` (with stream and include_usage set) to `path`, read the stream to its end, into `result`
    (a new one unless given: a caller that cancels the task keeps what was read). Errors are recorded in the
    result (HTTP status, transport, SSE error event), not raised; `first_text` is set when the first text
    arrives. Cancelling the task closes the connection (the server sees the client go)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    if result is None:
        result = StreamResult(sent=0.0)
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return result
            async for line in _sse_lines(r):
                if not line.startswith("data:"):
                    continue
                had_text = result.first_text is not None
                if not _read_event(result, line[5:].lstrip(), time.perf_counter()):
                    break
                if first_text is not None and not had_text and result.first_text is not None:
                    first_text.set()
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    if result.error is None and not result.done:
        result.error = "stream ended without data: [DONE]"
    return result


def make_client(base_url: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT, limits=limits)


async def concurrent(base_url: str, path: str, bodies: Sequence[dict[str, Any]]) -> Batch:
    """All `bodies` streamed at once, one connection each."""
    async with make_client(base_url, len(bodies)) as client:
        results = await asyncio.gather(*(stream(client, path, b) for b in bodies))
    return Batch(list(results))


async def under_load(
    base_url: str,
    path: str,
    load: Sequence[dict[str, Any]],
    probe_path: str,
    probes: Sequence[dict[str, Any]],
    settle_s: float,
    settled: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[list[StreamResult], int]:
    """Start the `load` streams; once each has received its first text, or `settle_s` after they were sent,
    await `settled()` if given, then send the `probes` one after the other, each closed at its first text (the
    server sees its client go). Then every stream is cancelled (connections closed). Returns the probes' results
    (to their first text) and how many load streams had text when the first probe was sent."""
    async with make_client(base_url, len(load) + 2) as client:
        events = [asyncio.Event() for _ in load]
        tasks = [asyncio.create_task(stream(client, path, b, e)) for b, e in zip(load, events)]
        try:
            waits = [asyncio.create_task(e.wait()) for e in events]
            await asyncio.wait(waits, timeout=settle_s)
            for w in waits:
                w.cancel()
            decoding = sum(e.is_set() for e in events)
            if settled is not None:
                await settled()
            results = []
            for probe in probes:
                got, result = asyncio.Event(), StreamResult(sent=0.0)
                probe_task = asyncio.create_task(stream(client, probe_path, probe, got, result))
                got_task = asyncio.create_task(got.wait())
                await asyncio.wait([probe_task, got_task], return_when=asyncio.FIRST_COMPLETED)
                for t in (probe_task, got_task):
                    t.cancel()
                await asyncio.gather(probe_task, got_task, return_exceptions=True)
                results.append(result)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return results, decoding


async def sequential(
    base_url: str, requests: Sequence[tuple[str, dict[str, Any]]], pause_s: float = 0.0
) -> list[StreamResult]:
    """One stream after the other on one keep-alive connection (idle server)."""
    out = []
    async with make_client(base_url, 1) as client:
        for path, body in requests:
            out.append(await stream(client, path, body))
            if pause_s:
                await asyncio.sleep(pause_s)
    return out


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    """asyncio.run of a fresh coroutine (one event loop per measurement)."""
    return asyncio.run(coro_fn())


async def get_text(base_url: str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET -> (status, body); (0, error text) when the server does not answer."""
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
            r = await client.get(path)
            return r.status_code, r.text
    except httpx.HTTPError as e:
        return 0, f"{type(e).__name__}: {e}"


def prometheus_sum(text: str, metric: str) -> float | None:
    """The sum over all label sets of `metric` in a Prometheus text exposition (None if absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == metric:
            rest = line.rsplit("}", 1)[1] if "}" in line else line.split(None, 1)[1]
            total += float(rest.split()[0])  # a sample line may end with a timestamp
            seen = True
    return total if seen else None

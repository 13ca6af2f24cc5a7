"""Fault tests with real processes on loopback: a backend killed with SIGKILL mid-stream and restarted on the
same port, two backends with one killed, 100 streaming clients that go away mid-generation over the real backend,
and SIGTERM on a `tpuserve gateway` process with a stream in flight.

The scripted backend (scripted_backend.py) runs here as its own process (BACKEND_MAIN) so it can be SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from gateway_harness import GatewayServer, requests_in_flight, sse_events
from scripted_backend import MODEL_ID

from tests.helpers import free_port, wait_until

HERE = Path(__file__).resolve().parent
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}

# The scripted servicer on a fixed port, in its own process; prints "ready" once it serves.
BACKEND_MAIN = r"""
import asyncio, sys
sys.path.insert(0, sys.argv[2])
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from scripted_backend import ScriptedServicer
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

async def main():
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServicer_to_server(ScriptedServicer(), server)
    h = health.aio.HealthServicer()
    await h.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    if not server.add_insecure_port("127.0.0.1:" + sys.argv[1]):
        raise SystemExit("could not bind")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


class BackendProcess:
    """The scripted backend as a child process on `port` (kill -9 and restart on the same port)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> BackendProcess:
        deadline = time.monotonic() + 20
        while True:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BACKEND_MAIN, str(self.port), str(HERE)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() == "ready":
                return self
            self.proc.wait(5)
            assert time.monotonic() < deadline, "scripted backend process did not start"
            time.sleep(0.2)  # the port may still be held for a moment after a kill

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def chat_body(content: str, stream: bool = False, **extra) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def completion_body(prompt: str, stream: bool = False, **extra) -> dict:
    return {"model": MODEL_ID, "prompt": prompt, "stream": stream, **extra}


def assert_openai_error(obj: object) -> dict:
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    return err


def assert_error_response(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    return assert_openai_error(r.json())


class OpenStream:
    """A streaming request read on its own thread; `started` is set after the first content event."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        self.started = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, path, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, path: str, body: dict) -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as http, http.stream("POST", path, json=body) as r:
                self.status = r.status_code
                buf = ""
                for text in r.iter_text():
                    buf += text
                    *done, buf = buf.split("\n\n")
                    for block in done:
                        self.events += sse_events(block + "\n\n")
                    if len(self.events) >= 2:
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()

    def join(self, timeout: float = 20) -> list[str]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, repr(self.error)
        return self.events


def assert_ends_with_error_event(events: list[str]) -> dict:
    """Content events, then one OpenAI error event, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    assert len(payloads) >= 2 and all("error" not in p for p in payloads[:-1])
    return assert_openai_error(payloads[-1])


def serves(http: httpx.Client) -> bool:
    try:
        r = http.post(CHAT, json=chat_body("say:back", max_tokens=8), timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "back"


# ---- one backend killed and restarted ----------------------------------------------------------------


def test_backend_killed_mid_stream_then_restarted_on_the_same_port() -> None:
    backend = BackendProcess().start()
    server = GatewayServer([backend.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert serves(http)
            slow = "slow:loop:ab"
            streams = [
                OpenStream(server.url, CHAT, chat_body(slow, stream=True, max_tokens=3000)),
                OpenStream(server.url, CHAT, chat_body(slow, stream=True, max_tokens=3000, n=2)),
                OpenStream(server.url, COMPLETIONS, completion_body(slow, stream=True, max_tokens=3000)),
            ]
            for s in streams:
                assert s.started.wait(10) and s.status == 200 and s.error is None
            with ThreadPoolExecutor(2) as pool:
                in_flight = [
                    pool.submit(http.post, CHAT, json=chat_body(slow, max_tokens=3000)),
                    pool.submit(http.post, COMPLETIONS, json=completion_body(slow, max_tokens=3000)),
                ]
                # the three streams and both requests are in flight
                assert wait_until(lambda: requests_in_flight(server.url) >= 5, timeout=10)
                backend.kill()
                for f in in_flight:
                    err = assert_error_response(f.result(10), 503)
                    assert err["type"] == "server_error"
            for s in streams:
                assert_ends_with_error_event(s.join())

            # While it is down: new requests (streamed or not) are 503 in the OpenAI shape, never a hang.
            for path, body in ((CHAT, chat_body("Hi")), (COMPLETIONS, completion_body("Hi", stream=True))):
                assert_error_response(http.post(path, json=body, timeout=10), 503)
            assert_error_response(http.get("/health"), 503)
            time.sleep(3)  # a few reconnect attempts fail (the channel's reconnect backoff grows)
            for _ in range(3):
                http.post(CHAT, json=chat_body("Hi"), timeout=10)

            backend.start()
            t0 = time.monotonic()
            assert wait_until(lambda: serves(http), timeout=10, step=0.1), "the gateway did not reconnect"
            reconnect_s = time.monotonic() - t0
            assert reconnect_s < 5, f"reconnecting took {reconnect_s:.1f}s"
            assert http.get("/health").status_code == 200
            r = http.post(COMPLETIONS, json=completion_body("say:again", stream=True))
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
            assert "again" in "".join(json.loads(e)["choices"][0]["text"] for e in sse_events(r.text)[:-1])
    finally:
        server.stop()
        backend.stop()


# ---- two backends, one killed ------------------------------------------------------------------------


def test_with_two_backends_a_killed_one_is_routed_around() -> None:
    a, b = BackendProcess().start(), BackendProcess().start()
    server = GatewayServer([a.address, b.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for _ in range(2):
                assert serves(http)
            streams = [
                OpenStream(server.url, CHAT, chat_body("slow:loop:ab", stream=True, max_tokens=3000))
                for _ in range(2)
            ]
            for s in streams:
                assert s.started.wait(10) and s.status == 200
            a.kill()
            # The stream on the killed backend ends with an error event; the other one goes on.
            assert wait_until(lambda: any(not s.thread.is_alive() for s in streams), 10)
            time.sleep(0.2)
            ended = [s for s in streams if not s.thread.is_alive()]
            assert len(ended) == 1, "exactly the stream on the killed backend ends"
            assert_ends_with_error_event(ended[0].join())

            # Every new request is answered by the live backend: no 5xx, streamed or not, on both endpoints.
            for i in range(12):
                path = CHAT if i % 2 else COMPLETIONS
                word = f"ok{i}"
                body = chat_body(f"say:{word}") if path == CHAT else completion_body(f"say:{word}")
                body["stream"] = i % 4 >= 2
                r = http.post(path, json=body, timeout=10)
                assert r.status_code == 200, r.text
                if body["stream"]:
                    assert sse_events(r.text)[-1] == "[DONE]" and '"error"' not in r.text
            assert http.get("/health").status_code == 200
            assert http.get("/v1/models").json()["data"][0]["id"] == MODEL_ID
    finally:
        server.stop()
        for backend in (a, b):
            backend.stop()


# ---- 160 clients that go away mid-stream (real backend) ----------------------------------------------


def test_160_streams_closed_mid_generation_free_every_slot(real_backend) -> None:
    orch = real_backend.orchestrator
    slots = real_backend.engine.slots
    assert wait_until(lambda: orch.free_slots == slots and orch.queued == 0, 30)
    server = GatewayServer([real_backend.address]).start()
    n_clients = 160  # 96 wait: samples that finish while the 64 slots fill never drain the queue
    prompts = ["Hi", "Tell me a story.", "Count to a hundred.", "Why is the sky blue?"]

    async def client(http: httpx.AsyncClient, i: int, hold: asyncio.Event, seen: list[int]) -> None:
        body = chat_body(prompts[i % len(prompts)], stream=True, max_tokens=200, temperature=1.0, seed=i)
        body["model"] = model
        async with http.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen.append(i)  # it has a slot and streams
                    await hold.wait()  # keep the stream open, unread, until the client goes away
                    return

    async def main() -> tuple[int, int]:
        limits = httpx.Limits(max_connections=n_clients + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
            hold = asyncio.Event()
            seen: list[int] = []
            tasks = [asyncio.create_task(client(http, i, hold, seen)) for i in range(n_clients)]
            # Arriving prompts are prefilled about one chunk per decode call while others decode, so filling 64
            # slots takes several 64-row decode calls (seconds each on a slow 2-core machine).
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                free = orch.free_slots  # read once: a sample that ends (EOS) frees its slot for a moment
                if free == 0 and len(seen) >= slots:
                    break
                await asyncio.sleep(0.05)
            busy, queued = slots - free, orch.queued
            # every client goes away: the ones being generated for and the ones still waiting for a slot
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            failed = [
                r
                for r in results
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
            ]
            assert not failed, failed[:3]
            return busy, queued

    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
        t0 = time.monotonic()
        busy, queued = asyncio.run(main())
        assert busy == slots, f"only {busy} of {slots} slots were generating when the clients left"
        assert queued > 0, "the clients beyond the slot count should have been queued"
        ok = wait_until(lambda: orch.free_slots == slots and orch.queued == 0, timeout=180)
        assert ok, (
            f"{slots - orch.free_slots} slots still held, {orch.queued} queued, after {time.monotonic() - t0:.1f}s"
        )
        # and the backend still serves
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post(CHAT, json={**chat_body("Hi", max_tokens=2), "model": model})
            assert r.status_code == 200, r.text
    finally:
        server.stop()


# ---- SIGTERM on the gateway process drains in-flight requests ----------------------------------------


def start_gateway_process(
    backends: list[str],
    port: int,
    args: tuple[str, ...] = (),
    ca_file: str | None = None,
    health: int = 200,
) -> subprocess.Popen:
    """`tpuserve gateway` on 127.0.0.1:`port` (plus `args`), once its /health answers `health` (over HTTPS,
    checked against `ca_file`, when that is given)."""
    cmd = [sys.executable, "-m", "tpuserve.cli", "gateway", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *args]  # fmt: skip
    for b in backends:
        cmd += ["--backend", b]
    env = {k: v for k, v in os.environ.items() if k != "TPUSERVE_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"{'https' if ca_file else 'http'}://127.0.0.1:{port}"
    verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=2, verify=verify).status_code == health:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            raise AssertionError(f"gateway did not come up: {out[-2000:]}")
        time.sleep(0.05)


def test_gateway_sigterm_finishes_in_flight_streams_and_exits_0(scripted) -> None:
    port = free_port()
    proc = start_gateway_process([scripted.address], port)
    url = f"http://127.0.0.1:{port}"
    try:
        text = "The quick brown fox jumps over the lazy dog " * 3  # ~130 tokens, 10 ms each: ~1.3 s
        streamed = OpenStream(url, CHAT, chat_body(f"slow:say:{text}", stream=True))
        plain: list[httpx.Response] = []
        plain_thread = threading.Thread(
            target=lambda: plain.append(
                httpx.post(
                    url + COMPLETIONS, json=completion_body(f"slow:say:{text}", max_tokens=500), timeout=30
                )
            ),
            daemon=True,
        )
        plain_thread.start()
        assert streamed.started.wait(10) and streamed.status == 200
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        events = streamed.join(20)
        plain_thread.join(20)
        assert events[-1] == "[DONE]" and '"error"' not in "".join(events), events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert plain and plain[0].status_code == 200, plain
        assert plain[0].json()["choices"][0]["text"] == text
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, f"exit status {proc.returncode}: {out[-2000:]}"
        with pytest.raises(httpx.TransportError):  # and it no longer listens
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

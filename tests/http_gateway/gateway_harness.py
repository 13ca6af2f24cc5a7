"""Runs the gateway app in a real uvicorn server on a free local port, in a background thread."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn
from tpuserve.http_gateway.app import create_app

API_KEY = "sk-test-key"  # the keyed gateway's key


class GatewayServer:
    def __init__(self, backends: list[str], api_key: str | None = None, **app_options) -> None:
        """`app_options`: more `create_app` keywords (limits, cors_allow_origins, ...)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(
            create_app(backends, api_key=api_key, **app_options),
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True, name=f"gateway-{self.url}"
        )

    def start(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def requests_in_flight(gateway_url: str) -> float:
    """The gateway's `tpuserve_gateway_requests_in_flight` gauge, read from its /metrics."""
    for line in httpx.get(gateway_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tpuserve_gateway_requests_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no tpuserve_gateway_requests_in_flight in /metrics")


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (including the final "[DONE]")."""
    out = []
    for block in text.split("\n\n"):
        lines = [ln[len("data: ") :] for ln in block.split("\n") if ln.startswith("data: ")]
        if lines:
            out.append("\n".join(lines))
    return out


def sse_json(text: str) -> list[dict]:
    """The JSON events of an SSE body; asserts it ends with exactly one `[DONE]` and nothing after it."""
    events = sse_events(text)
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def real_gateway(backend_address: str, timeout: float = 120) -> Iterator[tuple[str, str, httpx.Client]]:
    """(base url, model id, client) of a gateway whose only backend is the real one; the files that test real
    generation make it their module-scoped `real` fixture."""
    server = GatewayServer([backend_address]).start()
    with httpx.Client(base_url=server.url, timeout=timeout) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        yield server.url, model, http
    server.stop()

"""A `tpuserve gateway` process over the scripted backend, for the hostile-input tests (test_hostile.py, its
hand-written corpus, and test_hostile_fuzz.py, the hypothesis fuzz): its RSS, and a check that it still serves."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
from scripted_backend import MODEL_ID
from test_faults import start_gateway_process

from tests.helpers import free_port

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
VALID = {
    CHAT: {"model": MODEL_ID, "messages": [{"role": "user", "content": "say:ok"}], "max_tokens": 4},
    COMPLETIONS: {"model": MODEL_ID, "prompt": "say:ok", "max_tokens": 4},
}


class GatewayProcess:
    """The gateway child process, an HTTP client to it, its resident memory."""

    def __init__(self, proc, url: str) -> None:
        self.proc, self.url = proc, url
        self.http = httpx.Client(base_url=url, timeout=30)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    def check_serving(self) -> None:
        assert self.proc.poll() is None, "the gateway process died"
        assert self.http.get("/health").status_code == 200
        for path, body in VALID.items():
            r = self.http.post(path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()["choices"][0]
            assert (out.get("text") or out.get("message", {}).get("content")) == "ok"


def serve(backend_address: str) -> Iterator[GatewayProcess]:
    """A module fixture's body: the process for the module's tests, stopped after them."""
    port = free_port()
    proc = start_gateway_process([backend_address], port)
    g = GatewayProcess(proc, f"http://127.0.0.1:{port}")
    yield g
    g.http.close()
    proc.terminate()
    proc.wait(10)

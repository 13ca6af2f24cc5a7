"""`tpuserve serve` (what `make serve` runs): backend + gateway come up, answer a chat request with logprobs,
and SIGTERM stops both processes (the backend drains; no orphan left behind)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.conftest import REPO

ORIGIN = "https://ui.example.com"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_backend_and_gateway_and_stops_both_on_sigterm():
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tpuserve.http_gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--config", str(REPO / "configs" / "test.yaml"),
           "--max-n", "2", "--cors-allow-origin", ORIGIN]  # gateway flags, passed through  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"{base}/health", timeout=5).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(2)
        assert status == 200, "serve did not become healthy"
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}],
            "logprobs": True, "max_tokens": 6, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content and all(e["top_logprobs"] == [] for e in content)
        # the gateway got its flags (--max-n, CORS) and its section of the shared --config (max_body_bytes)
        r = httpx.post(f"{base}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "a", "n": 3})
        assert r.status_code == 400 and "max_n = 2" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 1_100_000})
        assert r.status_code == 413 and "max_body_bytes = 1000000" in r.json()["error"]["message"], r.text
        r = httpx.options(f"{base}/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children, "the backend runs as a child process"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
        assert "stopped (drained)" in out
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

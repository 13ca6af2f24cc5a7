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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_backend_and_gateway_and_stops_both_on_sigterm():
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tpuserve.http_gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--config", str(REPO / "configs" / "test.yaml")]  # fmt: skip
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

"""`tpuserve serve` (what `make serve` runs): backend + gateway come up, answer a chat request with logprobs,
and SIGTERM stops both processes (the backend drains; no orphan left behind)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO
from tests.helpers import free_port

ORIGIN = "https://ui.example.com"


def test_serve_starts_backend_and_gateway_and_stops_both_on_sigterm():
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tpuserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", str(grpc_port), "--config", str(REPO / "configs" / "test.yaml"),
           "--max-n", "2", "--cors-allow-origin", ORIGIN]  # gateway flags, passed through  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
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
            time.sleep(0.25)
        assert status == 200, "serve did not become healthy"
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}],
            "logprobs": True, "max_tokens": 6, "temperature": 0})  # fmt: skip
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content and all(e["top_logprobs"] == [] for e in content)
        # the gateway got its flags (--max-n, CORS) and its section of the shared --config (max_body_bytes)
        r = httpx.post(
            f"{base}/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "a", "n": 3}
        )
        assert r.status_code == 400 and "max_n = 2" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 1_100_000})
        assert r.status_code == 413 and "max_body_bytes = 1000000" in r.json()["error"]["message"], r.text
        r = httpx.options(
            f"{base}/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], check=False, capture_output=True, text=True
        ).stdout.split()
        assert children, "the backend runs as a child process"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
        assert "stopped (drained)" in out
        assert "host memory: freed buffers stay in the process" in out  # the backend's malloc settings
        for pid in children:
            stat = pathlib.Path(f"/proc/{pid}/stat")
            assert not stat.exists() or stat.read_text().split()[2] == "Z"  # gone, or a zombie
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- what `tpuserve serve` hands to each process (no process started) ------------------------------------


def write_yaml(tmp_path, data: dict) -> str:
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_serve_plan_takes_hosts_and_ports_from_the_config_sections(tmp_path, monkeypatch):
    from tpuserve.cli.serve import plan

    for var in ("HOST", "PORT", "GRPC_PORT", "METRICS_PORT"):
        monkeypatch.delenv(var, raising=False)
    config = write_yaml(tmp_path, {
        "engine": {"slots": 4},
        "server": {"host": "0.0.0.0", "port": 50123, "metrics_port": 0},
        "gateway": {"port": 9100, "max_n": 3}})  # fmt: skip
    backend, gateway = plan(["--config", config])
    assert flag(backend, "--port") == "50123" and flag(backend, "--host") == "0.0.0.0"
    assert flag(backend, "--metrics-port") == "0"  # the config turned backend metrics off
    assert gateway.backend == ("127.0.0.1:50123",)  # a wildcard bind is dialled on loopback
    assert gateway.port == 9100 and gateway.host == "0.0.0.0" and gateway.max_n == 3
    # flags (and their environment variables) still win over the file
    monkeypatch.setenv("PORT", "9200")
    backend, gateway = plan(["--config", config, "--grpc-port", "50200", "--max-n", "2"])
    assert gateway.port == 9200 and gateway.max_n == 2
    assert flag(backend, "--port") == "50200" and gateway.backend == ("127.0.0.1:50200",)
    # without a config: loopback gRPC, metrics on GRPC_PORT + 1, the gateway's defaults
    monkeypatch.delenv("PORT")
    backend, gateway = plan([])
    assert flag(backend, "--host") == "127.0.0.1" and flag(backend, "--metrics-port") == "50052"
    assert gateway.port == 8000 and gateway.backend == ("127.0.0.1:50051",)


def test_serve_plan_keeps_a_flat_engine_file_from_the_gateway(tmp_path):
    from tpuserve.cli.serve import plan

    config = write_yaml(tmp_path, {"slots": 4, "max_seq_len": 256})  # the old flat engine format
    backend, gateway = plan(["--config", config])
    assert flag(backend, "--config") == config
    assert gateway.max_n == 16  # the gateway did not read the engine's keys (it would reject them)


def test_serve_plan_rejects_bad_settings_of_either_process_before_starting_anything(tmp_path, capsys):
    from tpuserve.cli.serve import plan

    with pytest.raises(SystemExit):
        plan(["--max-queue", "3"])  # a backend (engine) setting, not a gateway flag
    assert "unrecognized arguments: --max-queue" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan(["--request-timeout", "0"])
    for data, message in (
        ({"engine": {"slots": 4, "slotz": 2}}, "unknown engine setting(s) slotz"),
        ({"server": {"port": "fifty"}}, "`server.port` must be an integer, not 'fifty'"),
        ({"server": {"tls_cert_file": "cert.pem"}}, "TLS needs both --tls-cert-file and --tls-key-file"),
    ):
        with pytest.raises(SystemExit):
            plan(["--config", write_yaml(tmp_path, data)])
        assert message in capsys.readouterr().err


def test_serve_hands_names_version_and_admin_key_on(tmp_path, monkeypatch):
    """--served-model-name and --weight-version go to the backend's command line, the admin key to the gateway's
    settings and (by the environment, never a command line) to the backend; the config's server section may name
    the model too."""
    from tpuserve.cli.backend import parse_args
    from tpuserve.cli.serve import plan

    monkeypatch.delenv("TPUSERVE_ADMIN_KEY", raising=False)
    backend, gateway = plan(["--served-model-name", "policy", "policy-latest", "--weight-version", "step-0",
                             "--admin-key", "secret"])  # fmt: skip
    assert "secret" not in backend and gateway.admin_key == "secret"
    server, engine = parse_args(backend[backend.index("grpc") + 1 :])
    assert server.served_model_name == ("policy", "policy-latest") and server.weight_version == "step-0"
    assert not engine.rescore_exact
    cmd = plan(["--rescore-exact"])[0]
    assert parse_args(cmd[cmd.index("grpc") + 1 :])[1].rescore_exact
    config = write_yaml(tmp_path, {"server": {"served_model_name": ["from-file"]}})
    server, _ = parse_args(["--config", config])
    assert server.served_model_name == ("from-file",) and server.admin_key is None
    monkeypatch.setenv("TPUSERVE_ADMIN_KEY", "from-env")
    assert plan([])[1].admin_key == "from-env"
    with pytest.raises(SystemExit):
        parse_args(["--weight-version", ""])


def test_serve_hands_quantization_to_the_backend():
    from tpuserve.cli.backend import parse_args
    from tpuserve.cli.serve import plan

    backend, _ = plan(["--quantization", "keep"])
    assert flag(backend, "--quantization") == "keep"
    assert (
        parse_args(backend[backend.index("grpc") + 1 :])[1].quantization == "keep"
    )  # what the backend reads
    backend, _ = plan([])
    assert "--quantization" not in backend

"""The command line above the layers: `tpuserve gateway|grpc` read the settings file, set up the JSON logs and
hand their layer's `main` the finished settings; a layer run on its own takes its flags only and logs plain
text; no layer imports the command line."""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import yaml
from tpuserve.cli import jsonlog
from tpuserve.cli.main import main
from tpuserve.grpc_service import settings as backend_settings
from tpuserve.grpc_service.settings import ServerSettings
from tpuserve.http_gateway import settings as gateway_settings
from tpuserve.sampler.config import EngineConfig

from tests.conftest import REPO
from tests.helpers import free_port

LAYERS = ("model", "sampler", "grpc_service", "proto", "http_gateway")


@contextmanager
def root_logging() -> Iterator[logging.Logger]:
    """The root logger, its handlers and level restored afterwards (the commands set them up)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        yield root
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def write_yaml(tmp_path, data: dict) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_no_layer_imports_the_command_line_and_there_is_no_common_package() -> None:
    sources = [p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py"))]
    assert len(sources) > 40
    named = [str(p.relative_to(REPO)) for p in sources if "tpuserve.cli" in p.read_text()]
    assert named == [], named
    assert not (REPO / "common").exists()
    with pytest.raises(ModuleNotFoundError):
        __import__("tpuserve.common")


def test_the_gateway_command_passes_its_layer_the_settings_of_file_and_flags(tmp_path, monkeypatch) -> None:
    got = []
    monkeypatch.setattr("tpuserve.cli.gateway.gateway_main", lambda settings: got.append(settings))
    config = write_yaml(tmp_path, {"engine": {"slots": 2}, "gateway": {"backend": ["h:1"], "max_n": 3}})
    with root_logging() as root:
        assert main(["gateway", "--config", config, "--port", "9123", "--log-level", "warning"]) == 0
        formats, level = [type(h.formatter) for h in root.handlers], root.level
    (settings,) = got
    assert (settings.backend, settings.max_n, settings.port) == (("h:1",), 3, 9123)
    assert formats == [jsonlog.JSONFormatter] and level == logging.WARNING


def test_the_grpc_command_passes_its_layer_the_settings_of_file_and_flags(tmp_path, monkeypatch) -> None:
    got = []
    monkeypatch.setattr("tpuserve.grpc_service.server.main", lambda settings: got.append(settings) or 0)
    config = write_yaml(tmp_path, {"engine": {"slots": 2}, "server": {"port": 50123, "log_format": "text"}})
    with root_logging() as root:
        assert main(["grpc", "--config", config, "--max-n", "4", "--drain-timeout", "5"]) == 0
        formats = [type(h.formatter) for h in root.handlers]
    ((server, engine),) = got
    assert (server.port, server.drain_timeout, server.log_format) == (50123, 5.0, "text")
    assert (engine.slots, engine.max_n) == (2, 4)
    assert formats == [logging.Formatter]  # the server's log_format: text


def test_a_layer_alone_takes_its_flags_only(capsys) -> None:
    server, engine = backend_settings.parse_args(["--port", "1", "--max-n", "3", "--log-prompts"])
    assert server == ServerSettings(port=1, log_prompts=True) and engine == EngineConfig(max_n=3)
    gateway = gateway_settings.parse_args(["--backend", "a:1", "--backend", "b:2", "--max-n", "5"])
    assert gateway.backend == ("a:1", "b:2") and gateway.max_n == 5
    for parse in (backend_settings.parse_args, gateway_settings.parse_args):
        with pytest.raises(SystemExit):
            parse(["--backend", "a:1", "--config", "x.yaml"])  # files are the command line's
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        backend_settings.parse_args(["--tls-cert-file", "c.pem"])  # the class's own checks still run
    assert "TLS needs both" in capsys.readouterr().err


def gateway_log_lines(cmd: list[str]) -> list[str]:
    """The first stderr lines of a gateway process (to a backend that is not there), stopped by SIGTERM."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=pathlib.Path(REPO))
    try:
        lines = [proc.stderr.readline() for _ in range(2)]
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return [line for line in lines if line]


def test_the_gateway_command_logs_json_and_the_layer_alone_logs_text() -> None:
    args = ["--backend", "127.0.0.1:1", "--host", "127.0.0.1", "--log-level", "info"]
    lines = gateway_log_lines(
        [sys.executable, "-m", "tpuserve.cli", "gateway", *args, "--port", str(free_port())]
    )
    assert lines and all(json.loads(line)["level"] for line in lines), lines
    port = str(free_port())
    lines = gateway_log_lines([sys.executable, "-m", "tpuserve.http_gateway.serve", *args, "--port", port])
    assert lines and " INFO " in lines[0], lines
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0])

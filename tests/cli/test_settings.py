"""The one settings reader: each process's section of a shared file (or a flat file), null = the default, flags
win, values checked against the typed fields, and frozen results."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from tpuserve.cli import settings
from tpuserve.cli.backend import load_config
from tpuserve.grpc_service.settings import ServerSettings
from tpuserve.http_gateway.settings import GatewaySettings
from tpuserve.sampler.config import EngineConfig


def write(tmp_path, data: dict) -> str:
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_each_process_reads_its_own_section_of_one_file(tmp_path) -> None:
    path = write(tmp_path, {
        "engine": {"slots": 4, "max_queue_wait": 2},
        "server": {"port": 50123, "metrics_port": None},
        "gateway": {"backend": "h:1", "max_n": 3}})  # fmt: skip
    engine = load_config(path, {"slots": None, "max_n": 5})  # a flag left unset keeps the file's value
    assert (engine.slots, engine.max_n, engine.max_queue_wait) == (4, 5, 2.0)
    server = settings.load(ServerSettings(), path, "server", {"host": "127.0.0.1"})
    assert (server.host, server.port, server.metrics_port) == ("127.0.0.1", 50123, None)  # null: the default
    gateway = settings.load(GatewaySettings(), path, "gateway", {"max_n": None}, flat=True)
    assert gateway.backend == ("h:1",) and gateway.max_n == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        gateway.max_n = 4  # type: ignore[misc]


def test_a_flat_file_is_the_settings_of_the_process_that_accepts_one(tmp_path) -> None:
    path = write(tmp_path, {"slots": 2, "max_seq_len": 128})
    assert load_config(path) == EngineConfig(slots=2, max_seq_len=128)
    assert settings.load(ServerSettings(), path, "server") == ServerSettings()  # `server:` is never flat
    path = write(tmp_path, {"engine": None, "gateway": {"port": 1}})  # every engine key commented out
    assert load_config(path) == EngineConfig()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"engine": {"slots": "four"}}, "`engine.slots` must be an integer, not 'four'"),
        ({"engine": {"warm_up": "no"}}, "`engine.warm_up` must be true or false, not 'no'"),
        ({"engine": {"dtype": 16}}, "`engine.dtype` must be a string, not 16"),
        ({"engine": {"slotz": 4}}, "unknown engine setting(s) slotz"),
        ({"engine": [1, 2]}, "`engine:` must be a mapping of settings"),
    ],
)
def test_bad_settings_are_errors_that_name_the_key(tmp_path, data: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_config(write(tmp_path, data))
    assert message in str(info.value)

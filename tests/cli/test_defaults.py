"""One home per setting: each default of the engine's and the backend's settings is written once, in its
dataclass (`EngineConfig`, `ServerSettings`); the constructors and functions that take a setting, the flags and
their help take it from there, so the two can never disagree."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

import pytest
from tpuserve.cli import serve as serve_command
from tpuserve.grpc_service import settings as backend_settings
from tpuserve.grpc_service.orchestrator import Orchestrator
from tpuserve.grpc_service.server import GrpcServer, serve, start_server
from tpuserve.grpc_service.servicer import TextGenerationServicer
from tpuserve.grpc_service.settings import ServerSettings
from tpuserve.http_gateway.settings import GatewaySettings
from tpuserve.sampler import process_group
from tpuserve.sampler.config import EngineConfig

ENGINE, SERVER = EngineConfig(), ServerSettings()

# (function, its parameter) -> the setting it takes
PARAMETERS = [
    (Orchestrator.__init__, "max_queue", ENGINE, "max_queue"),
    (Orchestrator.__init__, "max_queue_wait_s", ENGINE, "max_queue_wait"),
    (Orchestrator.__init__, "prefill_budget", ENGINE, "prefill_budget"),
    (TextGenerationServicer.__init__, "max_n", ENGINE, "max_n"),
    (TextGenerationServicer.__init__, "max_prompt_tokens", ENGINE, "max_prompt_tokens"),
    (TextGenerationServicer.__init__, "log_prompts", SERVER, "log_prompts"),
    (start_server, "max_queue", ENGINE, "max_queue"),
    (start_server, "max_n", ENGINE, "max_n"),
    (start_server, "max_prompt_tokens", ENGINE, "max_prompt_tokens"),
    (start_server, "max_queue_wait_s", ENGINE, "max_queue_wait"),
    (start_server, "prefill_budget", ENGINE, "prefill_budget"),
    (start_server, "log_prompts", SERVER, "log_prompts"),
    (serve, "host", SERVER, "host"),
    (serve, "port", SERVER, "port"),
    (serve, "drain_timeout_s", SERVER, "drain_timeout"),
    (GrpcServer.shutdown, "drain_timeout_s", SERVER, "drain_timeout"),
]


@pytest.mark.parametrize(("function", "parameter", "settings", "field"), PARAMETERS)
def test_a_parameter_that_takes_a_setting_defaults_to_the_settings_default(
    function, parameter, settings, field
):
    default = inspect.signature(function).parameters[parameter].default
    assert default == getattr(settings, field), f"{function.__qualname__}({parameter}=...) vs {field}"


def test_the_engine_takes_every_engine_setting_from_its_config():
    """JaxEngine(loaded, config, **settings): no parameter restates an EngineConfig field with its own default."""
    from tpuserve.sampler.engine import JaxEngine

    parameters = set(inspect.signature(JaxEngine.__init__).parameters)
    assert not parameters & {f.name for f in dataclasses.fields(EngineConfig)}


def test_the_process_group_timeouts_have_one_home():
    """The group's timeouts are the server's settings: the sampler layer takes them, with no default of its own."""
    for function, names in ((process_group.initialize, ("init_timeout", "peer_timeout")),
                            (process_group.Channel.__init__, ("peer_timeout",))):  # fmt: skip
        for name in names:
            assert inspect.signature(function).parameters[name].default is inspect.Parameter.empty


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_backend_flags_leave_defaults_to_the_settings_and_their_help_quotes_them():
    parser = backend_settings.parser()
    fields = {f.name: s for s in (ENGINE, SERVER) for f in dataclasses.fields(s)}
    checked = 0
    for action in _flags(parser):
        if action.dest not in fields:
            continue
        assert action.default is None, f"--{action.dest} has a default of its own: {action.default!r}"
        value = getattr(fields[action.dest], action.dest)
        said = re.search(r"default ([^\s,;()]+)", action.help or "")
        if said and value is not None:
            assert said.group(1) == _shown(value), (
                f"--{action.dest}: help says {said.group(1)}, setting {value!r}"
            )
            checked += 1
    assert checked >= 6  # host, port, max_queue, max_n, log_format, drain/peer/init timeouts


def test_serve_help_quotes_the_gateway_and_backend_defaults():
    helps = {a.dest: a.help for a in _flags(serve_command._parser())}
    assert helps["host"].endswith(f"else config, {GatewaySettings.host})")
    assert helps["port"].endswith(f"else config, {GatewaySettings.port})")
    assert helps["grpc_port"].endswith(f"else {ServerSettings.port})")
    assert serve_command.LOCAL_HOST in helps["grpc_host"]

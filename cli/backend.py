"""`tpuserve grpc`: the gRPC backend's settings (the defaults, then the `server:` and `engine:` sections of
`--config` (a flat file is the engine's), then the flags: grpc_service/settings.py) and its process, with JSON
logs. No JAX is loaded until the process serves: `tpuserve serve` checks a backend command line here."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from tpuserve.cli import jsonlog, settings
from tpuserve.grpc_service import settings as backend
from tpuserve.grpc_service.settings import ENGINE_FLAGS, ServerSettings
from tpuserve.sampler import xla_flags
from tpuserve.sampler.config import EngineConfig


def load_config(path: str | pathlib.Path | None, overrides: Mapping[str, Any] | None = None) -> EngineConfig:
    """The engine's settings: the `engine:` section of the YAML file at `path` (or the whole file when it has
    no sections; unknown keys and wrong types are a ValueError), then the `overrides` that are not None."""
    return settings.load(EngineConfig(), path, "engine", overrides, flat=True)


def parse_args(argv: Sequence[str] | None) -> tuple[ServerSettings, EngineConfig]:
    """Flags, then the `server:` and `engine:` sections of the --config YAML, then the defaults. The engine
    flags (--model, --max-queue, --max-n, --max-prompt-tokens, --max-queue-wait) override `engine:` keys.
    A bad setting exits with a usage error naming it."""
    p = backend.parser(prog="tpuserve grpc")
    settings.add_config_flag(p, "settings file (configs/*.yaml): engine: and server: sections (flags win)")
    ns = p.parse_args(argv)
    try:
        server = settings.load(ServerSettings(), ns.config, "server", vars(ns))
        engine = load_config(ns.config, {k: getattr(ns, k) for k in ENGINE_FLAGS})
    except (OSError, ValueError) as e:
        p.error(str(e))
    return server, engine


def main(argv: Sequence[str] | None = None) -> int:
    server, engine = parse_args(argv)
    jsonlog.setup("INFO", server.log_format)
    xla_flags.set_defaults()  # before JAX starts: a multi-process mesh check does so before load_engine
    from tpuserve.grpc_service.server import main as backend_main  # the engine (JAX): only to serve

    return backend_main(settings=(server, engine))

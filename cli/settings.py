"""The one reader of tpuserve's YAML settings files, and the one rule that makes a process's typed, frozen
settings: defaults, then its section of the file, then the command-line flags that were given (flags win).

One file may configure every process: `engine:` (the model and engine: `sampler.config.EngineConfig`), `server:`
(the gRPC backend: `grpc_service.settings.ServerSettings`) and `gateway:` (the HTTP gateway:
`http_gateway.settings.GatewaySettings`); each process reads only its own section. A file without any of these
sections is read as the flat settings of the process that accepts that (`flat=True`: the engine, the gateway).
A key set to null is the default, as an absent flag is. Each settings class and its flags live in its own
layer; this reader lives in the command line, above every layer, so no layer reads files or imports it:
`tpuserve gateway|grpc|serve` (gateway.py, backend.py, serve.py here) hand a layer's `main` its settings."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

SECTIONS = ("engine", "server", "gateway")

T = TypeVar("T")


def add_config_flag(p: argparse.ArgumentParser, help_text: str) -> None:
    """Add `--config FILE` to a layer's flags (`p`): the settings file this module reads."""
    p.add_argument("--config", default=None, metavar="YAML", help=help_text)


def read(path: str | pathlib.Path) -> dict[str, Any]:
    """The YAML file's top-level mapping (empty for an empty file); ValueError if it is not one."""
    try:
        data = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings")  # noqa: TRY004 (bad file content)
    return data


def is_sectioned(data: Mapping[str, Any]) -> bool:
    """Whether a file's mapping holds per-process sections (else it is one process's flat settings)."""
    return bool(set(SECTIONS) & set(data))


def section(
    data: Mapping[str, Any], name: str, flat: bool = False, path: object = "config"
) -> dict[str, Any]:
    """The `name:` mapping of a file's `data` (empty if absent); with `flat`, a file with no section is it."""
    if name in data:
        found = data[name] if data[name] is not None else {}  # a section with every key commented out
    elif flat and not is_sectioned(data):
        found = data
    else:
        found = {}
    if not isinstance(found, dict):
        raise ValueError(f"{path}: `{name}:` must be a mapping of settings")  # noqa: TRY004
    return dict(found)


def load(
    defaults: T,
    path: str | pathlib.Path | None,
    name: str,
    flags: Mapping[str, Any] | None = None,
    flat: bool = False,
) -> T:
    """`defaults` (a frozen dataclass instance) with the file's `name` section, then the `flags` that were given
    (not None), applied. Keys of the file that are not fields are a ValueError, flags that are not fields are
    ignored; values are checked against the fields' types. The class's own checks (`__post_init__`) run last."""
    cls = type(defaults)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    if path:
        found = section(read(path), name, flat, path)
        unknown = sorted(set(found) - set(hints))
        if unknown:
            raise ValueError(f"{path}: unknown {name} setting(s) {', '.join(unknown)}")
        values.update(
            {k: _typed(v, hints[k], f"{path}: `{name}.{k}`") for k, v in found.items() if v is not None}
        )
    for key, value in (flags or {}).items():
        if key in hints and value is not None:
            values[key] = _typed(value, hints[key], f"--{key.replace('_', '-')}")
    return dataclasses.replace(defaults, **values)  # type: ignore[type-var]


def _typed(value: Any, hint: Any, where: str) -> Any:
    """`value` as the field type `hint` (bool, int, float, str, tuple[str, ...], or one of them | None)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in args if a is not type(None)]
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and args[:1] == (str,):
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list | tuple) and all(isinstance(v, str) for v in items):
            return tuple(items)
        raise ValueError(f"{where} must be a string or a list of strings, not {value!r}")
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(hint, True)
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
        raise ValueError(f"{where} must be {kind}, not {value!r}")
    return float(value) if hint is float else value

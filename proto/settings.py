"""Settings of one process from defaults, one section of a YAML file, then command-line flags (flags win).

One file may configure every process: `engine:` (the model and engine), `server:` (the gRPC backend) and
`gateway:` (the HTTP gateway); each process reads only its own section. A file without any of these sections is
read as the flat settings of the process that accepts that (`flat=True`). Shared by the gateway and the backend,
so it lives in this package (no JAX)."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping
from typing import Any

import yaml

SECTIONS = ("engine", "server", "gateway")


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


def load_section(path: str | pathlib.Path, name: str, flat: bool = False) -> dict[str, Any]:
    """The `name:` mapping of the YAML file at `path` (see `section`)."""
    return section(read(path), name, flat, path)


def merge(
    defaults: Mapping[str, Any],
    path: str | pathlib.Path | None,
    name: str,
    flags: Mapping[str, Any],
    flat: bool = False,
) -> dict[str, Any]:
    """`defaults`, then the file's `name` section (unknown keys are a ValueError), then the flags that were given
    (not None) among the keys of `defaults`."""
    settings = dict(defaults)
    if path:
        section = load_section(path, name, flat)
        unknown = sorted(set(section) - set(defaults))
        if unknown:
            raise ValueError(f"{path}: unknown {name} setting(s) {', '.join(unknown)}")
        settings.update({k: v for k, v in section.items() if v is not None})
    settings.update({k: v for k, v in flags.items() if k in defaults and v is not None})
    return settings

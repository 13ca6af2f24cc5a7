"""JAX's persistent compilation cache: warm-up compiles every program once per (model shape, config, device
kind, jax version) on a machine, and later starts load them from disk.

JAX keys each entry by the program's HLO, the compile options, the backend and device kind and the jax/jaxlib
versions, so another model, another `max_seq_len` or another device never reuses a wrong program. Weights are
program arguments, not constants: two checkpoints of one architecture share their programs, correctly.
"""

from __future__ import annotations

import logging
import os
import pathlib

import jax

log = logging.getLogger(__name__)


def default_dir() -> pathlib.Path:
    """`$XDG_CACHE_HOME/tpuserve`, `~/.cache/tpuserve` when it is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "tpuserve"


def enable(directory: str | pathlib.Path | None) -> pathlib.Path | None:
    """Use `directory` (created if missing; None = the default, "none" = off) as the compilation cache.

    Returns the directory in use, or None when off. A directory that cannot be written is a warning and a cold
    start, never a failed one; an unreadable entry is JAX's warning and a fresh compile."""
    if isinstance(directory, str) and directory.strip().lower() == "none":
        return None
    path = pathlib.Path(directory).expanduser() if directory else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        log.warning("compilation cache %s is not usable (%s): compiling without it", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", 0.0
    )  # every program: warm-up has many small ones
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path

"""XLA flags the engine sets for its own process, before JAX starts a backend (XLA reads `XLA_FLAGS` once, when
the first backend starts; later changes are ignored).

XLA:CPU's default scheduler orders a program for concurrency: independent fusions may run side by side on the
thread pool, at the price of more buffers alive at once. On this project's CPU decode programs that loses:
the memory-optimized (depth-first) order made a 64-row decode step 15-17 % faster and a one-row step ~4 %
faster on a 2-core host (docs/engine.md, "XLA:CPU scheduler"); each fusion's arithmetic is unchanged, so tokens and
logprobs are too. The flag is an XLA:CPU one: GPU and TPU programs ignore it. A scheduler the user names in
`XLA_FLAGS` is kept.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

SCHEDULER_FLAGS = ("xla_cpu_scheduler_type", "xla_cpu_enable_concurrency_optimized_scheduler")


def scheduler_flag(jaxlib_version: str | None = None) -> str:
    """The memory-optimized scheduler, spelled for this jaxlib: `xla_cpu_scheduler_type` from 0.9.1 on (where
    the boolean flag is deprecated), the boolean before it (an unknown flag aborts XLA)."""
    version = jaxlib_version or importlib.metadata.version("jaxlib")
    parts = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    if parts >= (0, 9, 1):
        return "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    return "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def set_defaults(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Add the scheduler flag to `XLA_FLAGS` unless a scheduler is named there already; returns the flag added,
    or None. Call it before anything starts a JAX backend (`jax.devices()`, the first array): after that it
    only logs that the programs run on XLA's default scheduler (slower on CPU, the same results)."""
    process = environ is None  # this process's environment: too late once JAX's backend started
    environ = os.environ if environ is None else environ
    flags = environ.get("XLA_FLAGS", "")
    if any(name in flags for name in SCHEDULER_FLAGS):
        return None
    if process and "jax" in sys.modules:  # never imports JAX itself (the CLI calls this first)
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            log.warning(
                "JAX started before tpuserve could set XLA_FLAGS: XLA's default CPU scheduler is used"
            )
            return None
    added = scheduler_flag()
    environ["XLA_FLAGS"] = f"{flags} {added}".strip()
    return added

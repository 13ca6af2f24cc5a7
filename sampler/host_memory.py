"""Host memory the engine's process keeps: freed blocks stay in the process (glibc malloc) instead of going back
to the kernel, so a program's next call reuses pages that are already mapped.

XLA:CPU allocates a program's buffers for each call and frees them when it ends. glibc serves a block above its
mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it when freed, and trims its heap once the free
top passes 128 KiB: the next call's buffers are then fresh pages, each faulting when first touched. A 64-row
decode call of the embedded model touches about 48 MiB of fresh pages that way, and faulting them in costs some
twenty times writing them once mapped (docs/engine.md, "Host memory"). With
mmap off for malloc (every block from the heap) and the heap trimmed only past 128 MiB of free top, the same
call touches none. The resident set then stays near its peak instead of shrinking between calls.

`load_engine` sets it on XLA:CPU once the weights are loaded: a program's buffers are host memory there (an
accelerator's are the device's), and the loading buffers of a large checkpoint still go back to the kernel. Only
glibc has these settings, and a user's own (MALLOC_* environment variables, GLIBC_TUNABLES) are kept.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_THRESHOLD = 128 << 20
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Serve every block of this process from glibc's heap (no mmap) and trim the heap only past TRIM_THRESHOLD
    (any time: later allocations follow). Returns whether it was set: False on another C library, or where the
    user set malloc's own settings."""
    environ = os.environ if environ is None else environ
    libc = _glibc()
    if libc is None:
        return False
    if any(name in environ for name in USER_SETTINGS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        log.info("malloc settings from the environment kept")
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("glibc refused the malloc settings: freed buffers go back to the kernel")
    return ok


def release_free_memory() -> None:
    """Give the heap's free pages back to the kernel now (glibc's malloc_trim): after the warm-up, whose compiler
    runs freed far more than a serving call needs; the serving calls' own buffers then fault in once and stay."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (the only one with these settings), else None."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None

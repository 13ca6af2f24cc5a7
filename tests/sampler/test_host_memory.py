"""The engine process's host memory (sampler/host_memory.py): once set, a freed buffer's pages are reused by the
next allocation instead of faulting in again, until release_free_memory gives them back; a user's own malloc
settings are kept; the real backend sets it.
Each case is a fresh process (malloc's settings are process-wide), its page faults read from getrusage."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

from tpuserve.sampler import host_memory

# Three times: a 40 MiB buffer (above glibc's largest mmap threshold, 32 MiB) allocated, written and freed; prints whether the settings were made and each round's minor page faults.
PROBE = r"""
import ctypes, json, resource, sys
from tpuserve.sampler import host_memory
made = host_memory.keep_freed_memory() if sys.argv[1] == "set" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def faults() -> int:  # malloc'd as XLA:CPU's buffers are (no madvise: small pages)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(40 << 20)
    ctypes.memset(p, 1, 40 << 20)
    libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

rounds = [faults() for _ in range(3)]
host_memory.release_free_memory()  # then the pages are the kernel's again: the next round faults them in
print(json.dumps({"made": made, "faults": rounds, "after_release": faults()}))
"""
PAGES = (40 << 20) // 4096


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_pages_are_reused_once_set_and_fault_again_by_default():
    assert platform.libc_ver()[0] == "glibc"  # the settings are glibc's; CI and the serving images run on it
    default = _probe("default")
    assert all(n > 0.9 * PAGES for n in default["faults"]), default  # every round: fresh pages
    kept = _probe("set")
    assert kept["made"] is True
    assert kept["faults"][0] > 0.9 * PAGES, kept  # the heap grows once ...
    assert all(n < 0.01 * PAGES for n in kept["faults"][1:]), kept  # ... and is reused after
    assert kept["after_release"] > 0.9 * PAGES, kept  # release_free_memory (after the warm-up) gave them back


def test_a_users_own_malloc_settings_are_kept():
    users = _probe("set", MALLOC_TRIM_THRESHOLD_="131072")
    assert users["made"] is False
    assert all(n > 0.9 * PAGES for n in users["faults"]), users  # glibc as the user set it: nothing kept
    assert host_memory.keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) is False
    assert host_memory.keep_freed_memory({"MALLOC_MMAP_MAX_": "0"}) is False

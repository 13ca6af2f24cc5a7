"""JAX's persistent compilation cache (a fast start): a second start loads every program from the cache, a
changed config compiles its own programs and serves the same tokens, and a corrupt or unwritable cache
directory is a warning and a cold start. Each run is a fresh process (the cache setting is process-wide)."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

SCRIPT = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from tpuserve.cli.backend import load_config
import jax
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.factory import load_engine
hits = []
jax.monitoring.register_event_listener(lambda name, **_: hits.append(1) if name.endswith("/cache_hits") else None)
cfg = load_config(None, dict(slots=2, max_seq_len=int(sys.argv[2]), min_prefill_bucket=16, min_attend_bucket=64,
                             min_batch_bucket=2, steps_per_call=4, compilation_cache_dir=sys.argv[1]))
engine, tok, _ = load_engine(cfg)
out = [engine.insert(engine.prefill(tok.encode("The capital of France is")), 0,
                     SlotParams(max_tokens=9, temperature=0.0)).token_id]
while len(out) < 9:
    step = engine.decode()
    out += [int(step.ids[n, 0]) for n in range(step.ids.shape[0]) if step.valid[n, 0]]
print(json.dumps({"tokens": out[:9], "hits": len(hits)}))
"""


def _launch(cache: str, max_seq_len: int = 64) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, cache, str(max_seq_len)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _result(proc: subprocess.Popen) -> tuple[dict, str]:
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def _start(cache: str, max_seq_len: int = 64) -> tuple[dict, str]:
    return _result(_launch(cache, max_seq_len))


def test_warm_cache_corrupt_cache_changed_config_and_unwritable_dir(tmp_path: pathlib.Path):
    cache = tmp_path / "cache"
    blocker = tmp_path / "a-file"  # a cache directory that cannot be made: a warning and a cold start
    blocker.write_text("not a directory")
    # alongside the first cold start (its own process, no cache of its own): the suite's time
    unusable_run = _launch(str(blocker / "cache"))
    try:
        cold, _ = _start(str(cache))
    except BaseException:
        unusable_run.kill()
        raise
    unusable, stderr = _result(unusable_run)
    assert "compilation cache" in stderr and "not usable" in stderr
    assert unusable["tokens"] == cold["tokens"] and unusable["hits"] == 0
    entries = list(cache.iterdir())
    assert len(entries) > 5 and cold["hits"] == 0
    # a copy of the cold start's cache with every entry corrupt, for a start with another max_seq_len: the programs
    # it shares with the first config are unreadable, the others new; same tokens. It runs alongside the warm start
    # on the intact cache (each its own process and directory: the suite's time)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(cache, corrupt)
    for entry in corrupt.iterdir():
        if entry.is_file():
            entry.write_bytes(b"not a compiled program")
    warm_run = _launch(str(cache))
    try:
        longer, _ = _start(str(corrupt), max_seq_len=128)
    except BaseException:
        warm_run.kill()
        raise
    warm, _ = _result(warm_run)
    assert warm["tokens"] == cold["tokens"]
    assert warm["hits"] >= 5  # every warm-up program loaded from the cache
    assert longer["tokens"] == cold["tokens"] and longer["hits"] == 0

"""The engine's XLA:CPU scheduler flag (sampler/xla_flags.py): added to XLA_FLAGS before JAX starts, spelled
so that this jaxlib accepts it (XLA aborts on an unknown flag), never over a scheduler the user chose, and a
warning (not a silent no-op) when JAX started first. Real processes: XLA reads its flags once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tpuserve.sampler import xla_flags

# Two independent 8 MiB chains: the concurrency-optimized (breadth-first) order keeps both alive at once, the
# memory-optimized (depth-first) one finishes one before starting the other.
PROBE = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from tpuserve.sampler import xla_flags
early = sys.argv[1] == "early"
if not early:
    import jax
    jax.devices()
added = xla_flags.set_defaults()
import jax, jax.numpy as jnp

def f(x, y):
    a = jnp.sin(jnp.cumsum(x, 0)) @ x
    b = jnp.cos(jnp.cumsum(y, 0)) @ y
    return jnp.tanh(a).sum() + jnp.tanh(b).sum()

x = jnp.ones((1024, 1024)) / 1024
compiled = jax.jit(f).lower(x, x).compile()
print(json.dumps({"added": added, "temp": compiled.memory_analysis().temp_size_in_bytes,
                  "value": float(compiled(x, x))}))
"""


def _probe(when: str, xla_flags_env: str) -> tuple[dict, str]:
    env = {**os.environ, "XLA_FLAGS": xla_flags_env}
    done = subprocess.run([sys.executable, "-c", PROBE, when], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_set_defaults_adds_the_scheduler_once_and_keeps_the_users_flags():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    added = xla_flags.set_defaults(env)
    assert added == xla_flags.scheduler_flag()
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=4 {added}"
    assert xla_flags.set_defaults(env) is None  # named already: unchanged
    assert env["XLA_FLAGS"].count("scheduler") == 1
    empty: dict[str, str] = {}
    assert xla_flags.set_defaults(empty) == empty["XLA_FLAGS"]
    for users in ("--xla_cpu_enable_concurrency_optimized_scheduler=true",
                  "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"):  # fmt: skip
        env = {"XLA_FLAGS": users}
        assert xla_flags.set_defaults(env) is None and env["XLA_FLAGS"] == users


def test_flag_spelling_follows_jaxlib():
    assert (
        xla_flags.scheduler_flag("0.10.2") == "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    )
    assert xla_flags.scheduler_flag("0.9.1") == xla_flags.scheduler_flag("0.11.0rc1")
    assert xla_flags.scheduler_flag("0.6.2") == "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def test_flag_is_accepted_and_takes_effect_only_before_jax_starts():
    base = "--xla_force_host_platform_device_count=1"
    memory, _ = _probe("early", base)
    assert memory["added"] == xla_flags.scheduler_flag()
    concurrent, _ = _probe("early", base + " --xla_cpu_enable_concurrency_optimized_scheduler=true")
    assert concurrent["added"] is None
    late, stderr = _probe("late", base)
    assert late["added"] is None and "XLA's default CPU scheduler is used" in stderr
    # the same arithmetic whatever the order; the memory-optimized order needs less scratch
    assert memory["value"] == concurrent["value"] == late["value"]
    assert memory["temp"] < concurrent["temp"], (memory, concurrent)
    assert late["temp"] == concurrent["temp"]

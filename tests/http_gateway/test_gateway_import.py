"""The gateway is a small separate process: importing and building it must not pull in JAX or the backend."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("jax", "jaxlib", "torch", "flax", "tpuserve.model", "tpuserve.sampler", "tpuserve.grpc_service")

CODE = f"""
import sys
from tpuserve.http_gateway.app import create_app
from tpuserve.http_gateway.serve import main
create_app(["127.0.0.1:1"], api_key="k")
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FORBIDDEN!r} or m.startswith({FORBIDDEN!r}))
print(",".join(bad))
"""


def test_importing_the_gateway_leaves_jax_and_the_backend_unloaded() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"gateway imported: {out.stdout.strip()}"

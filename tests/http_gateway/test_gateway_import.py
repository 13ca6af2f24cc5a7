"""The gateway is a small separate process: every module of `tpuserve.http_gateway` imports, and the app builds,
without loading JAX or the backend's packages; no module there even names them (not even in a lazy import).
The `tpuserve serve` process, which runs the gateway, loads no JAX either."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import tpuserve.http_gateway

BACKEND = ("tpuserve.model", "tpuserve.sampler", "tpuserve.grpc_service")
JAX = ("jax", "jaxlib", "flax", "torch")

LOADED = """
import sys
bad = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r} or m.startswith({forbidden!r}))
print(",".join(bad))
"""

IMPORT_ALL = """
import importlib, pkgutil
import tpuserve.http_gateway as gateway
names = [m.name for m in pkgutil.walk_packages(gateway.__path__, gateway.__name__ + ".")]
assert len(names) > 10, names
for name in names:
    importlib.import_module(name)
from tpuserve.http_gateway.app import create_app
create_app(["127.0.0.1:1"], api_key="k")
"""


def loaded_after(code: str, forbidden: tuple[str, ...]) -> str:
    """The forbidden modules in sys.modules after running `code` in a fresh interpreter."""
    script = code + LOADED.format(forbidden=forbidden)
    out = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_every_gateway_module_imports_without_jax_or_the_backend() -> None:
    loaded = loaded_after(IMPORT_ALL, JAX + BACKEND)
    assert loaded == "", f"the gateway imported: {loaded}"


def test_no_gateway_module_names_the_backend_packages() -> None:
    sources = sorted(pathlib.Path(tpuserve.http_gateway.__file__).parent.rglob("*.py"))
    assert len(sources) > 10
    named = [(p.name, pkg) for p in sources for pkg in BACKEND if pkg in p.read_text()]
    assert named == [], named


def test_the_serve_command_process_loads_no_jax() -> None:
    """`tpuserve serve` checks the backend's settings in this process (grpc_service/settings.py, the engine
    config), then runs the gateway here: none of that may load JAX."""
    code = "import tpuserve.cli.main\nfrom tpuserve.cli.serve import plan\nplan([])\n"
    loaded = loaded_after(code, JAX + ("tpuserve.model",))
    assert loaded == "", f"`tpuserve serve` imported: {loaded}"

"""The serving install has no torch: loading the embedded model, building an engine and the gRPC server
module import neither torch nor transformers (both are test-only references)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from tpuserve.model.loader import load_model
from tpuserve.sampler.engine import JaxEngine
from tpuserve.sampler.api import SlotParams
import tpuserve.grpc_service.server, tpuserve.cli.main
m = load_model()
e = JaxEngine(m, slots=1, max_seq_len=64, steps_per_call=2, min_prefill_bucket=32)
out = e.insert(e.prefill(m.tokenizer.encode("Hi")), 0, SlotParams(max_tokens=2, temperature=0.0))
bad = sorted(k for k in ("torch", "transformers") if k in sys.modules)
print("imported:", bad)
sys.exit(1 if bad else 0)
"""


def test_serving_path_imports_no_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "imported: []" in proc.stdout

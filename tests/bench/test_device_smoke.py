"""`python -m bench.device --smoke` end to end on the CPU (a subprocess: the script sets JAX's memory fraction and
compilation cache for its own process): every row of the device table is there, measured, and the verdicts
that hold on any device hold here (the fidelity rows compare the CPU with itself: Δ = 0; warm_up leaves no
compile behind)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)

ROWS = [  # (key, a part of its name) in table order
    ("fidelity", "matmul precision default"),
    ("fidelity", "matmul precision highest"),
    *[("decode", f"bf16, decode {b} slot") for b in (1, 2)],
    ("prefill", "bf16, prefill 64-token prompt"),
    ("compiles", "bf16: XLA compiles after warm_up"),
    *[("decode", f"int8, decode {b} slot") for b in (1, 2)],
    ("prefill", "int8, prefill 64-token prompt"),
    ("compiles", "int8: XLA compiles after warm_up"),
    ("int8", "int8 vs bf16 decode tok/s, 1 slot"),
]


def test_device_smoke_prints_every_row_measured(tmp_path):
    out = tmp_path / "device.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "bench.device", "--smoke", "--json", str(out)]
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the device's kind and the date
    assert re.search(r"^device: \S.*, jax \S+, \d{4}-\d\d-\d\dT", proc.stdout, re.MULTILINE)
    assert "| benchmark" in proc.stdout

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(ROWS)
    for row, (key, part) in zip(rows, ROWS):
        assert row["key"] == key and part in row["name"], row
        assert row["name"] in proc.stdout.replace("\\|", "|")  # in the printed table
        assert row["result"] in ("PASS", "MISS", "diagnostic"), row  # measured: not "not run", not "error"
        assert re.search(r"\d", row["measured"]), row
        if key != "compiles":
            assert row["ratio"] is not None and math.isfinite(row["ratio"]) and row["ratio"] >= 0, row
    fidelity = [r for r in rows if r["key"] == "fidelity"]
    assert all(r["ratio"] == 0.0 and r["result"] == "PASS" for r in fidelity)  # the CPU against itself
    assert all(r["measured"] == "0" and r["result"] == "PASS" for r in rows if r["key"] == "compiles")
    assert all("greedy tokens equal: 8/8" in r["note"] for r in fidelity)

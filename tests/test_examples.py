"""The examples under examples/ run as a user runs them (a process of their own) and do what they say."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_rl_weight_update_example_trains_a_step_and_serves_it():
    """One REINFORCE step on a sampled completion, swapped into the running server from the trainer's arrays: the
    answers carry the new version, the server's re-score of the sample rises, and before the step the server's
    score is the trainer's own (same weights, same model code)."""
    out = subprocess.run([sys.executable, str(REPO / "examples" / "rl_weight_update.py")], capture_output=True,
                         text=True, timeout=600, cwd=REPO, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["version_before"], result["version_after"]) == ("step-0", "step-1")
    assert abs(result["served_mean_logprob_before"] - result["trainer_mean_logprob_before"]) < 1e-4
    assert result["served_mean_logprob_after"] > result["served_mean_logprob_before"] + 0.1

"""Our model against transformers on the same weights, the way the family tests (Qwen3, Gemma 3, Qwen3-MoE) check
it: logits of one forward over a fresh cache, their log-softmax, and teacher-forced logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.model.llama import init_cache

from tests.helpers import require_extra

BOUND = 1e-4  # fp32, |ours - transformers| over every logit / logprob


def reference_logits(model, ids: list[int]) -> np.ndarray:
    """transformers' logits [T, V] of `ids` in fp32."""
    torch = require_extra("torch")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def our_logits(loaded, ids: list[int], scan_layers: bool = True, mesh=None) -> np.ndarray:
    m = loaded.module(scan_layers=scan_layers, mesh=mesh)
    T = len(ids)
    hidden, _ = m(jnp.asarray([ids]), jnp.arange(T)[None], init_cache(loaded.config, 1, T), T)
    return np.asarray(m.logits(hidden[0]))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def assert_matches(
    loaded, ref: np.ndarray, scan_layers: bool = True, *, ids: list[int], bound: float = BOUND, mesh=None
) -> float:
    """Logits, logprobs and teacher-forced logprobs (each next token's given its prefix) of `ids` within `bound` of
    `ref` (reference_logits of the same ids); the largest |difference| of the three."""
    ours = our_logits(loaded, ids, scan_layers, mesh)
    lp, ref_lp = log_softmax(ours)[:-1], log_softmax(ref)[:-1]
    rows = np.arange(len(ids) - 1)
    diffs = (np.abs(ours - ref).max(), np.abs(lp - ref_lp).max(),
             np.abs(lp[rows, ids[1:]] - ref_lp[rows, ids[1:]]).max())  # fmt: skip
    assert max(diffs) < bound, diffs
    return float(max(diffs))

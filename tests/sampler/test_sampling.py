"""Top-k / top-p / min-p filtering on the device against a plain NumPy reference (sorted cumulative mass),
including nuclei wider than the 256-token fast path (the bisection fallback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.sampler.sampling import processed_logits, sample


def reference_keep(logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    scaled = logits / temperature
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.zeros_like(scaled, bool)
    cum = np.cumsum(probs[order])
    n_p = int(np.searchsorted(cum, top_p) + 1) if top_p < 1 else len(order)
    n = min(n_p, top_k if top_k > 0 else len(order))
    keep[order[:n]] = True
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return keep


def test_filters_match_reference_for_narrow_and_wide_nuclei():
    rng = np.random.default_rng(0)
    V = 4096
    peaked = rng.standard_normal((3, V)).astype(np.float32) * 4.0  # nucleus inside the top 256
    flat = rng.standard_normal((3, V)).astype(np.float32) * 0.3  # nucleus of thousands: bisection path
    cases = [(1.0, 0.9, 0, 0.0), (0.7, 0.5, 40, 0.0), (1.3, 1.0, 300, 0.0), (1.0, 1.0, 0, 0.05), (1.0, 0.95, 2000, 0.0)]
    for logits in (peaked, flat):
        for t, p, k, m in cases:
            B = logits.shape[0]
            out = processed_logits(jnp.asarray(logits), jnp.full(B, t), jnp.full(B, p), jnp.full(B, k, jnp.int32),
                                   jnp.full(B, m))  # fmt: skip
            got = np.isfinite(np.asarray(out))
            for b in range(B):
                want = reference_keep(logits[b], t, p, k, m)
                assert np.array_equal(got[b], want), (t, p, k, m, got[b].sum(), want.sum())


def test_sampling_follows_the_distribution_and_greedy_at_zero_temperature():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2, 1e-9]], jnp.float32))
    B = 4000
    rows = jnp.repeat(logits, B, axis=0)
    keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(3), B)).astype(jnp.uint32)
    ids = sample(rows, jnp.zeros(B, jnp.int32), keys, jnp.arange(B), jnp.ones(B), jnp.ones(B),
                    jnp.zeros(B, jnp.int32), jnp.zeros(B))  # fmt: skip
    freq = np.bincount(np.asarray(ids), minlength=4) / B
    assert np.abs(freq[:3] - [0.5, 0.3, 0.2]).max() < 0.03 and freq[3] == 0
    greedy = sample(rows[:2], jnp.zeros(2, jnp.int32) + 7, keys[:2], jnp.arange(2), jnp.zeros(2), jnp.ones(2),
                       jnp.zeros(2, jnp.int32), jnp.zeros(2))  # fmt: skip
    assert np.asarray(greedy).tolist() == [7, 7]  # temperature 0 takes the greedy ids as given

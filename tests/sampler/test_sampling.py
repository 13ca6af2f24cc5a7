"""Top-k / top-p / min-p filtering on the device against a plain NumPy reference (sorted cumulative mass),
including nuclei wider than the 256-token fast path (the bisection fallback)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.sampler.sampling import processed_logits, sample


def reference_keep(
    logits: np.ndarray, temperature: float, top_p: float, top_k: int, min_p: float
) -> np.ndarray:
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
    cases = [
        (1.0, 0.9, 0, 0.0),
        (0.7, 0.5, 40, 0.0),
        (1.3, 1.0, 300, 0.0),
        (1.0, 1.0, 0, 0.05),
        (1.0, 0.95, 2000, 0.0),
    ]
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


def test_inverse_cdf_is_exact_across_blocks_and_never_picks_an_excluded_token():
    from tpuserve.sampler.sampling import inverse_cdf

    V = 1000  # four blocks of 256, the last one partial
    rng = np.random.default_rng(5)
    scaled = rng.standard_normal(V).astype(np.float32) * 2
    scaled[rng.choice(V, 400, replace=False)] = -np.inf  # filtered tokens
    scaled[990:] = -np.inf  # the tail of the last block: nothing there
    probs = np.exp(scaled - scaled[np.isfinite(scaled)].max())
    probs /= probs.sum()
    n = 200_000
    u = (np.arange(n, dtype=np.float64) + 0.5) / n  # a stratified grid over [0, 1): the CDF itself
    ids = np.concatenate([np.asarray(jax.jit(inverse_cdf)(jnp.asarray(np.broadcast_to(scaled, (4000, V))),
                                                          jnp.asarray(u[k : k + 4000], jnp.float32)))
                          for k in range(0, n, 4000)])  # fmt: skip
    freq = np.bincount(ids, minlength=V) / n
    assert np.isfinite(scaled[ids]).all()
    assert np.abs(freq - probs).max() < 1e-4  # the grid hits each token's share of [0, 1) to within 1/n
    edges = jnp.asarray([0.0, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    ends = np.asarray(inverse_cdf(jnp.asarray(np.broadcast_to(scaled, (2, V))), edges))
    assert (
        ends[0] == np.flatnonzero(np.isfinite(scaled))[0]
        and ends[1] == np.flatnonzero(np.isfinite(scaled))[-1]
    )


def test_a_rows_draw_does_not_depend_on_the_other_rows():
    from tpuserve.sampler.sampling import inverse_cdf

    rng = np.random.default_rng(6)
    scaled = jnp.asarray(rng.standard_normal((64, 49152)).astype(np.float32) * 3)
    u = jnp.asarray(rng.random(64), jnp.float32)
    together = np.asarray(jax.jit(inverse_cdf)(scaled, u))
    for rows in (slice(0, 2), slice(5, 13), slice(40, 56)):
        assert (np.asarray(jax.jit(inverse_cdf)(scaled[rows], u[rows])) == together[rows]).all()

"""On-device sampling and logprobs. All per-slot parameters are traced arrays ([B]), never static.

Sampling inverts the cumulative distribution of the (filtered) scaled logits with one uniform number per row: exact
categorical sampling in O(V) with no vocabulary sort, in two levels (blocks of 256 tokens, then within the block).
Not Gumbel-max: it needs V random numbers a row, and threefry for 64 x 49,152 of them costs XLA:CPU about 20x
this whole sampler. Top-k / top-p thresholds come from the 256 most likely tokens; only when some slot's nucleus
reaches past them does a bisection over the whole vocabulary run (under `lax.cond`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

FILTER_WIDTH = 256
NEG_INF = -jnp.inf


def top_logprobs(logprobs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """logprobs: [B, V] -> (values [B, k] descending, ids [B, k]).

    The optimization barrier keeps XLA:CPU from rewriting TopK into a full sort when a consumer slices it."""
    values, ids = jax.lax.top_k(logprobs, k)
    # A third operand keeps the barrier's tuple from folding into TopK's own tuple: XLA:CPU's TopK decomposer
    # (run on SPMD-partitioned programs) aborts when TopK feeds an optimization barrier directly.
    values, ids, _ = jax.lax.optimization_barrier((values, ids.astype(jnp.int32), logprobs[..., :1]))
    return values, ids


def _thresholds_from_sorted(sorted_scaled: jax.Array, lse: jax.Array, top_p: jax.Array, top_k: jax.Array):
    """sorted_scaled: [B, W] descending scaled logits (W may be < V).

    Returns (threshold [B], exact [B]): exact is False where the answer lies past the W values seen."""
    W = sorted_scaled.shape[-1]
    cum = jnp.cumsum(jnp.exp(sorted_scaled - lse[:, None]), axis=-1)
    p_on = top_p < 1.0
    k_on = top_k > 0
    p_idx = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), W - 1)  # the token crossing top_p is kept
    k_idx = jnp.minimum(top_k, W) - 1
    idx = jnp.where(p_on & k_on, jnp.minimum(p_idx, k_idx), jnp.where(p_on, p_idx, k_idx))
    thr = jnp.take_along_axis(sorted_scaled, jnp.maximum(idx, 0)[:, None], axis=-1)[:, 0]
    p_reached = cum[:, -1] >= top_p
    exact = (~p_on & ~k_on) | (p_on & p_reached) | (k_on & (top_k <= W))
    return jnp.where(p_on | k_on, thr, NEG_INF), exact


def _bisect_threshold(scaled: jax.Array, lse: jax.Array, top_p: jax.Array, top_k: jax.Array, iters: int = 32):
    """Exact thresholds without a vocabulary sort (on XLA:CPU a [64, 49152] sort costs several decode steps): bisect for the
    largest t whose kept set {scaled >= t} still holds top_p of the mass (and, separately, top_k tokens)."""
    probs = jnp.exp(scaled - lse[:, None])
    lo0 = jnp.min(jnp.where(jnp.isfinite(scaled), scaled, jnp.inf), axis=-1) - 1.0  # keeps everything
    hi0 = jnp.max(scaled, axis=-1) + 1.0  # keeps nothing

    def body(_, c):
        lo_p, hi_p, lo_k, hi_k = c
        mid_p, mid_k = (lo_p + hi_p) / 2, (lo_k + hi_k) / 2
        ok_p = jnp.sum(jnp.where(scaled >= mid_p[:, None], probs, 0.0), axis=-1) >= top_p
        ok_k = jnp.sum(scaled >= mid_k[:, None], axis=-1) >= top_k
        return (jnp.where(ok_p, mid_p, lo_p), jnp.where(ok_p, hi_p, mid_p),
                jnp.where(ok_k, mid_k, lo_k), jnp.where(ok_k, hi_k, mid_k))  # fmt: skip

    # 32 halvings of a range of a few tens: finer than a float32 ulp there, so the kept set is exact
    lo_p, _, lo_k, _ = jax.lax.fori_loop(0, iters, body, (lo0, hi0, lo0, hi0))
    thr_p = jnp.where(top_p < 1.0, lo_p, NEG_INF)
    thr_k = jnp.where(top_k > 0, lo_k, NEG_INF)
    return jnp.maximum(thr_p, thr_k)


def filter_threshold(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Per-slot logit threshold for top-k / top-p ([B]); -inf where no filtering applies."""
    lse = jax.nn.logsumexp(scaled, axis=-1)
    W = min(FILTER_WIDTH, scaled.shape[-1])
    vals, _ = jax.lax.top_k(scaled, W)
    thr, exact = _thresholds_from_sorted(vals, lse, top_p, top_k)
    # rows whose answer is already exact keep it: their parameters are neutralised in the bisection
    slow_p = jnp.where(exact, 1.0, top_p)
    slow_k = jnp.where(exact, 0, top_k)
    return jax.lax.cond(
        jnp.all(exact),
        lambda _: thr,
        lambda _: jnp.where(exact, thr, _bisect_threshold(scaled, lse, slow_p, slow_k)),
        None,
    )


def processed_logits(logits: jax.Array, temperature, top_p, top_k, min_p) -> jax.Array:
    """logits [B, V] -> temperature-scaled logits with top-k / top-p / min-p filtered to -inf."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    needs = jnp.any((top_p < 1.0) | (top_k > 0))
    thr = jax.lax.cond(
        needs, lambda s: filter_threshold(s, top_p, top_k), lambda s: jnp.full(s.shape[:1], NEG_INF), scaled
    )
    keep = scaled >= thr[:, None]
    mx = jnp.max(scaled, axis=-1, keepdims=True)
    keep &= (min_p[:, None] <= 0) | (scaled - mx >= jnp.log(jnp.maximum(min_p, 1e-30))[:, None])
    return jnp.where(keep, scaled, NEG_INF)


def sample(
    logits: jax.Array,
    greedy_ids: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    temperature,
    top_p,
    top_k,
    min_p,
    mask: Callable[[], jax.Array] | None = None,
) -> jax.Array:
    """Token ids [B]: greedy where temperature == 0, else a draw from the processed distribution.

    mask: the logits with disallowed tokens at -inf (structured outputs), built only when something is drawn.

    keys: [B, 2] raw PRNG keys of each slot's seed; positions: [B] the position the sampled token will take, so a
    seeded request samples the same tokens in any slot, next to any other requests. An all-greedy batch skips the
    filtering and the random numbers altogether (`lax.cond`).
    """

    def draw(_):
        proc = processed_logits(logits if mask is None else mask(), temperature, top_p, top_k, min_p)
        step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(step_keys)
        return inverse_cdf(proc, u)

    sampled = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy_ids, None)
    return jnp.where(temperature > 0, sampled, greedy_ids)


SAMPLE_BLOCK = 256


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last entry > 0 along the last axis (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(x[..., ::-1] > 0, axis=-1).astype(jnp.int32)


def inverse_cdf(scaled: jax.Array, u: jax.Array) -> jax.Array:
    """Token ids [B] drawn from softmax(scaled) ([B, V], -inf = excluded) with uniforms u ([B], in [0, 1)): the
    first token whose cumulative (unnormalised) mass exceeds u x the total. Block sums first, then the cumulative
    mass inside the chosen block; every reduction is over one row, so a row's draw never depends on the others.
    Rounding can never pick an excluded token: both levels stop at the last one with mass."""
    B, V = scaled.shape
    blocks = -(-V // SAMPLE_BLOCK)
    p = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, blocks * SAMPLE_BLOCK - V))).reshape(B, blocks, SAMPLE_BLOCK)
    sums = p.sum(axis=-1)
    cum = jnp.cumsum(sums, axis=-1)
    target = u * cum[:, -1]
    blk = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1).astype(jnp.int32), _last_positive(sums))
    before = jnp.where(
        blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0
    )
    row = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]
    inside = jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1).astype(jnp.int32)
    return blk * SAMPLE_BLOCK + jnp.minimum(inside, _last_positive(row))

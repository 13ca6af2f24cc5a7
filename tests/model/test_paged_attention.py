"""Paged decode attention (tpuserve.model.attention_tpu): jax's Pallas TPU kernel, run in jax's TPU interpreter
on CPU, against the plain XLA gather path, and that against a NumPy loop over rows and heads.

Pools are random (page 0 the null page), rows' pages scattered through the pool, lengths cover a row spanning
several pages and ending inside one, an idle row (0) between live rows, a row of 1 token and one of whole pages.
The kernel casts every page to bf16 after loading it, so fp32 results are held to two bounds: against the
reference on the same pools with K and V rounded to bf16 (the kernel's arithmetic: measured <= 6e-7, bound
2e-6) and against the exact fp32 reference (the rounding itself: measured <= 7.8e-3, bound 2e-2). bf16 q and
pools: the result is the fp32 one rounded to bf16 once (measured 0.95 of half a bf16 ulp; bound one ulp).
Each kernel case takes about 1 s here (tracing the interpreter); the whole file about 10 s."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from tpuserve.model.attention_tpu import (
    default_pages_per_compute_block,
    paged_decode_attention,
    reference_decode_attention,
)

P, HKV, PAGE, N = 24, 2, 16, 6  # pool pages, KV heads, tokens per page, pages per row in the table
LENGTHS = (90, 0, 1, 48)  # 6 pages ending inside the last; idle; 1 token; exactly 3 pages


def make_case(seed: int, groups: int, head_dim: int, dtype=jnp.float32, lengths=LENGTHS):
    """q [B, Hkv, G, D], k/v pools [Hkv, P, page, D] (page 0 zeros), lengths [B], table [B, N]: each row's pages
    drawn without repeats from a permutation of pages 1..P-1, unused entries 0."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((HKV, P, PAGE, head_dim)).astype(np.float32)
    v = rng.standard_normal((HKV, P, PAGE, head_dim)).astype(np.float32)
    k[:, 0] = v[:, 0] = 0.0
    q = rng.standard_normal((len(lengths), HKV, groups, head_dim)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, P)))
    table = np.zeros((len(lengths), N), np.int32)
    for b, length in enumerate(lengths):
        pages = -(-length // PAGE)
        table[b, :pages] = [free.pop() for _ in range(pages)]
    assert table.max() > 0 and not (np.diff(table[0]) == 1).all()  # scattered, not in pool order
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(lengths, jnp.int32),
        jnp.asarray(table),
    )


def numpy_attention(q, k_pages, v_pages, lengths, table) -> np.ndarray:
    """Row by row, query head by query head (h = kv_head * G + g), in float64; zeros for idle rows."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, kv_heads, groups, head_dim = q.shape
    out = np.zeros(q.shape)
    for b in range(batch):
        length = int(lengths[b])
        if not length:
            continue
        positions = np.arange(length)
        pages = np.asarray(table)[b, positions // PAGE]
        for h in range(kv_heads * groups):
            kv = h // groups
            keys = k_pages[kv, pages, positions % PAGE]  # [length, D]
            values = v_pages[kv, pages, positions % PAGE]
            logits = keys @ q[b, kv, h % groups] / math.sqrt(head_dim)
            weights = np.exp(logits - logits.max())
            out[b, kv, h % groups] = weights @ values / weights.sum()
    return out


def bf16_rounded(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("groups, head_dim", [(3, 64), (1, 128)])
def test_reference_matches_numpy(groups, head_dim):
    case = make_case(1, groups, head_dim)
    got = np.asarray(reference_decode_attention(*case))
    np.testing.assert_allclose(got, numpy_attention(*case), rtol=0, atol=2e-6)  # measured 1.7e-7
    assert not got[1].any()  # the idle row


# (G, D, pages_per_compute_block): several blocks per row (online softmax across blocks, the next row's first
# block prefetched past the idle row), one page per block, and the default (one block of all 6 pages); G = 8 is
# the kernel's other q layout (G a multiple of 8).
@pytest.mark.parametrize(
    "groups, head_dim, block",
    [(3, 64, 2), (1, 128, 1), (8, 128, None)],
    ids=["G3-D64-b2", "G1-D128-b1", "G8-D128"],
)
def test_kernel_fp32(groups, head_dim, block):
    q, k, v, lengths, table = make_case(2, groups, head_dim)
    got = np.asarray(
        paged_decode_attention(q, k, v, lengths, table, pages_per_compute_block=block, interpret=True)
    )
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    live = np.asarray(lengths) > 0
    same_arithmetic = np.asarray(
        reference_decode_attention(q, bf16_rounded(k), bf16_rounded(v), lengths, table)
    )
    np.testing.assert_allclose(got[live], same_arithmetic[live], rtol=0, atol=2e-6)
    exact = np.asarray(reference_decode_attention(q, k, v, lengths, table))
    np.testing.assert_allclose(got[live], exact[live], rtol=0, atol=2e-2)


def test_kernel_bf16():
    q, k, v, lengths, table = make_case(3, 3, 128, dtype=jnp.bfloat16)
    got = paged_decode_attention(q, k, v, lengths, table, pages_per_compute_block=2, interpret=True)
    assert got.dtype == jnp.bfloat16 and got.shape == q.shape
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    live = np.asarray(lengths) > 0
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = np.asarray(reference_decode_attention(*f32, lengths, table))[live]
    # one rounding to bf16 (8 significant bits): half an ulp is at most 2**-8 relative; one ulp allowed
    assert np.all(np.abs(got[live] - want) <= 2.0**-7 * np.abs(want) + 1e-6), np.abs(got[live] - want).max()


def test_block_must_divide_the_table():
    q, k, v, lengths, table = make_case(4, 1, 64)
    with pytest.raises(ValueError, match="must divide"):
        paged_decode_attention(q, k, v, lengths, table, pages_per_compute_block=4, interpret=True)


def test_default_block():
    assert default_pages_per_compute_block(6, 16) == 6
    assert default_pages_per_compute_block(64, 16) == 32  # 512 tokens
    assert default_pages_per_compute_block(48, 16) == 24
    assert default_pages_per_compute_block(7, 128) == 1  # 7 pages of 128: no divisor fits 512 but 1
    assert default_pages_per_compute_block(1, 1024) == 1

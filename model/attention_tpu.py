"""Paged decode attention: the TPU kernel path and the plain XLA path it is checked against.

On TPU the engine's decode attention reads the KV pool's pages in place with jax's own Pallas kernel
(`jax.experimental.pallas.ops.tpu.paged_attention`): per row and KV head it DMAs only the pages the row's page
table names, block by block, with an online softmax (EngineConfig.decode_attention; model/llama.py's
`paged_kernel_attention` calls it). The XLA path (`reference_decode_attention`) gathers every row's pages into a
contiguous [B, Hkv, n*page, D] copy first; that is what CPU uses (Pallas TPU kernels do not compile for XLA:CPU;
`interpret=True` runs the kernel in jax's TPU interpreter, for tests only: it is slow).

Layout (the kernel's own, so nothing is transposed on the way in: the engine's pool [Hkv, L, P, page, D] is
passed whole as [Hkv, L * P, page, D], a free reshape):
- k_pages, v_pages: [Hkv, P, page, D]. Page 0 is the null page (zeros, never written); unused table entries are 0.
- table: [B, n] int32, row b's logical page j is physical page table[b, j] (n static).
- q: [B, Hkv, G, D], one query token per row at position lengths[b] - 1; query head h = kv_head * G + g.
- lengths: [B] int32, tokens in the cache including the current one, at most n * page; 0 for an idle row.
- result: softmax over key positions 0 .. lengths[b] - 1 of q.k / sqrt(D), times v: [B, Hkv, G, D] in q's dtype.

What the kernel source (jax 0.10.2) accepts and does:
- Shapes: it checks only that k and v pages have one shape, that q's and the pages' head dims agree, that n is a
  multiple of pages_per_compute_block, and that lengths is int32 [B]. It checks no alignment, but on a real TPU
  its VMEM buffers are [2, pages_per_compute_block, page, D] and Mosaic tiles the last two dims (8, 128) for
  32-bit types ((16, 128) for bf16): jax's own kernel test covers page 16 / 32 / 64, D 128 / 256, fp32 / bf16
  and int8 pools, with blocks of 512 tokens. Treat D a multiple of 128 and page a multiple of 8 (16 for bf16) as
  the supported case; D = 64 runs in the interpreter but is unverified on hardware. (jax's repository marks its
  hardware test of this kernel skipped: "This kernel has data races that need to be fixed"; the interpreter's
  race detector finds none in the configurations of tests/model/test_paged_attention.py, megacore off.)
- Precision: every page is cast to bfloat16 after it is loaded, also from an fp32 pool, so fp32 pools give
  bf16-rounded K and V (logits and the weighted sum are fp32). q is not scaled by the kernel: it is scaled here.
- Rows of length 0: the kernel zeroes its output and visits no page, so an idle row's result is zeros.
- One query token per row only (decode; no multi-token chunks), no sliding window. The kernel's soft-capping,
  int8 `QuantizedTensor` pools and megacore modes (TPU v4 / v5p) are not used here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

BLOCK_TOKENS = 512  # the default compute block, in tokens (jax's kernel test uses 512-token blocks)


def default_pages_per_compute_block(n: int, page: int) -> int:
    """The largest divisor of n (the kernel requires one) whose block holds at most BLOCK_TOKENS tokens; 1 at
    least. Each block costs a DMA of its pages and a masked pass over all of them, so a row whose length ends
    early in a block still pays for the whole block."""
    best = 1
    for d in range(1, n + 1):
        if n % d == 0 and d * page <= BLOCK_TOKENS:
            best = d
    return best


def _check_shapes(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array):
    if q.ndim != 4 or k_pages.ndim != 4:
        raise ValueError(
            f"q must be [B, Hkv, G, D] and pages [Hkv, P, page, D]; got {q.shape}, {k_pages.shape}"
        )
    batch, kv_heads, _, head_dim = q.shape
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if k_pages.shape[0] != kv_heads or k_pages.shape[3] != head_dim:
        raise ValueError(f"pages {k_pages.shape} do not match q {q.shape} (Hkv and D)")
    if lengths.shape != (batch,) or table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(
            f"lengths {lengths.shape} / table {table.shape} do not match the batch of q ({batch})"
        )


@functools.partial(jax.jit, static_argnames=("pages_per_compute_block", "interpret"))
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    lengths: jax.Array,
    table: jax.Array,
    *,
    pages_per_compute_block: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over paged K/V with jax's Pallas TPU kernel: [B, Hkv, G, D] in q's dtype.

    pages_per_compute_block must divide n = table.shape[1] (default: `default_pages_per_compute_block`).
    interpret=True runs the kernel in jax's TPU interpreter (`pltpu.force_tpu_interpret_mode`), so it runs
    on CPU; it simulates the DMAs and raises on out-of-bounds reads."""
    _check_shapes(q, k_pages, v_pages, lengths, table)
    batch, kv_heads, groups, head_dim = q.shape
    n = table.shape[1]
    page = k_pages.shape[2]
    block = pages_per_compute_block or default_pages_per_compute_block(n, page)
    if n % block:
        raise ValueError(f"pages_per_compute_block={block} must divide the table's {n} pages per row")
    # The pages go in as they are: [Hkv, P, page, D] is the kernel's layout. Any other layout would need a
    # transpose here, a copy of every page (used or not) of K and V per layer per decode step: the kernel is a
    # custom call whose operands take the default row-major layout, so XLA cannot make it a free relayout.
    # The kernel does not scale the logits. q goes in as fp32: the kernel casts it to fp32 anyway, and when G is
    # a multiple of 8 it keeps its running output in q's dtype (otherwise fp32), so a bf16 q would round the
    # output at every compute block; fp32 q keeps that accumulation fp32 at the cost of B*H*D*4 bytes.
    q32 = (q.astype(jnp.float32) * (1.0 / math.sqrt(head_dim))).reshape(batch, kv_heads * groups, head_dim)
    call = functools.partial(paged_attention, pages_per_compute_block=block)
    args = (q32, k_pages, v_pages, lengths.astype(jnp.int32), table.astype(jnp.int32))
    if interpret:
        with pltpu.force_tpu_interpret_mode():  # read at trace time; part of the jit cache key
            out = call(*args)
    else:
        out = call(*args)
    return out.reshape(batch, kv_heads, groups, head_dim).astype(q.dtype)


@jax.jit
def reference_decode_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array, table: jax.Array
) -> jax.Array:
    """The same attention in plain XLA: gather each row's pages into [B, Hkv, n*page, D], mask positions
    >= lengths[b], softmax in fp32; [B, Hkv, G, D] in q's dtype. An idle row (length 0) gives zeros."""
    _check_shapes(q, k_pages, v_pages, lengths, table)
    batch, kv_heads, _, head_dim = q.shape
    tokens = table.shape[1] * k_pages.shape[2]

    def rows(pages: jax.Array) -> jax.Array:  # [Hkv, P, page, D] -> [B, Hkv, n*page, D]
        gathered = pages[:, table]  # [Hkv, B, n, page, D]
        return jnp.swapaxes(gathered, 0, 1).reshape(batch, kv_heads, tokens, head_dim).astype(jnp.float32)

    k, v = rows(k_pages), rows(v_pages)
    logits = jnp.einsum("bhgd,bhtd->bhgt", q.astype(jnp.float32), k) / math.sqrt(head_dim)
    live = jnp.arange(tokens)[None, :] < lengths[:, None]  # [B, T]
    logits = jnp.where(live[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bhgt,bhtd->bhgd", jax.nn.softmax(logits, axis=-1), v)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.astype(q.dtype)

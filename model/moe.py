"""Mixture-of-experts MLP (Qwen3-MoE): a router picks `num_experts_per_tok` of `num_experts` SwiGLU experts per
token, and the experts run as grouped matrix products (a loop over row tiles on CPU, library kernels on GPU and
TPU), never a Python loop over experts.

Parameters per layer (the module layout, `llama.module_params`; matrices [out, in] as everywhere in the model):
  w_router [E, H]; we_gate_up [E, 2, I, H] (each expert's gate rows, then its up rows); we_down [E, H, I]
(I = moe_intermediate_size). The stacked layout keeps each expert's matrices whole, so `quant` quantizes them per
output channel per expert and the sharding rules split the intermediate axis ("mlp") as they split a dense MLP's.

Routing (as transformers' Qwen3MoeTopKRouter): logits = h @ w_router.T, softmax over the experts in fp32, the top
k, divided by their sum when `norm_topk_prob`, cast to the activations' dtype.

Experts: the (token, expert) pairs are sorted by expert (stable), so each expert's rows are one contiguous group;
the rows are put back in pair order and each token sums its k results weighted by the router. The kernel
(`default_kernel`): on CPU "tiles" (`tiled_swiglu`): each expert's group padded to tiles of TILE_ROWS rows, a loop
over the non-empty tiles only, each tile's gate/up product, activation and down product on its expert's matrices
(a dynamic index into the stack); on GPU one `jax.lax.ragged_dot_general` for gate/up and one for down; on TPU the
Pallas kernel megablox `gmm` (`grouped_product`). XLA:CPU has no grouped kernel for ragged_dot: jax lowers it
there to one product over every expert with the other experts' rows masked, so it costs all experts' weights; the
tiles kernel costs the chosen experts' (bench/moe_layer.py; docs/engine.md has the figures).

Batch invariance: every operation is per row (a pair's product reads its own row and its expert's weights; the
sort and the tiling only move rows; every tile is the same [R, in] x [in, out] product), so a token's output does
not depend on the other tokens of the batch; tested bit for bit in tests/model/test_qwen3_moe.py (one token alone
and among 8 and 64; with the tiles kernel at every position of a tile, R 2, 4 and 8).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from tpuserve.model import quant

# contract the lhs' last axis with the weights' last ([E, out, in]); lhs rows are grouped, weights' axis 0 is the group
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,)
)


KERNELS = ("tiles", "ragged", "megablox")
TILE_ROWS = 8  # the "tiles" kernel's rows per tile (2 or more: `tiled_swiglu`)


def default_kernel() -> str:
    """ "megablox" on TPU (jax's Pallas grouped matmul), "tiles" on CPU (`tiled_swiglu`), "ragged"
    (`jax.lax.ragged_dot_general`) elsewhere (GPU)."""
    return {"tpu": "megablox", "cpu": "tiles"}.get(jax.default_backend(), "ragged")


def route(h: jax.Array, w_router: Any, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """h [N, H] -> (weights [N, k] in h's dtype, experts [N, k] int32), highest probability first."""
    logits = quant.linear(h, w_router, out_dtype=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(h.dtype), experts.astype(jnp.int32)


def _gmm(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """megablox gmm: x [m, K] rows grouped by `sizes`, w [E, N, K] -> fp32 [m, N]. Its row tile must divide m: the
    rows are padded (the padding belongs to no group and is dropped); K and N may be any size (ragged last tiles).
    Off TPU it runs in jax's TPU interpreter (tests)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = x.shape
    n = w.shape[1]
    tm = 128 if m >= 128 else max(16, -(-m // 16) * 16)  # bf16 packs 16 rows per sublane tile
    padded = -(-m // tm) * tm
    if padded != m:
        x = jnp.concatenate([x, jnp.zeros((padded - m, k), x.dtype)])
    y = gmm(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32, tiling=(tm, min(k, 512), min(n, 512)),
            transpose_rhs=True, interpret=jax.default_backend() != "tpu")  # fmt: skip
    return y[:m]


def grouped_product(
    x: jax.Array, w: Any, sizes: jax.Array, expert_of_row: jax.Array, kernel: str
) -> jax.Array:
    """x [m, in] (rows sorted by expert: `sizes` [E] rows each, `expert_of_row` [m] the expert of each row) times
    each row's expert's matrix of w [E, *out, in] (an array or a quantized matrix) -> [m, *out] in x's dtype, with
    fp32 accumulation. A per-channel int8 matrix is multiplied in its integer values and its scales applied to the
    output (as quant.linear does); other quantized matrices are dequantized first."""
    E, out, n = w.shape[0], w.shape[1:-1], w.shape[-1]
    scale = None
    if quant.is_quantized(w):
        if w.kind == quant.W8A8:
            raise ValueError("W8A8 experts are not supported (int8 weight-only experts are)")
        if w.offset is None and w.scale.shape[-1] == 1:  # per output channel: scale the product's output rows
            scale = w.scale.reshape(E, -1)[expert_of_row]  # [m, prod(out)]
            w = w.values().astype(x.dtype)
        else:
            w = w.dequantize(x.dtype)
    flat = w.reshape(E, -1, n).astype(x.dtype)
    if kernel == "megablox":
        y = _gmm(x, flat, sizes)
    elif kernel == "ragged":
        y = jax.lax.ragged_dot_general(x, flat, sizes, _RAGGED_DIMS, precision=quant.precision(x.dtype),
                                       preferred_element_type=jnp.float32)  # fmt: skip
    else:
        raise ValueError(f"grouped_product's kernel must be 'ragged' or 'megablox', got {kernel!r}")
    if scale is not None:
        y = y * scale
    return y.reshape(x.shape[0], *out).astype(x.dtype)


def _expert_product(rows: jax.Array, w: Any, e: jax.Array) -> jax.Array:
    """rows [R, in] times expert e's matrix of w [E, *out, in] (an array or a quantized matrix) -> fp32
    [R, prod(out)]: one [R, in] x [in, out] product of the expert's [out, in] matrix, read by a dynamic index into
    the stack (XLA copies that one expert's matrix, no other). Quantization as `grouped_product`: a per-channel
    int8 matrix is multiplied in its integer values and its scales applied to the output rows; other quantized
    matrices are dequantized (this expert's only)."""
    one = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), w)
    n = one.shape[-1]
    scale = None
    if quant.is_quantized(one):
        if one.kind == quant.W8A8:
            raise ValueError("W8A8 experts are not supported (int8 weight-only experts are)")
        if one.offset is None and one.scale.shape[-1] == 1:  # per output channel
            scale = one.scale.reshape(-1)
            one = one.values()
        else:
            one = one.dequantize(rows.dtype)
    y = jnp.einsum("ri,oi->ro", rows, one.reshape(-1, n).astype(rows.dtype), precision=quant.precision(rows.dtype),
                   preferred_element_type=jnp.float32)  # fmt: skip
    return y if scale is None else y * scale


def tiled_swiglu(x: jax.Array, token_of_row: jax.Array, expert_of_row: jax.Array, sizes: jax.Array,
                 we_gate_up: Any, we_down: Any, tile_rows: int | None = None) -> jax.Array:  # fmt: skip
    """The "tiles" kernel (XLA:CPU): the SwiGLU experts of the pairs sorted by expert (row i: token
    `token_of_row[i]` of x [N, H] through expert `expert_of_row[i]`; `sizes` [E] rows per expert) -> [P, H] in
    that order, computing only the experts that have rows.

    Each expert's group of rows is padded with zero rows to a multiple of R = `tile_rows` (TILE_ROWS), so every
    tile of R rows belongs to one expert; a loop with a dynamic trip count (the number of non-empty tiles, at most
    the static ceil-bound (P + min(E, P) * (R - 1)) // R) runs each tile through its expert's gate/up product, the
    activation and the down product (`_expert_product`), and the rows are read back in pair order. Every tile is
    the same program on the same shapes ([R, H] x [H, 2I], [R, I] x [I, H]) whatever the batch, its neighbours or
    its position, and a row of an [R, in] x [out, in].T product does not depend on the other rows (R >= 2:
    XLA:CPU's dot computes a row identically for any row count from 2), so a token's output is its own."""
    R = tile_rows or TILE_ROWS
    P, H = token_of_row.shape[0], x.shape[-1]
    E = sizes.shape[0]
    tiles = (sizes + R - 1) // R  # per expert
    tile_end = jnp.cumsum(tiles)
    tile_start, group_start = tile_end - tiles, jnp.cumsum(sizes) - sizes
    slot = tile_start[expert_of_row] * R + jnp.arange(P) - group_start[expert_of_row]  # row i's padded row
    T = (P + min(E, P) * (R - 1)) // R  # sum over the used experts of ceil(size / R), at most
    tile_expert = jnp.zeros((T,), jnp.int32).at[slot // R].set(expert_of_row.astype(jnp.int32))
    src = jnp.full((T * R,), x.shape[0], jnp.int32).at[slot].set(token_of_row.astype(jnp.int32))
    xp = jnp.concatenate([x, jnp.zeros((1, H), x.dtype)])[src]  # [T * R, H]; padding rows are zero

    def tile(t: jax.Array, out: jax.Array) -> jax.Array:
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice_in_dim(xp, t * R, R)
        gate_up = _expert_product(rows, we_gate_up, e).astype(x.dtype).reshape(R, 2, -1)
        act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        down = _expert_product(act, we_down, e).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, down, t * R, 0)

    out = jax.lax.fori_loop(0, tile_end[-1], tile, jnp.zeros((T * R, H), x.dtype))
    return out[slot]


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, we_gate_up: Any, we_down: Any,
                kernel: str, psum_axis: str | None = None) -> jax.Array:  # fmt: skip
    """x [N, H]; weights, experts [N, k] (`route`) -> [N, H]: sum over j of weights[:, j] * SwiGLU expert
    experts[:, j] of x. `psum_axis`: inside shard_map over the intermediate axis, the down products' partial sums
    are added across it."""
    if kernel not in KERNELS:
        raise ValueError(f"MoE kernel must be one of {KERNELS}, got {kernel!r}")
    N, k = experts.shape
    E = we_down.shape[0]
    pairs = experts.reshape(N * k)  # pair p = token p // k, its j = p % k choice
    order = jnp.argsort(pairs, stable=True)
    sorted_experts = pairs[order]
    sizes = jnp.bincount(pairs, length=E).astype(jnp.int32)
    if kernel == "tiles":
        down = tiled_swiglu(x, order // k, sorted_experts, sizes, we_gate_up, we_down)  # [N * k, H]
    else:
        xs = x[order // k]  # [N * k, H]
        gate_up = grouped_product(xs, we_gate_up, sizes, sorted_experts, kernel)  # [N * k, 2, I]
        act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        down = grouped_product(act, we_down, sizes, sorted_experts, kernel)  # [N * k, H]
    if psum_axis is not None:
        down = jax.lax.psum(down, psum_axis)
    back = jnp.zeros_like(down).at[order].set(down).reshape(N, k, -1)  # pair order again
    return jnp.sum(back * weights[..., None], axis=1)


def moe_mlp(h: jax.Array, w_router: Any, we_gate_up: Any, we_down: Any, top_k: int, norm_topk_prob: bool,
            mesh: Mesh | None = None, kernel: str | None = None) -> jax.Array:  # fmt: skip
    """h [..., H] -> [..., H]: the routed experts' weighted sum (the MoE layer's MLP, without the residual).

    With a mesh whose "model" axis divides the intermediate size (the sharding rules then split the experts' "mlp"
    axis over it), the experts run per device under `shard_map` on the device's slice of every expert, and the down
    products' partial sums are added across "model": XLA cannot partition a Pallas kernel by itself, and the same
    program then serves both kernels."""
    kernel = kernel or default_kernel()
    lead, H = h.shape[:-1], h.shape[-1]
    x = h.reshape(-1, H)
    weights, experts = route(x, w_router, top_k, norm_topk_prob)
    inter = we_down.shape[-1]
    split = mesh is not None and mesh.shape.get("model", 1) > 1 and inter % mesh.shape["model"] == 0
    if not split:
        return experts_mlp(x, weights, experts, we_gate_up, we_down, kernel).reshape(*lead, H)

    def spec(axis: int):  # the intermediate axis (from the end: quantized fields share it) over "model"
        return lambda a: PartitionSpec(*(["model" if i == a.ndim + axis else None for i in range(a.ndim)]))

    gu_spec = jax.tree.map(spec(-2), we_gate_up)  # [E, 2, I, H]
    down_spec = jax.tree.map(spec(-1), we_down)  # [E, H, I]; a quantized matrix's scales [E, H, 1] stay whole
    if quant.is_quantized(we_down):
        down_spec = we_down.map(lambda a: PartitionSpec() if a.shape[-1] == 1 else spec(-1)(a))
    whole = PartitionSpec()
    run = jax.shard_map(lambda x, w, e, gu, d: experts_mlp(x, w, e, gu, d, kernel, "model"), mesh=mesh,
                        in_specs=(whole, whole, whole, gu_spec, down_spec), out_specs=whole,
                        check_vma=False)  # fmt: skip
    return run(x, weights, experts, we_gate_up, we_down).reshape(*lead, H)


def mesh_of(w: Any) -> Mesh | None:
    """The mesh an expert weight is placed on (a NamedSharding's), or None."""
    leaf = w.q if quant.is_quantized(w) else w
    mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
    return mesh if isinstance(mesh, Mesh) and mesh.size > 1 else None

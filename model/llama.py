"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 3) as a Flax NNX module.

Canonical parameters (what the loaders produce and checkpoints store): the decoder blocks' weights stacked along
a leading layer axis; matrices [out, in], as PyTorch, GGUF and safetensors store them (`linear(x, w)` = x @ w.T):

  embed [V, H]; final_norm [H]; lm_head [V, H] (absent when tied to embed)
  stacked over layers L: attn_norm [L, H]; wq [L, Hq*D, H]; wk, wv [L, Hkv*D, H]; bq [L, Hq*D]; bk, bv [L, Hkv*D]
  (biases only with attention_bias); wo [L, H, Hq*D]; bo [L, H] (only with output_bias); q_norm, k_norm [L, D]
  (only with qk_norm: Qwen3's RMSNorm over each head's queries and keys, before RoPE); mlp_norm [L, H];
  attn_post_norm, mlp_post_norm [L, H] (only with sandwich_norms: Gemma's norms of the attention's and the MLP's
  outputs; Gemma's norm weights are w of its (1 + w), as transformers stores them);
  w_gate, w_up [L, I, H]; w_down [L, H, I]; or, with num_experts E (model/moe.py), instead of those three:
  w_router [L, E, H]; we_gate, we_up [L, E, Ie, H]; we_down [L, E, H, Ie]

Why [out, in]: XLA:CPU's dot kernel computes a row of `x @ w.T` with the same arithmetic whatever the number of
rows (2 or more; measured, and tested in tests/sampler/test_batch_invariance.py), while `x @ w` with w: [in, out]
rounds a row differently for another row count. So decode can run on the smallest batch bucket that covers the
live slots and a request's logprobs stay bit-identical alone or beside 63 others.

The module's own layout (`module_params`) differs from that canonical one, for speed on every backend:
- Q/K/V are one product per layer, `wqkv` [Hkv, (G+2)*D, H]: per KV head, its G query heads, its key and its
  value (so a mesh that splits KV heads splits it whole); gate/up are one, `w_gate_up` [2, I, H]. Four weight
  products per layer instead of seven (XLA:CPU's dot has a large cost per call at decode sizes).
- The layer loop is a `lax.scan` over stacked arrays (one compiled block), or, with `scan_layers=False`, unrolled
  over per-layer arrays: XLA:CPU copies the weight slice a scan body takes from a stacked array, so unrolled
  decodes ~20 % faster there, but compiles 3-6x longer (TPU/GPU read the slice in place).

KV cache: pages. `KVCache(k, v, table)`: k, v each [Hkv, L, P, page, D] (kv head, layer, page, position in the
page, head dim), one pool of P pages shared by every row, and `table` [B, pages] int32: row b's positions
j*page..(j+1)*page-1 live in page table[b, j]. Page 0 is the null page: never written (a write that would land in
it is dropped), so a table's unused entries read zeros. A token at position p of row b is written at
[:, layer, table[b, p // page], p % page]; a page holds a head's positions contiguously. Attention reads a row's
first `attend_len` positions (a static bucket >= the longest live sequence) in one of two ways (the call's
`decode_attention`): it gathers them into [B, Hkv, A, D] and computes what a contiguous cache would (XLA fuses the
gather into the reads; measured on XLA:CPU, a decode step's attention costs about what it did over a dense per-row
cache), or, for a decode step, jax's Pallas TPU kernel reads the pages in place (`paged_kernel_attention`). A
row's result does not depend on which pages hold it. Entries past a sequence's length are stale or zeros and are
masked by position (key position <= query position).

Why [Hkv, L, P, page, D]: the kernel reads [Hkv, pages, page, D], and this pool is that as it stands, all layers
at once: reshaped to [Hkv, L * P, page, D] (leading dimensions merged: no copy on any backend, TPU's tiled
layouts included, which tile only the last two dimensions) with layer l's page j at l * P + j. So no transpose
(a copy of the whole pool per layer per step, which would defeat paging) and no layer slice reach the kernel:
a static slice of a stacked [L, ...] pool (unrolled layers) is an operand of its own, which XLA materializes as a
copy of that layer's pool unless it aliases the slice in place (nothing promises that for a custom call's operand;
not checked on a TPU here; tpu-inference sidesteps it with a list of per-layer KV arrays), and a scanned layer
index makes it a dynamic slice, a copy. Here both layer modes hand the kernel the whole pool and a table offset.
The gather path pays nothing for the layout on XLA:CPU: the engine's decode program on the embedded model
(scanned layers, fp32, best of 10 calls, the layouts' calls interleaved) per step, this layout against the former
[L, P, Hkv, page, D]: 1 row x 128 positions 29.3 vs 29.3 ms, 1 x 1024: 47.6 vs 52.5 ms, 64 x 128: 151.7 vs
160.3 ms, 64 x 1024: 430.8 vs 555.8 ms ([L, Hkv, P, page, D] measured the same as this one). The KV-head axis
leads, so a mesh splits the pool over KV heads as before (CACHE_AXES).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from tpuserve.model import moe, quant
from tpuserve.model.attention_tpu import paged_decode_attention
from tpuserve.model.config import ModelConfig, rope_inv_freq
from tpuserve.model.quant import linear, take_rows

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo", "bo", "mlp_norm",
                "attn_post_norm", "mlp_post_norm",
                "w_gate", "w_up", "w_down", "w_router", "we_gate", "we_up", "we_down")  # fmt: skip

# Logical axes of each parameter: sharding rules map these names to mesh axes (tpuserve.model.sharding).
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("vocab", "embed"),
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "heads", "embed"),
    "wk": ("layers", "kv_heads", "embed"),
    "wv": ("layers", "kv_heads", "embed"),
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "q_norm": ("layers", None),  # [L, D]: over the head dimension, replicated
    "k_norm": ("layers", None),
    "wo": ("layers", "embed", "heads"),
    "bo": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "attn_post_norm": ("layers", "embed"),
    "mlp_post_norm": ("layers", "embed"),
    "w_gate": ("layers", "mlp", "embed"),
    "w_up": ("layers", "mlp", "embed"),
    "w_down": ("layers", "embed", "mlp"),
    # mixture of experts (model/moe.py): router [L, E, H]; experts [L, E, I, H] / [L, E, H, I], split like a dense MLP
    "w_router": ("layers", None, "embed"),
    "we_gate": ("layers", "experts", "mlp", "embed"),
    "we_up": ("layers", "experts", "mlp", "embed"),
    "we_down": ("layers", "experts", "embed", "mlp"),
}
CACHE_AXES = ("kv_heads", "layers", None, None, None)  # [Hkv, L, P, page, D]: pages are not rows

# The module's layer parameters and their logical axes, per layer (a stacked module puts "layers" in front).
BLOCK_AXES: dict[str, tuple[str | None, ...]] = {
    "attn_norm": ("embed",),
    "wqkv": ("kv_heads", None, "embed"),  # [Hkv, (G+2)*D, H]
    "bqkv": ("kv_heads", None),  # [Hkv, (G+2)*D]
    "q_norm": (None,),  # [D]
    "k_norm": (None,),
    "wo": ("embed", "heads"),
    "bo": ("embed",),
    "mlp_norm": ("embed",),
    "attn_post_norm": ("embed",),
    "mlp_post_norm": ("embed",),
    "w_gate_up": (None, "mlp", "embed"),  # [2, I, H]
    "w_down": ("embed", "mlp"),
    "w_router": (None, "embed"),  # [E, H]
    "we_gate_up": ("experts", None, "mlp", "embed"),  # [E, 2, I, H]
    "we_down": ("experts", "embed", "mlp"),  # [E, H, I]
}
TOP_PARAMS = ("embed", "final_norm", "lm_head")


class KVCache(NamedTuple):
    k: jax.Array  # [Hkv, L, P, page, D]
    v: jax.Array  # [Hkv, L, P, page, D]
    table: jax.Array  # [B, pages] int32: each row's pages in position order; 0 = none (the null page)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, H), "final_norm": (H,),
        "attn_norm": (L, H), "wq": (L, q, H), "wk": (L, kv, H), "wv": (L, kv, H), "wo": (L, H, q),
        "mlp_norm": (L, H), "w_gate": (L, I, H), "w_up": (L, I, H), "w_down": (L, H, I),
    }  # fmt: skip
    if cfg.attention_bias:
        shapes.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.output_bias:
        shapes["bo"] = (L, H)
    if cfg.qk_norm:
        shapes.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.sandwich_norms:
        shapes.update(attn_post_norm=(L, H), mlp_post_norm=(L, H))
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    if cfg.num_experts:  # experts instead of the dense MLP
        E, Ie = cfg.num_experts, cfg.moe_intermediate_size
        for name in ("w_gate", "w_up", "w_down"):
            del shapes[name]
        shapes.update(w_router=(L, E, H), we_gate=(L, E, Ie, H), we_up=(L, E, Ie, H), we_down=(L, E, H, Ie))
    return shapes


def module_params(cfg: ModelConfig, params: dict[str, jax.Array], scan_layers: bool) -> dict[str, Any]:
    """Canonical parameters (`param_shapes`) -> the module's layout: {top-level names..., "layers": a dict of
    stacked [L, ...] arrays (scan_layers) or a list of L dicts of per-layer arrays}, Q/K/V and gate/up fused.
    New arrays: the canonical ones are left as they are."""
    L, G, D = cfg.num_layers, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    Hkv = cfg.num_kv_heads

    def block(p: dict[str, Any]) -> dict[str, Any]:
        lead = p["wq"].shape[:-2]  # (L,) stacked, () per layer
        qkv = [quant.reshape_out(p["wq"], *lead, Hkv, G * D), quant.reshape_out(p["wk"], *lead, Hkv, D),
               quant.reshape_out(p["wv"], *lead, Hkv, D)]  # fmt: skip
        out = {
            "attn_norm": p["attn_norm"], "wo": p["wo"], "mlp_norm": p["mlp_norm"],
            "wqkv": quant.concat_out(qkv),  # quantized matrices: field by field (tpuserve.model.quant)
        }  # fmt: skip
        if cfg.num_experts:  # [E, 2, Ie, H]: each expert's gate rows, then its up rows
            out.update(w_router=p["w_router"], we_down=p["we_down"],
                       we_gate_up=quant.stack([p["we_gate"], p["we_up"]], axis=-3))  # fmt: skip
        else:
            out.update(w_down=p["w_down"], w_gate_up=quant.stack([p["w_gate"], p["w_up"]], axis=-3))
        if cfg.attention_bias:
            parts = [p["bq"].reshape(*lead, Hkv, G * D), p["bk"].reshape(*lead, Hkv, D),
                     p["bv"].reshape(*lead, Hkv, D)]  # fmt: skip
            out["bqkv"] = jnp.concatenate(parts, axis=-1)
        out.update({n: p[n] for n in ("q_norm", "k_norm", "bo", "attn_post_norm", "mlp_post_norm") if n in p})
        return out

    layer_names = [n for n in LAYER_PARAMS if n in params]
    out: dict[str, Any] = {n: params[n] for n in TOP_PARAMS if n in params}
    if scan_layers:
        out["layers"] = block({n: params[n] for n in layer_names})
    else:
        out["layers"] = [
            block({n: quant.map_fields(params[n], lambda a, i=i: a[i]) for n in layer_names})
            for i in range(L)
        ]
    return out


def pool_shape(cfg: ModelConfig, pages: int, page: int) -> tuple[int, ...]:
    """The shape of a pool's keys (and of its values): [Hkv, L, P, page, D] for P = `pages` pages of `page`."""
    return (cfg.num_kv_heads, cfg.num_layers, pages, page, cfg.head_dim)


def pool_pages(pool: jax.Array) -> int:
    """The number of pages of a pool's keys or values (the null page included)."""
    return pool.shape[2]


def take_pages(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """Every head's and layer's keys (or values) of `pages` [n] (or one page): [Hkv, L, n, page, D]."""
    return pool[:, :, pages]


def put_pages(pool: jax.Array, pages: jax.Array, values: jax.Array) -> jax.Array:
    """`values` (as `take_pages` gives them) written at `pages`; a page past the pool is skipped."""
    return pool.at[:, :, pages].set(values, mode="drop")


def write_tokens(pool: jax.Array, li: Any, where: jax.Array, offset: jax.Array, new: jax.Array) -> jax.Array:
    """new [B, T, Hkv, D] written into layer li at page where[b, t], position offset[b, t] (a page past the
    pool drops the write)."""
    return pool.at[:, li, where, offset].set(new.transpose(2, 0, 1, 3).astype(pool.dtype), mode="drop")


def init_pages(
    cfg: ModelConfig, pages: int, page: int, dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """A pool of `pages` pages (page 0, the null page, included), zeros: (k, v)."""
    shape = pool_shape(cfg, pages, page)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32, page: int = 16
) -> KVCache:
    """A cache of `batch` rows of `max_len` positions, each row on pages of its own in order (a contiguous cache
    on pages: what a test or a one-off forward needs)."""
    per_row = -(-max_len // page)
    k, v = init_pages(cfg, 1 + batch * per_row, page, dtype)
    table = 1 + jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    return KVCache(k, v, table)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> int:
    """Bytes of keys and values for `batch` x `max_len` positions."""
    return 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def gather_pages(pages: jax.Array, li: Any, table: jax.Array, attend_len: int) -> jax.Array:
    """Layer li's first `attend_len` positions of each row, [B, Hkv, A, D], from a pool [Hkv, L, P, page, D]
    through table [B, >= A / page] (one gather from the whole pool: a scan's layer index never copies a layer)."""
    B, page, D = table.shape[0], pages.shape[3], pages.shape[4]
    n = -(-attend_len // page)
    got = pages[:, li, table[:, :n]].transpose(1, 0, 2, 3, 4)  # [Hkv, B, n, page, D] -> [B, Hkv, n, page, D]
    return got.reshape(B, pages.shape[0], n * page, D)[:, :, :attend_len]


def paged_kernel_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, li: Any, table: jax.Array,
                           lengths: jax.Array, attend_len: int, mesh: Mesh | None = None) -> jax.Array:  # fmt: skip
    """One decode step's attention in layer li with jax's Pallas TPU kernel (model/attention_tpu.py), reading the
    pool's pages in place: q [B, Hkv, G, D], table [B, >= attend_len / page], lengths [B] (keys 0..lengths-1, at
    most attend_len) -> [B, Hkv, G, D]. The pool [Hkv, L, P, page, D] is seen as [Hkv, L * P, page, D] (a
    reshape of leading dimensions: no copy, whatever the layer index) with layer li's page j at li * P + j, so
    neither a stacked pool's layer slice nor a transpose reaches the kernel. Off TPU it runs in jax's TPU
    interpreter (slow: tests only). K and V are cast to bf16 inside the kernel (attention_tpu's docstring).

    With a mesh the kernel runs per device under `shard_map` on the device's own KV heads (CACHE_AXES: the pool
    is split over "model" where that divides the KV heads, else whole on every device): XLA cannot partition a
    Pallas kernel by itself."""
    Hkv, L, P, page, D = k_pool.shape
    n = -(-attend_len // page)
    pages = (table[:, :n] + li * P).astype(jnp.int32)
    interpret = jax.default_backend() != "tpu"

    def attend(q, k_pool, v_pool, lengths, pages):
        heads = k_pool.shape[0]
        k, v = (x.reshape(heads, L * P, page, D) for x in (k_pool, v_pool))
        return paged_decode_attention(q, k, v, lengths, pages, interpret=interpret)

    if mesh is None or mesh.size == 1:
        return attend(q, k_pool, v_pool, lengths, pages)
    split = "model" if "model" in mesh.shape and Hkv % mesh.shape["model"] == 0 else None
    heads, pool_spec, whole = PartitionSpec(None, split), PartitionSpec(split), PartitionSpec()
    return jax.shard_map(attend, mesh=mesh, in_specs=(heads, pool_spec, pool_spec, whole, whole), out_specs=heads,
                         check_vma=False)(q, k_pool, v_pool, lengths, pages)  # fmt: skip


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def unit_offset_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm (transformers' Gemma3RMSNorm): x normalized and scaled by (1 + w), all in fp32, then cast."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention as in transformers. x: [B, T, heads, D]; positions: [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def decode_scores_by_reduce(T: int) -> bool:
    """Whether attention computes a decode step's scores (T = 1 query per row) as a multiply and a sum over the
    head dimension instead of a batched dot, and leaves T out of the product with the values: on XLA:CPU only,
    where XLA's own batched dot over [B * Hkv] tiny matrices (3 query heads x 64 dims) is slow: the reduce makes
    a 64-row decode step of the embedded model about 9 % faster and leaves a 1-row one as it is. A row's scores
    still depend on that row only (batch invariance holds; tested). TPU/GPU keep the dots (their matrix units)."""
    return T == 1 and jax.default_backend() == "cpu"


class Block(nnx.Module):
    """One decoder layer's parameters (BLOCK_AXES), or all layers' stacked along a leading axis."""

    def __init__(self, params: dict[str, jax.Array]):
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))

    def arrays(self) -> dict[str, Any]:
        """Arrays, or QuantizedMatrix pytrees for weights kept quantized."""
        return {n: getattr(self, n).get_value() for n in BLOCK_AXES if hasattr(self, n)}


class Llama(nnx.Module):
    """Decoder over parameters in the module layout (`module_params`): a stacked `Block` run under `lax.scan`,
    or a list of per-layer `Block`s run one after another."""

    def __init__(self, cfg: ModelConfig, params: dict[str, Any]):
        self.cfg = cfg
        expected = param_shapes(cfg)
        for name in TOP_PARAMS:
            if name not in expected:
                continue
            if name not in params:
                raise ValueError(f"missing parameter: {name}")
            if tuple(params[name].shape) != expected[name]:
                raise ValueError(
                    f"parameter {name}: shape {tuple(params[name].shape)}, expected {expected[name]}"
                )
            setattr(self, name, nnx.Param(params[name]))
        layers = params["layers"]
        if isinstance(layers, dict):
            self.layers = Block(layers)
        else:
            if len(layers) != cfg.num_layers:
                raise ValueError(f"{len(layers)} layers, expected {cfg.num_layers}")
            self.layers = nnx.List([Block(p) for p in layers])
        # the mesh the experts are split over (static): they run per device under shard_map (moe.moe_mlp)
        self.expert_mesh = moe.mesh_of((layers if isinstance(layers, dict) else layers[0])["we_down"]) if (
            cfg.num_experts) else None  # fmt: skip
        self.inv_freq = nnx.Variable(jnp.asarray(np.array(rope_inv_freq(cfg), np.float32)))

    @property
    def dtype(self) -> jnp.dtype:
        """The activations' dtype (the float weights', or what quantized ones dequantize to)."""
        return jnp.dtype(self.embed.get_value().dtype)

    @property
    def scan_layers(self) -> bool:
        return isinstance(self.layers, Block)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        attend_len: int,
        live_rows: int | None = None,
        write: jax.Array | None = None,
        decode_attention: str = "gather",
        mesh: Mesh | None = None,
        query_rows: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """tokens, positions: [B, T] int32 (contiguous positions per row) for the cache's table rows 0..B-1 (the
        table may hold more rows: decode runs on the smallest batch bucket that covers the live slots).

        Writes the T new keys/values at their positions (only where `write` [B, T] is set, if given; never into
        the null page nor past the table), attends over the first `attend_len` (static, a multiple of the page
        size in serving) positions, and returns the final hidden states [B, T, H] (apply `logits` where needed) and the cache.
        `live_rows` (static): only rows 0..live_rows-1 matter; the weight products skip the others (zeros), while
        every other operation still sees B rows (see sampler.programs.decode_program: XLA:CPU rounds the norms,
        rotary embedding and softmax of fewer than 8 rows differently, its products do not).
        `decode_attention` (static): "pallas" runs a decode step's attention (T = 1) with jax's Pallas TPU kernel
        over the pool in place (`paged_kernel_attention`; in jax's TPU interpreter off TPU: slow, for tests);
        "gather" (and every T > 1, and a model with a sliding window or a query scale other than 1/sqrt(D), which
        the kernel lacks) gathers pages. On the kernel path a row whose `write` is off attends to nothing (its
        hidden state is not the gather path's: decode discards such rows' outputs). `mesh` (static): the mesh the
        pool is placed on, for the kernel. `query_rows` (static): T > 1 positions attend as B * T rows of one
        position each, as a decode step's rows do (`gathered_attention`; EngineConfig.rescore_exact).
        """
        cfg = self.cfg
        B, T = tokens.shape
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = Hq // Hkv
        x = take_rows(self.embed.get_value(), tokens)
        if cfg.scale_embeddings:  # Gemma: sqrt(H) as transformers holds it (an fp32 scalar), in x's dtype
            x = x * jnp.asarray(np.float32(cfg.hidden_size**0.5), x.dtype)
        inv_freq = self.inv_freq[...]
        norm = unit_offset_rms_norm if cfg.norm_unit_offset else rms_norm
        gelu_tanh = partial(jax.nn.gelu, approximate=True)  # transformers' gelu_pytorch_tanh
        activation = jax.nn.silu if cfg.hidden_activation == "silu" else gelu_tanh
        # Gemma 3: a layer is local or global by its index, which is scanned data (a traced li under the scan), so
        # the choice of window and RoPE base is a select, never a Python branch
        local = local_inv_freq = None
        if cfg.sliding_layers:
            local = jnp.asarray(cfg.sliding_layers)
            local_inv_freq = jnp.asarray(np.array(rope_inv_freq(cfg, local=True), np.float32))
        scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else 1.0 / np.sqrt(D)
        P, page = pool_pages(cache.k), cache.k.shape[3]
        table = cache.table
        slot = jnp.clip(positions // page, 0, table.shape[1] - 1)
        where = jnp.take_along_axis(table[:B], slot, axis=1)  # [B, T]: each new token's page
        ok = (where != 0) & (positions >= 0) & (positions < table.shape[1] * page)
        if write is not None:
            ok &= write
        where = jnp.where(ok, where, P)  # out of range: the write is dropped
        offset = positions % page
        key_pos = jnp.arange(attend_len)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, A]
        # and no further back than the window: every layer (Mistral) or local ones (Gemma 3). The pool still holds
        # every position: no page is freed when it falls out of every window.
        local_mask = None
        if cfg.sliding_window and local is not None:
            local_mask = mask & (key_pos[None, None, :] > positions[:, :, None] - cfg.sliding_window)
        elif cfg.sliding_window:
            mask &= key_pos[None, None, :] > positions[:, :, None] - cfg.sliding_window

        def layer_mask(li: Any) -> jax.Array:
            return mask if local_mask is None else jnp.where(local[li], local_mask, mask)

        reduce_scores = decode_scores_by_reduce(T)
        # Prompt chunks (T > 1) keep the gather: jax's mixed prefill/decode kernel (ragged paged attention) does not
        # run in this jax's TPU interpreter, so it could not be tested here.
        use_kernel = (decode_attention == "pallas" and T == 1 and not cfg.sliding_window
                      and cfg.query_pre_attn_scalar in (None, D))  # the kernel scales by 1/sqrt(D)  # fmt: skip
        if decode_attention not in ("gather", "pallas"):
            raise ValueError(f"decode_attention must be 'gather' or 'pallas', got {decode_attention!r}")
        lengths = jnp.clip(positions[:, 0] + 1, 0, attend_len)  # the kernel's keys: positions <= the query's
        if write is not None:  # a row that writes nothing (an idle decode row) attends to nothing: skipped
            lengths = jnp.where(write[:, 0], lengths, 0)

        def product(a: jax.Array, w: Any) -> jax.Array:
            return linear(a, w, rows=live_rows)

        def gathered_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, li: Any) -> jax.Array:
            """q [B, T, Hq, D] over the first attend_len positions gathered from the pool -> [B, T, Hq * D].

            Under `query_rows`, T > 1 positions attend as B * T rows of one position each, through the very
            operations a decode step's rows take: XLA:CPU fuses and reduces a chunk's [B, Hkv, G, T, A] scores
            differently from a decode step's [B, Hkv, G, 1, A] (logprobs up to ~4e-5 apart, with either score
            formula on both), while a row of one position computes the same whatever the number of rows beside it.
            Each row gathers its own keys and values: slower prefill, more so the longer the attended length."""
            if query_rows and T > 1:
                rows = jnp.repeat(table[:B], T, axis=0)  # [B * T, pages]: each position its row's pages
                out = attend_rows(q.reshape(B * T, 1, Hq, D), k_cache, v_cache, li, rows,
                                  layer_mask(li).reshape(B * T, 1, attend_len), decode_scores_by_reduce(1))  # fmt: skip
                return out.reshape(B, T, Hq * D)
            return attend_rows(q, k_cache, v_cache, li, table[:B], layer_mask(li), reduce_scores)

        def attend_rows(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, li: Any, rows_table: jax.Array,
                        mask: jax.Array, reduce_scores: bool) -> jax.Array:  # fmt: skip
            """q [B, T, Hq, D] of the rows of rows_table [B, pages], mask [B, T, A] -> [B, T, Hq * D]."""
            B, T = q.shape[:2]
            keys = gather_pages(k_cache, li, rows_table, attend_len)  # [B, Hkv, A, D]
            vals = gather_pages(v_cache, li, rows_table, attend_len)
            qg = q.reshape(B, T, Hkv, G, D)
            if reduce_scores:  # [B, Hkv, G, 1, D] x [B, Hkv, 1, A, D] summed over D -> [B, Hkv, G, T=1, A]
                qk = qg[:, 0, :, :, None, :].astype(jnp.float32) * keys[:, :, None].astype(jnp.float32)
                scores = jnp.sum(qk, axis=-1)[:, :, :, None]
            else:
                # queries as [B, Hkv, G, T, D] going in: XLA:CPU then makes them the rows of its product (q x keys^T),
                # and a row's arithmetic does not depend on how many rows there are, so a chunk of 16 or 32 positions
                # computes them as one of 64 does. Given as [B, T, ...], they were the columns (keys x q^T), rounded
                # by the column count: only chunks of 64 or more agreed.
                scores = jnp.einsum("bkgtd,bkad->bkgta", qg.transpose(0, 2, 3, 1, 4), keys.astype(q.dtype),
                                    preferred_element_type=jnp.float32, precision=quant.precision(q.dtype))  # fmt: skip
            scores = scores * scale
            scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
            if reduce_scores:  # T = 1 left out of the product: [B, Hkv, G, A] x [B, Hkv, A, D]
                attn = jnp.einsum("bkga,bkad->bkgd", probs[:, :, :, 0], vals.astype(q.dtype),
                                  precision=quant.precision(q.dtype))  # fmt: skip
            else:
                # the product's own layout [B, Hkv, G, T, D], transposed after: written as "...->btkgd", XLA:CPU's
                # (YNNPACK's) batched dot rounds a prompt's rows differently for another B (AVX-512, measured)
                attn = jnp.einsum(
                    "bkgta,bkad->bkgtd", probs, vals.astype(q.dtype), precision=quant.precision(q.dtype)
                ).transpose(0, 3, 1, 2, 4)
            return attn.reshape(B, T, Hq * D)

        def block(x, k_cache, v_cache, li, p):
            h = norm(x, p["attn_norm"], cfg.rms_norm_eps)
            qkv = product(h, p["wqkv"])  # [B, T, Hkv, (G+2)*D]
            if cfg.attention_bias:
                qkv = qkv + p["bqkv"]
            qkv = qkv.reshape(B, T, Hkv, G + 2, D)
            q, k, v = qkv[:, :, :, :G].reshape(B, T, Hq, D), qkv[:, :, :, G], qkv[:, :, :, G + 1]
            if cfg.qk_norm:  # Qwen3: each head's queries and keys normalized over D, before RoPE
                q = norm(q, p["q_norm"], cfg.rms_norm_eps)
                k = norm(k, p["k_norm"], cfg.rms_norm_eps)
            freq = inv_freq if local is None else jnp.where(local[li], local_inv_freq, inv_freq)
            q, k = rope(q, positions, freq), rope(k, positions, freq)
            k_cache = write_tokens(k_cache, li, where, offset, k)  # [B, T, Hkv, D] at their pages and offsets
            v_cache = write_tokens(v_cache, li, where, offset, v)
            if use_kernel:  # q [B, Hkv, G, D] (query head h = kv head * G + g) -> [B, 1, Hq * D]
                attn = paged_kernel_attention(q.reshape(B, Hkv, G, D), k_cache, v_cache, li, table[:B], lengths,
                                              attend_len, mesh).reshape(B, T, Hq * D)  # fmt: skip
            else:
                attn = gathered_attention(q, k_cache, v_cache, li)
            out = product(attn, p["wo"])
            out = out + p["bo"] if cfg.output_bias else out
            x = x + (norm(out, p["attn_post_norm"], cfg.rms_norm_eps) if cfg.sandwich_norms else out)
            h = norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            if cfg.num_experts:  # routed experts (model/moe.py) on every row: each row's result is its own
                x = x + moe.moe_mlp(h, p["w_router"], p["we_gate_up"], p["we_down"], cfg.num_experts_per_tok,
                                    cfg.norm_topk_prob, self.expert_mesh)  # fmt: skip
            else:
                gate_up = product(h, p["w_gate_up"])  # [B, T, 2, I]
                y = product(activation(gate_up[..., 0, :]) * gate_up[..., 1, :], p["w_down"])
                x = x + (norm(y, p["mlp_post_norm"], cfg.rms_norm_eps) if cfg.sandwich_norms else y)
            return x, k_cache, v_cache

        k_cache, v_cache = cache.k, cache.v
        if self.scan_layers:

            def step(carry, p):
                x, k_cache, v_cache, li = carry
                return (*block(x, k_cache, v_cache, li, p), li + 1), None

            (x, k_cache, v_cache, _), _ = jax.lax.scan(step, (x, k_cache, v_cache, jnp.int32(0)),
                                                       self.layers.arrays())  # fmt: skip
        else:
            for li, layer in enumerate(self.layers):
                x, k_cache, v_cache = block(x, k_cache, v_cache, li, layer.arrays())
        x = norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return x, KVCache(k_cache, v_cache, table)

    def logits(self, hidden: jax.Array, live_rows: int | None = None) -> jax.Array:
        """hidden: [..., H] -> fp32 logits [..., V]; under `live_rows` (static) only hidden[:live_rows] matters, the
        other rows' logits are zeros (quant.linear's `rows`)."""
        w = (self.embed if self.cfg.tie_word_embeddings else self.lm_head).get_value()
        logits = linear(hidden, w, out_dtype=jnp.float32, rows=live_rows)
        if cap := self.cfg.final_logit_softcapping:  # Gemma: tanh soft-capping
            logits = cap * jnp.tanh(logits / cap)
        return logits

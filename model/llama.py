"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) as a Flax NNX module.

Weights of the decoder blocks are stacked along a leading layer axis and the blocks run under `lax.scan`, so a
30-layer model compiles one block. Parameter names and layouts: matrices are [out, in], as PyTorch, GGUF and
safetensors store them (`linear(x, w)` = x @ w.T):

  embed [V, H]; final_norm [H]; lm_head [V, H] (absent when tied to embed)
  stacked over layers L: attn_norm [L, H]; wq [L, Hq*D, H]; wk, wv [L, Hkv*D, H]; bq [L, Hq*D]; bk, bv [L, Hkv*D]
  (biases only with attention_bias); wo [L, H, Hq*D]; mlp_norm [L, H]; w_gate, w_up [L, I, H]; w_down [L, H, I]

Why [out, in]: XLA:CPU's dot kernel computes a row of `x @ w.T` with the same arithmetic whatever the number of
rows (2 or more; measured, and tested in tests/sampler/test_batch_invariance.py), while `x @ w` with w: [in, out]
rounds a row differently for another row count. So decode can run on the smallest batch bucket that covers the
live slots and a request's logprobs stay bit-identical alone or beside 63 others.

KV cache: `KVCache(k, v)`, each [L, B, S, Hkv, D]: layer, batch slot, position, kv head, head dim. A token at
position p of slot b is written at [:, b, p]. Attention reads only the first `attend_len` positions (a static
bucket >= the longest live sequence), so a long capacity S costs nothing until it is used. Entries past a
sequence's length are stale or garbage and are masked by position (key position <= query position).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tpuserve.model.config import ModelConfig, rope_inv_freq

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")

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
    "wo": ("layers", "embed", "heads"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "mlp", "embed"),
    "w_up": ("layers", "mlp", "embed"),
    "w_down": ("layers", "embed", "mlp"),
}
CACHE_AXES = ("layers", "batch", "sequence", "kv_heads", None)


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, Hkv, D]
    v: jax.Array  # [L, B, S, Hkv, D]


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
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    return shapes


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> int:
    return 2 * cfg.num_layers * batch * max_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x: [..., in], w: [out, in] -> [..., out] (fp32 accumulation)."""
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention as in transformers. x: [B, T, heads, D]; positions: [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


class Llama(nnx.Module):
    """Decoder with stacked block weights. `params` maps the names above to arrays of `param_shapes(cfg)`."""

    def __init__(self, cfg: ModelConfig, params: dict[str, jax.Array]):
        self.cfg = cfg
        expected = param_shapes(cfg)
        missing = sorted(set(expected) - set(params))
        if missing:
            raise ValueError(f"missing parameters: {', '.join(missing)}")
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(params[name].shape)}, expected {shape}")
            setattr(self, name, nnx.Param(params[name]))
        self.inv_freq = nnx.Variable(jnp.asarray(np.array(rope_inv_freq(cfg), np.float32)))

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache, attend_len: int
    ) -> tuple[jax.Array, KVCache]:
        """tokens, positions: [B, T] int32 (contiguous positions per row) for cache rows 0..B-1 (the cache may
        hold more rows: decode runs on the smallest batch bucket that covers the live slots).

        Writes the T new keys/values at their positions, attends over the first `attend_len` (static) cached
        positions, and returns the final hidden states [B, T, H] (apply `logits` where needed) and the cache.
        """
        cfg = self.cfg
        B, T = tokens.shape
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = jnp.take(self.embed.value, tokens, axis=0)
        inv_freq = self.inv_freq.value
        rows = jnp.arange(B)[:, None]
        key_pos = jnp.arange(attend_len)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, A]
        if cfg.sliding_window:  # and no further back than the window (the cache still holds every position)
            mask &= key_pos[None, None, :] > positions[:, :, None] - cfg.sliding_window
        layer_params = {n: getattr(self, n).value for n in LAYER_PARAMS if hasattr(self, n)}

        def block(carry, p):
            x, k_cache, v_cache, li = carry
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = linear(h, p["wq"]), linear(h, p["wk"]), linear(h, p["wv"])
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = rope(q.reshape(B, T, Hq, D), positions, inv_freq)
            k = rope(k.reshape(B, T, Hkv, D), positions, inv_freq)
            v = v.reshape(B, T, Hkv, D)
            k_cache = k_cache.at[li, rows, positions].set(k.astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[li, rows, positions].set(v.astype(v_cache.dtype), mode="drop")
            keys = k_cache[li][
                :B, :attend_len
            ]  # [B, A, Hkv, D]: the first B rows (a batch bucket) of the cache
            vals = v_cache[li][:B, :attend_len]
            qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
            scores = jnp.einsum(
                "btkgd,bakd->bkgta", qg, keys.astype(q.dtype), preferred_element_type=jnp.float32
            )
            scores = scores * (1.0 / np.sqrt(D))
            scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
            probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
            attn = jnp.einsum("bkgta,bakd->btkgd", probs, vals.astype(q.dtype)).reshape(B, T, Hq * D)
            x = x + linear(attn, p["wo"])
            h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            x = x + linear(jax.nn.silu(linear(h, p["w_gate"])) * linear(h, p["w_up"]), p["w_down"])
            return (x, k_cache, v_cache, li + 1), None

        (x, k_cache, v_cache, _), _ = jax.lax.scan(block, (x, cache.k, cache.v, jnp.int32(0)), layer_params)
        x = rms_norm(x, self.final_norm.value, cfg.rms_norm_eps)
        return x, KVCache(k_cache, v_cache)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [..., H] -> fp32 logits [..., V]."""
        w = self.embed.value if self.cfg.tie_word_embeddings else self.lm_head.value
        return jnp.einsum("...h,vh->...v", hidden, w, preferred_element_type=jnp.float32)

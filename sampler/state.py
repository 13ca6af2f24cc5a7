"""Device-side decode state: one typed pytree, donated to every decode/insert call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from tpuserve.model.config import ModelConfig
from tpuserve.model.llama import KVCache, init_cache

MAX_STOP_IDS = 8


@struct.dataclass
class DecodeState:
    cache: KVCache           # [L, B, S, Hkv, D] each
    lengths: jax.Array       # i32[B]: tokens in the cache = position the next fed token takes
    last: jax.Array          # i32[B]: last sampled token, fed to the next step
    active: jax.Array        # bool[B]: slot generating
    generated: jax.Array     # i32[B]: tokens sampled so far
    max_tokens: jax.Array    # i32[B]
    stop_ids: jax.Array      # i32[B, MAX_STOP_IDS], -1 padded
    temperature: jax.Array   # f32[B]
    top_p: jax.Array         # f32[B]
    top_k: jax.Array         # i32[B]
    min_p: jax.Array         # f32[B]
    keys: jax.Array          # u32[B, 2]: raw PRNG key of each slot's seed


def init_decode_state(cfg: ModelConfig, slots: int, max_seq_len: int, dtype=jnp.float32) -> DecodeState:
    B = slots
    return DecodeState(
        cache=init_cache(cfg, B, max_seq_len, dtype),
        lengths=jnp.zeros(B, jnp.int32),
        last=jnp.zeros(B, jnp.int32),
        active=jnp.zeros(B, bool),
        generated=jnp.zeros(B, jnp.int32),
        max_tokens=jnp.zeros(B, jnp.int32),
        stop_ids=jnp.full((B, MAX_STOP_IDS), -1, jnp.int32),
        temperature=jnp.zeros(B, jnp.float32),
        top_p=jnp.ones(B, jnp.float32),
        top_k=jnp.zeros(B, jnp.int32),
        min_p=jnp.zeros(B, jnp.float32),
        keys=jnp.zeros((B, 2), jnp.uint32),
    )

"""Device-side decode state: one typed pytree of per-slot arrays, donated to every decode/insert call.

`SlotSampling` holds the per-slot sampling and stopping parameters as arrays (traced, never static), so a
request's temperature or seed never recompiles anything. The same struct describes one slot (scalars, made on
the host by `slot_sampling`) and all B slots (a leading [B] axis, inside `DecodeState`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from tpuserve.sampler.api import SlotParams

MAX_STOP_IDS = 8
SEED_RANGE = 2**64  # seeds are unsigned 64-bit (the proto's uint64); every bit reaches the PRNG key


@struct.dataclass
class SlotSampling:
    temperature: jax.Array  # f32[...]: 0 = greedy
    top_p: jax.Array  # f32[...]
    top_k: jax.Array  # i32[...]: 0 = off
    min_p: jax.Array  # f32[...]
    keys: jax.Array  # u32[..., 2]: raw threefry key of the seed (high 32 bits, low 32 bits)
    max_tokens: jax.Array  # i32[...]
    stop_ids: jax.Array  # i32[..., MAX_STOP_IDS], -1 padded


def seed_key(seed: int) -> np.ndarray:
    """The raw PRNG key of a 64-bit seed: [high 32 bits, low 32 bits] (jax.random.PRNGKey's layout, which with
    32-bit JAX integers keeps only the low 32 bits of a larger seed)."""
    if not 0 <= seed < SEED_RANGE:
        raise ValueError(f"seed {seed} is outside 0..2**64-1")
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def slot_sampling(params: SlotParams) -> SlotSampling:
    """One slot's parameters as host arrays (scalars), ready to be put on the device by `insert`."""
    if len(params.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(params.stop_ids)}")
    stop = np.full(MAX_STOP_IDS, -1, np.int32)
    stop[: len(params.stop_ids)] = params.stop_ids
    return SlotSampling(
        temperature=np.float32(params.temperature),
        top_p=np.float32(params.top_p),
        top_k=np.int32(params.top_k),
        min_p=np.float32(params.min_p),
        keys=seed_key(params.seed),
        max_tokens=np.int32(params.max_tokens),
        stop_ids=stop,
    )


def init_slot_sampling(slots: int) -> SlotSampling:
    B = slots
    return SlotSampling(
        temperature=jnp.zeros(B, jnp.float32),
        top_p=jnp.ones(B, jnp.float32),
        top_k=jnp.zeros(B, jnp.int32),
        min_p=jnp.zeros(B, jnp.float32),
        keys=jnp.zeros((B, 2), jnp.uint32),
        max_tokens=jnp.zeros(B, jnp.int32),
        stop_ids=jnp.full((B, MAX_STOP_IDS), -1, jnp.int32),
    )


@struct.dataclass
class DecodeState:
    """Per-slot decode state (the keys and values live in the pool of pages, beside it)."""

    lengths: jax.Array  # i32[B]: tokens in the cache = position the next fed token takes
    last: jax.Array  # i32[B]: last sampled token, fed to the next step
    active: jax.Array  # bool[B]: slot generating
    generated: jax.Array  # i32[B]: tokens sampled so far
    sampling: SlotSampling  # [B] per-slot parameters


def init_decode_state(slots: int) -> DecodeState:
    B = slots
    return DecodeState(
        lengths=jnp.zeros(B, jnp.int32),
        last=jnp.zeros(B, jnp.int32),
        active=jnp.zeros(B, bool),
        generated=jnp.zeros(B, jnp.int32),
        sampling=init_slot_sampling(B),
    )

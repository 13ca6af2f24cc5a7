"""The jitted programs of the engine, as plain functions over the split NNX state (never `nnx.jit`, which walks
the object graph in Python on every call). Shapes are static per program: prefill per prompt bucket Lp,
decode per attended-length bucket A; everything else (per-slot parameters, lengths, slot index) is traced."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tpuserve.model.llama import KVCache, init_cache
from tpuserve.sampler.sampling import processed_logits, sample, top_logprobs
from tpuserve.sampler.state import DecodeState


@dataclass(frozen=True)
class ProgramConfig:
    K: int                 # logprob width
    steps: int             # N fused decode steps per generate call
    chunk: int             # largest prefill chunk; longer prompts are prefilled chunk by chunk
    processed_logprobs: bool = False


def _step_outputs(logits, state_like, positions, cfg: ProgramConfig):
    """Sample one token per row and gather its logprob and the top-K. logits: [B, V].

    Raw logprobs (log_softmax of the model's logits) unless cfg.processed_logprobs: then, for sampled rows, the
    log_softmax of the temperature-scaled, filtered logits that were sampled from."""
    s = state_like
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_vals, top_ids = top_logprobs(lp, cfg.K)
    ids = sample(logits, top_ids[:, 0], s["keys"], positions, s["temperature"], s["top_p"], s["top_k"], s["min_p"])
    if cfg.processed_logprobs:
        proc = processed_logits(logits, s["temperature"], s["top_p"], s["top_k"], s["min_p"])
        lp = jnp.where((s["temperature"] > 0)[:, None], jax.nn.log_softmax(proc, axis=-1), lp)
        top_vals, top_ids = top_logprobs(lp, cfg.K)
    token_lp = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
    return ids, token_lp, top_ids, top_vals


def _is_done(ids, generated, max_tokens, stop_ids, lengths, max_seq_len):
    hit_stop = jnp.any(ids[:, None] == stop_ids, axis=-1)
    return hit_stop | (generated >= max_tokens) | (lengths >= max_seq_len)


def build_programs(graphdef: Any, cfg: ProgramConfig, max_seq_len: int):
    def model(params):
        return nnx.merge(graphdef, params)

    @functools.partial(jax.jit, static_argnames=("bucket", "want_prompt_logprobs"))
    def prefill(params, tokens: jax.Array, true_len: jax.Array, bucket: int, want_prompt_logprobs: bool):
        """tokens: [bucket] (padded); returns (prefix cache [L,1,bucket,...], last logits [V], prompt logprobs)."""
        m = model(params)
        cache = init_cache(m.cfg, 1, bucket, m.embed.value.dtype)
        chunk = min(cfg.chunk, bucket)
        hidden = []
        for start in range(0, bucket, chunk):  # static: one program per bucket, chunks attend to what is written
            pos = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
            h, cache = m(tokens[None, start : start + chunk], pos, cache, start + chunk)
            hidden.append(h[0])
        hidden = jnp.concatenate(hidden, axis=0)  # [bucket, H]
        last_logits = m.logits(jax.lax.dynamic_index_in_dim(hidden, true_len - 1, keepdims=False))
        prompt = None
        if want_prompt_logprobs:  # entry j: logprob of token j+1 given tokens 0..j
            lp = jax.nn.log_softmax(m.logits(hidden[:-1]), axis=-1)
            top_vals, top_ids = top_logprobs(lp, cfg.K)
            chosen = jnp.take_along_axis(lp, tokens[1:, None], axis=-1)[:, 0]
            prompt = (chosen, top_ids, top_vals)
        return cache, last_logits, prompt

    @functools.partial(jax.jit, donate_argnums=(0,))
    def insert(state: DecodeState, prefix: KVCache, last_logits, slot, prompt_len, slot_params: dict):
        """Copy a prefix into `slot`, set its parameters and sample its first token from `last_logits`."""
        start = (0, slot, 0, 0, 0)
        cache = KVCache(
            jax.lax.dynamic_update_slice(state.cache.k, prefix.k.astype(state.cache.k.dtype), start),
            jax.lax.dynamic_update_slice(state.cache.v, prefix.v.astype(state.cache.v.dtype), start),
        )
        p = {k: v[None] for k, v in slot_params.items()}
        ids, token_lp, top_ids, top_vals = _step_outputs(last_logits[None], p, prompt_len[None], cfg)
        done = _is_done(ids, jnp.ones(1, jnp.int32), p["max_tokens"], p["stop_ids"], prompt_len[None], max_seq_len)

        def put(arr, value):
            return arr.at[slot].set(value[0] if value.ndim == arr.ndim else value)

        state = state.replace(
            cache=cache,
            lengths=put(state.lengths, prompt_len[None]),
            last=put(state.last, ids),
            active=put(state.active, ~done),
            generated=put(state.generated, jnp.ones(1, jnp.int32)),
            max_tokens=put(state.max_tokens, p["max_tokens"]),
            stop_ids=state.stop_ids.at[slot].set(p["stop_ids"][0]),
            temperature=put(state.temperature, p["temperature"]),
            top_p=put(state.top_p, p["top_p"]),
            top_k=put(state.top_k, p["top_k"]),
            min_p=put(state.min_p, p["min_p"]),
            keys=state.keys.at[slot].set(p["keys"][0]),
        )
        return state, (ids[0], token_lp[0], top_ids[0], top_vals[0], done[0])

    @functools.partial(jax.jit, static_argnames=("attend_len", "batch"), donate_argnums=(1,))
    def decode(params, state: DecodeState, attend_len: int, batch: int):
        """N fused decode steps over slots 0..batch-1 (a static bucket covering every live slot); finished and
        empty slots are masked, not branched. Outputs are [N, batch]."""
        m = model(params)
        small = jax.tree.map(lambda a: a[:batch], state.replace(cache=None))

        def step(carry, _):
            s, cache = carry
            positions = jnp.minimum(s.lengths, max_seq_len - 1)
            hidden, cache = m(s.last[:, None], positions[:, None], cache, attend_len)
            logits = m.logits(hidden[:, 0])
            p = {"keys": s.keys, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                 "min_p": s.min_p}  # fmt: skip
            ids, token_lp, top_ids, top_vals = _step_outputs(logits, p, positions + 1, cfg)
            valid = s.active
            lengths = jnp.where(valid, s.lengths + 1, s.lengths)
            generated = jnp.where(valid, s.generated + 1, s.generated)
            done = valid & _is_done(ids, generated, s.max_tokens, s.stop_ids, lengths, max_seq_len)
            s = s.replace(lengths=lengths, generated=generated, active=valid & ~done,
                          last=jnp.where(valid, ids, s.last))  # fmt: skip
            return (s, cache), (ids, token_lp, top_ids, top_vals, valid, done)

        (small, cache), outs = jax.lax.scan(step, (small, state.cache), None, length=cfg.steps)
        merged = jax.tree.map(lambda full, part: full.at[:batch].set(part), state.replace(cache=None), small)
        return merged.replace(cache=cache), outs

    @functools.partial(jax.jit, donate_argnums=(0,))
    def release(state: DecodeState, slot):
        return state.replace(active=state.active.at[slot].set(False))

    return prefill, insert, decode, release

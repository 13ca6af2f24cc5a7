"""The jitted programs of the engine, as plain functions over the split NNX state (never `nnx.jit`, which walks
the object graph in Python on every call). Shapes are static per program: prefill per prompt bucket Lp (a bucket
longer than one chunk: one program per chunk, so the engine thread can put decode calls between them, and one
that finishes), decode per (attended-length bucket A, batch bucket b, with its steps N); everything else
(per-slot parameters, lengths, slot index) is traced."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from tpuserve.model.llama import KVCache, Llama, init_cache
from tpuserve.sampler.sampling import processed_logits, sample, top_logprobs
from tpuserve.sampler.state import DecodeState, SlotSampling


@dataclass(frozen=True)
class ProgramConfig:
    K: int  # logprob width
    chunk: int  # largest prefill chunk; longer prompts are prefilled chunk by chunk
    max_seq_len: int
    processed_logprobs: bool = False


class StepOut(NamedTuple):
    """One sampled token per row: ids, logprob [B]; top_ids, top_logprobs [B, K]."""

    ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


class Programs(NamedTuple):
    prefill: (
        Any  # (params, tokens [Lp], true_len; bucket, want_prompt_logprobs) -> (prefix, last_logits, prompt)
    )
    prefill_chunk: Any  # (params, cache | None, tokens [chunk]; start, bucket) -> (cache, hidden [chunk, H])
    prefill_finish: (
        Any  # (params, hidden [Lp, H], tokens [Lp], true_len; want_prompt_logprobs) -> (logits, prompt)
    )
    insert: Any  # (state, prefix, last_logits, slot, prompt_len, SlotSampling) -> (state, (StepOut, done))
    decode: (
        Any  # (params, state; attend_len, batch, steps) -> (state, (StepOut, valid, done) each [N, batch])
    )
    release: Any  # (state, slot) -> state


def step_outputs(logits: jax.Array, s: SlotSampling, positions: jax.Array, cfg: ProgramConfig) -> StepOut:
    """Sample one token per row and gather its logprob and the top-K. logits: [B, V]; s: [B] parameters.

    Raw logprobs (log_softmax of the model's logits) unless cfg.processed_logprobs: then, for sampled rows, the
    log_softmax of the temperature-scaled, filtered logits that were sampled from."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_vals, top_ids = top_logprobs(lp, cfg.K)
    ids = sample(logits, top_ids[:, 0], s.keys, positions, s.temperature, s.top_p, s.top_k, s.min_p)
    if cfg.processed_logprobs:
        proc = processed_logits(logits, s.temperature, s.top_p, s.top_k, s.min_p)
        lp = jnp.where((s.temperature > 0)[:, None], jax.nn.log_softmax(proc, axis=-1), lp)
        top_vals, top_ids = top_logprobs(lp, cfg.K)
    token_lp = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
    return StepOut(ids, token_lp, top_ids, top_vals)


def is_done(ids, generated, s: SlotSampling, lengths, max_seq_len: int) -> jax.Array:
    hit_stop = jnp.any(ids[:, None] == s.stop_ids, axis=-1)
    return hit_stop | (generated >= s.max_tokens) | (lengths >= max_seq_len)


def prefill_chunk_program(m: Llama, cache: KVCache | None, tokens: jax.Array, start: int, bucket: int):
    """Prompt positions start..start+len(tokens)-1 of a bucket-long prefix (a fresh cache when start == 0);
    they attend to everything written before them. Returns (cache [L,1,bucket,...], hidden [chunk, H])."""
    if cache is None:
        cache = init_cache(m.cfg, 1, bucket, m.embed.value.dtype)
    chunk = tokens.shape[0]
    pos = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
    h, cache = m(tokens[None], pos, cache, start + chunk)
    return cache, h[0]


def prefill_finish_program(m: Llama, hidden: jax.Array, tokens: jax.Array, true_len, want_prompt_logprobs: bool,
                           cfg: ProgramConfig):  # fmt: skip
    """hidden: [bucket, H] of the whole prompt -> (last logits [V], prompt logprobs or None)."""
    last_logits = m.logits(jax.lax.dynamic_index_in_dim(hidden, true_len - 1, keepdims=False))
    prompt = None
    if want_prompt_logprobs:  # entry j: logprob of token j+1 given tokens 0..j
        lp = jax.nn.log_softmax(m.logits(hidden[:-1]), axis=-1)
        top_vals, top_ids = top_logprobs(lp, cfg.K)
        chosen = jnp.take_along_axis(lp, tokens[1:, None], axis=-1)[:, 0]
        prompt = (chosen, top_ids, top_vals)
    return last_logits, prompt


def prefill_program(m: Llama, tokens: jax.Array, true_len: jax.Array, bucket: int, want_prompt_logprobs: bool,
                    cfg: ProgramConfig):  # fmt: skip
    """A prompt bucket of at most one chunk in one program: (prefix cache, last logits [V], prompt logprobs)."""
    cache, hidden = prefill_chunk_program(m, None, tokens, 0, bucket)
    return (cache, *prefill_finish_program(m, hidden, tokens, true_len, want_prompt_logprobs, cfg))


def insert_program(state: DecodeState, prefix: KVCache, last_logits, slot, prompt_len, one: SlotSampling,
                   cfg: ProgramConfig):  # fmt: skip
    """Copy a prefix into `slot`, set its parameters and sample its first token from `last_logits`."""
    start = (0, slot, 0, 0, 0)
    cache = KVCache(
        jax.lax.dynamic_update_slice(state.cache.k, prefix.k.astype(state.cache.k.dtype), start),
        jax.lax.dynamic_update_slice(state.cache.v, prefix.v.astype(state.cache.v.dtype), start),
    )
    row = jax.tree.map(lambda a: jnp.asarray(a)[None], one)  # [1] parameters
    out = step_outputs(last_logits[None], row, prompt_len[None], cfg)
    done = is_done(out.ids, jnp.ones(1, jnp.int32), row, prompt_len[None], cfg.max_seq_len)
    state = state.replace(
        cache=cache,
        lengths=state.lengths.at[slot].set(prompt_len),
        last=state.last.at[slot].set(out.ids[0]),
        active=state.active.at[slot].set(~done[0]),
        generated=state.generated.at[slot].set(1),
        sampling=jax.tree.map(lambda full, new: full.at[slot].set(new[0]), state.sampling, row),
    )
    return state, (StepOut(*(a[0] for a in out)), done[0])


def decode_program(m: Llama, state: DecodeState, attend_len: int, batch: int, steps: int, cfg: ProgramConfig):
    """`steps` (N) fused decode steps over slots 0..batch-1 (a static bucket covering every occupied slot);
    finished and empty slots are masked, not branched. Outputs are [N, batch]."""
    small = jax.tree.map(lambda a: a[:batch], state.replace(cache=None))

    def step(carry, _):
        s, cache = carry
        positions = jnp.minimum(s.lengths, cfg.max_seq_len - 1)
        hidden, cache = m(s.last[:, None], positions[:, None], cache, attend_len)
        out = step_outputs(m.logits(hidden[:, 0]), s.sampling, positions + 1, cfg)
        valid = s.active
        lengths = jnp.where(valid, s.lengths + 1, s.lengths)
        generated = jnp.where(valid, s.generated + 1, s.generated)
        done = valid & is_done(out.ids, generated, s.sampling, lengths, cfg.max_seq_len)
        s = s.replace(lengths=lengths, generated=generated, active=valid & ~done,
                      last=jnp.where(valid, out.ids, s.last))  # fmt: skip
        return (s, cache), (out, valid, done)

    (small, cache), outs = jax.lax.scan(step, (small, state.cache), None, length=steps)
    merged = jax.tree.map(lambda full, part: full.at[:batch].set(part), state.replace(cache=None), small)
    return merged.replace(cache=cache), outs


def build_programs(graphdef: Any, cfg: ProgramConfig) -> Programs:
    def model(params) -> Llama:
        return nnx.merge(graphdef, params)

    @functools.partial(jax.jit, static_argnames=("bucket", "want_prompt_logprobs"))
    def prefill(params, tokens, true_len, bucket: int, want_prompt_logprobs: bool):
        return prefill_program(model(params), tokens, true_len, bucket, want_prompt_logprobs, cfg)

    @functools.partial(jax.jit, static_argnames=("start", "bucket"), donate_argnums=(1,))
    def prefill_chunk(params, cache, tokens, start: int, bucket: int):
        return prefill_chunk_program(model(params), cache, tokens, start, bucket)

    @functools.partial(jax.jit, static_argnames=("want_prompt_logprobs",))
    def prefill_finish(params, hidden, tokens, true_len, want_prompt_logprobs: bool):
        return prefill_finish_program(model(params), hidden, tokens, true_len, want_prompt_logprobs, cfg)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def insert(state: DecodeState, prefix: KVCache, last_logits, slot, prompt_len, one: SlotSampling):
        return insert_program(state, prefix, last_logits, slot, prompt_len, one, cfg)

    @functools.partial(jax.jit, static_argnames=("attend_len", "batch", "steps"), donate_argnums=(1,))
    def decode(params, state: DecodeState, attend_len: int, batch: int, steps: int):
        return decode_program(model(params), state, attend_len, batch, steps, cfg)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def release(state: DecodeState, slot):
        return state.replace(active=state.active.at[slot].set(False))

    return Programs(prefill, prefill_chunk, prefill_finish, insert, decode, release)

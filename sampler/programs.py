"""The jitted programs of the engine, as plain functions over the split NNX state (never `nnx.jit`, which walks
the object graph in Python on every call). Shapes are static per program: a prompt is prefilled in chunks that
start at multiples of the block size C, one program per (chunk size, attended-length bucket) with the start
traced, so a position range is always computed by the same program whether the blocks before it were computed
now or came from the prefix cache (bit-identical results); decode per (attended-length bucket A, batch bucket b,
with its steps N); everything else (per-slot parameters, lengths, slot index, block ids) is traced."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from tpuserve.model.llama import KVCache, Llama, cache_bytes, init_cache, pad_rows
from tpuserve.sampler.sampling import NEG_INF, processed_logits, sample, top_logprobs
from tpuserve.sampler.state import DecodeState, SlotSampling


@dataclass(frozen=True)
class ProgramConfig:
    K: int  # logprob width
    chunk: int  # C: prompts are prefilled in chunks of at most C that start at multiples of C (cache blocks)
    max_seq_len: int
    processed_logprobs: bool = False
    # A decode bucket of fewer rows computes every operation but the weight products on this many rows (the
    # following free slots, inert): XLA:CPU rounds the norms, rotary embedding, softmax and sampling of fewer than 8
    # rows differently, so this keeps a request's results bit-identical from 2 rows up (0: off, other backends).
    invariant_rows: int = 0


class StepOut(NamedTuple):
    """One sampled token per row: ids, logprob [B]; top_ids, top_logprobs [B, K]."""

    ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


class Programs(NamedTuple):
    fresh: Any  # () -> an empty prefix cache [L, 1, Hkv, S, D]
    chunk: Any  # (params, cache, tokens [size], start; attend_len) -> (cache, hidden [size, H])
    # (params, tokens [P, size], last [P]; attend_len) -> (P prefix caches [L, 1, Hkv, attend_len, D], P logits [V])
    chunk_together: Any
    chunk_logprobs: Any  # (params, hidden [size, H], targets [size]) -> ChunkLogprobs
    last_logits: Any  # (params, hidden [size, H], index) -> logits [V]
    insert: Any  # (state, prefix, last_logits, slot, prompt_len, SlotSampling, allowed [W]) -> (state, (StepOut, done))
    # (params, state, allowed [slots, W], steps_now; attend_len, batch, steps) -> (state, (StepOut, valid, done)
    # each [N, batch])
    decode: Any
    release: Any  # (state, slot) -> state
    # the prefix cache's pool (see sampler/prefix_cache.py)
    store: Any  # (pool, cache, start, block) -> pool: the cache's positions start..start+C-1 into a block
    store_logprobs: Any  # (pool, block, ChunkLogprobs) -> pool: a block's prompt logprobs
    load: Any  # (pool, blocks [M], count) -> prefix cache holding blocks[:count] at positions 0..count*C-1
    cached_logprobs: Any  # (pool, blocks [M], targets [M]) -> (chosen [M, C], top_ids [M, C, K], top_vals)


class ChunkLogprobs(NamedTuple):
    """Prompt logprobs of one chunk's positions: entry j is the logprob of targets[j] (the prompt token after
    position j) given the prompt up to j. `last` is position size-1's whole log-distribution [V]: a cached block
    keeps it to answer the next block's first token, whichever it is."""

    chosen: jax.Array  # [size]
    top_ids: jax.Array  # [size, K]
    top_vals: jax.Array  # [size, K]
    last: jax.Array  # [V]


class Pool(NamedTuple):
    """The prefix cache's device arrays: M blocks of C positions (KV in the prefix cache's dtype), and the prompt
    logprobs of a block where a request asked for them (ChunkLogprobs per block)."""

    k: jax.Array  # [L, M, Hkv, C, D]
    v: jax.Array
    chosen: jax.Array  # [M, C]
    top_ids: jax.Array  # [M, C, K]
    top_vals: jax.Array  # [M, C, K]
    last: jax.Array  # [M, V]


def init_pool(cfg, blocks: int, block: int, K: int, dtype) -> Pool:
    kv = init_cache(cfg, blocks, block, dtype)
    return Pool(kv.k, kv.v, jnp.zeros((blocks, block), jnp.float32), jnp.zeros((blocks, block, K), jnp.int32),
                jnp.zeros((blocks, block, K), jnp.float32), jnp.zeros((blocks, cfg.vocab_size), jnp.float32))  # fmt: skip


def pool_block_bytes(cfg, block: int, K: int, dtype) -> int:
    """Device bytes of one pool block (KV + prompt logprobs)."""
    return cache_bytes(cfg, 1, block, dtype) + 4 * (block + 2 * block * K + cfg.vocab_size)


def allowed_bits(allowed: jax.Array, vocab: int) -> jax.Array:
    """Token bitmasks [B, W] (int32 words, token t = bit t % 32 of word t // 32: llguidance's layout) -> [B, V]
    booleans."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (allowed[:, :, None] >> shifts) & 1
    return bits.reshape(allowed.shape[0], -1)[:, :vocab].astype(bool)


def step_outputs(
    logits: jax.Array, s: SlotSampling, positions: jax.Array, cfg: ProgramConfig, allowed: jax.Array
) -> StepOut:
    """Sample one token per row and gather its logprob and the top-K. logits: [B, V]; s: [B] parameters;
    allowed: [B, W] token bitmasks (structured outputs; all ones for a free row).

    Sampling (and greedy) draws from the allowed tokens only. Raw logprobs (log_softmax of the model's logits,
    mask or not) unless cfg.processed_logprobs: then the log_softmax of what was sampled from (the
    temperature-scaled, filtered logits for sampled rows; the masked logits for a constrained greedy row)."""
    constrained = jnp.any(allowed != -1, axis=-1)  # a free row's mask is all ones
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_vals, top_ids = top_logprobs(lp, cfg.K)

    def masked() -> jax.Array:  # free rows: the logits unchanged
        return jnp.where(allowed_bits(allowed, logits.shape[-1]), logits, NEG_INF)

    # Only [B] ids leave the condition: the masks cost ~10 ms a step at 64 rows on XLA:CPU, skipped unless some
    # row is constrained; sampled rows are masked inside `sample`'s own branch.
    greedy = jax.lax.cond(
        jnp.any(constrained),
        lambda _: jnp.where(constrained, jnp.argmax(masked(), axis=-1).astype(jnp.int32), top_ids[:, 0]),
        lambda _: top_ids[:, 0],
        None,
    )
    ids = sample(logits, greedy, s.keys, positions, s.temperature, s.top_p, s.top_k, s.min_p, mask=masked)
    if cfg.processed_logprobs:
        proc = processed_logits(masked(), s.temperature, s.top_p, s.top_k, s.min_p)
        greedy_lp = jnp.where(constrained[:, None], jax.nn.log_softmax(masked(), axis=-1), lp)
        lp = jnp.where((s.temperature > 0)[:, None], jax.nn.log_softmax(proc, axis=-1), greedy_lp)
        top_vals, top_ids = top_logprobs(lp, cfg.K)
    token_lp = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
    return StepOut(ids, token_lp, top_ids, top_vals)


def is_done(ids, generated, s: SlotSampling, lengths, max_seq_len: int) -> jax.Array:
    hit_stop = jnp.any(ids[:, None] == s.stop_ids, axis=-1)
    return hit_stop | (generated >= s.max_tokens) | (lengths >= max_seq_len)


def chunk_program(m: Llama, cache: KVCache, tokens: jax.Array, start, attend_len: int):
    """Prompt positions start..start+size-1 (`start` traced) into the prefix cache [L, 1, Hkv, S, D]; they attend
    to everything written before them, over the first `attend_len` positions (static). -> (cache, hidden)."""
    pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    h, cache = m(tokens[None], pos[None], cache, attend_len)
    return cache, h[0]


def chunk_together_program(m: Llama, tokens: jax.Array, last: jax.Array, attend_len: int, dtype):
    """Short prompts, one per row from position 0 (tokens [P, size]; last [P]: each one's last index), in one
    program: each prompt's prefix cache [L, 1, Hkv, attend_len, D] and its last token's logits [V]. A row's
    products give the same numbers whatever the number of rows (>= 2; llama.py), and each row's logits are its
    own one-row product as in `last_logits`, so a prompt's prefix is the one a `chunk` of its own would make."""
    P, size = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (P, size))
    hidden, cache = m(tokens, pos, init_cache(m.cfg, P, attend_len, dtype), attend_len)
    caches = tuple(KVCache(cache.k[:, r : r + 1], cache.v[:, r : r + 1]) for r in range(P))
    logits = tuple(m.logits(jax.lax.dynamic_index_in_dim(h, i, keepdims=False)) for h, i in zip(hidden, last))
    return caches, logits


def chunk_logprobs_program(
    m: Llama, hidden: jax.Array, targets: jax.Array, cfg: ProgramConfig
) -> ChunkLogprobs:
    lp = jax.nn.log_softmax(m.logits(hidden), axis=-1)
    top_vals, top_ids = top_logprobs(lp, cfg.K)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    return ChunkLogprobs(chosen, top_ids, top_vals, lp[-1])


def load_program(pool: Pool, cache: KVCache, blocks: jax.Array, count) -> KVCache:
    """An empty prefix cache with pool blocks blocks[:count] written at positions 0..count*C-1."""
    C = pool.k.shape[3]

    def put(i, kv):
        k, v = kv
        at = (0, 0, 0, i * C, 0)
        k = jax.lax.dynamic_update_slice(k, jax.lax.dynamic_index_in_dim(pool.k, blocks[i], 1), at)
        v = jax.lax.dynamic_update_slice(v, jax.lax.dynamic_index_in_dim(pool.v, blocks[i], 1), at)
        return k, v

    return KVCache(*jax.lax.fori_loop(0, count, put, (cache.k, cache.v)))


def store_program(pool: Pool, cache: KVCache, start, block) -> Pool:
    L, _, Hkv, C, D = pool.k.shape

    def put(dst, src):
        part = jax.lax.dynamic_slice(src, (0, 0, 0, start, 0), (L, 1, Hkv, C, D))
        return jax.lax.dynamic_update_slice(dst, part.astype(dst.dtype), (0, block, 0, 0, 0))

    return pool._replace(k=put(pool.k, cache.k), v=put(pool.v, cache.v))


def store_logprobs_program(pool: Pool, block, lp: ChunkLogprobs) -> Pool:
    return pool._replace(chosen=pool.chosen.at[block].set(lp.chosen), top_ids=pool.top_ids.at[block].set(lp.top_ids),
                         top_vals=pool.top_vals.at[block].set(lp.top_vals), last=pool.last.at[block].set(lp.last))  # fmt: skip


def cached_logprobs_program(pool: Pool, blocks: jax.Array, targets: jax.Array):
    """Prompt logprobs of cached blocks [len(blocks) * C, ...]: their own entries, each block's last one answered
    from the block's kept distribution for `targets` (the first token of the block after it in this prompt)."""
    chosen = pool.chosen[blocks].at[:, -1].set(pool.last[blocks, targets])
    C, K = pool.chosen.shape[1], pool.top_ids.shape[2]
    n = blocks.shape[0] * C
    return chosen.reshape(n), pool.top_ids[blocks].reshape(n, K), pool.top_vals[blocks].reshape(n, K)


def insert_program(state: DecodeState, prefix: KVCache, last_logits, slot, prompt_len, one: SlotSampling,
                   allowed, cfg: ProgramConfig):  # fmt: skip
    """Copy a prefix into `slot`, set its parameters and sample its first token from `last_logits` (among the
    tokens `allowed` [W] lets through)."""
    start = (0, slot, 0, 0, 0)
    cache = KVCache(
        jax.lax.dynamic_update_slice(state.cache.k, prefix.k.astype(state.cache.k.dtype), start),
        jax.lax.dynamic_update_slice(state.cache.v, prefix.v.astype(state.cache.v.dtype), start),
    )
    row = jax.tree.map(lambda a: jnp.asarray(a)[None], one)  # [1] parameters
    out = step_outputs(last_logits[None], row, prompt_len[None], cfg, allowed[None])
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


def decode_program(m: Llama, state: DecodeState, allowed, steps_now, attend_len: int, batch: int, steps: int,
                   cfg: ProgramConfig):  # fmt: skip
    """Up to `steps` (N, static: the outputs' size) fused decode steps over slots 0..batch-1 (a static bucket
    covering every occupied slot); `steps_now` (traced, 1..N) of them run, so a call whose tokens need the host
    between steps (a constrained row's next mask) costs one step, not N, with no other program. Finished and
    empty slots are masked, not branched. allowed: [slots, W] token bitmasks. Outputs are [N, batch]; steps past
    steps_now are not valid.

    Under cfg.invariant_rows (XLA:CPU) a bucket of fewer rows runs on that many (the slots after the bucket are
    free: inactive, and their keys and values are not written) with its weight products on `batch` rows only."""
    slots = state.lengths.shape[0]
    width = min(slots, max(batch, cfg.invariant_rows))
    small = jax.tree.map(lambda a: a[:width], state.replace(cache=None))
    masks = allowed[:width]
    live = jnp.arange(width) < batch

    def step(s, cache):
        positions = jnp.minimum(s.lengths, cfg.max_seq_len - 1)
        # rows past the bucket write their keys and values nowhere (out of range: dropped)
        written = jnp.where(live, positions, cfg.max_seq_len)
        hidden, cache = m(s.last[:, None], written[:, None], cache, attend_len, live_rows=batch)
        logits = pad_rows(m.logits(hidden[:batch, 0]), width)
        out = step_outputs(logits, s.sampling, positions + 1, cfg, masks)
        valid = s.active
        lengths = jnp.where(valid, s.lengths + 1, s.lengths)
        generated = jnp.where(valid, s.generated + 1, s.generated)
        done = valid & is_done(out.ids, generated, s.sampling, lengths, cfg.max_seq_len)
        s = s.replace(lengths=lengths, generated=generated, active=valid & ~done,
                      last=jnp.where(valid, out.ids, s.last))  # fmt: skip
        return s, cache, (out, valid, done)

    def body(carry):
        i, s, cache, outs = carry
        s, cache, new = step(s, cache)
        outs = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0), outs, new)
        return i + 1, s, cache, outs

    shapes = jax.eval_shape(lambda s, c: step(s, c)[2], small, state.cache)
    empty = jax.tree.map(lambda a: jnp.zeros((steps, *a.shape), a.dtype), shapes)
    bound = jnp.clip(steps_now, 1, steps)
    _, small, cache, outs = jax.lax.while_loop(
        lambda c: c[0] < bound, body, (jnp.int32(0), small, state.cache, empty)
    )
    merged = jax.tree.map(lambda full, part: full.at[:width].set(part), state.replace(cache=None), small)
    return merged.replace(cache=cache), jax.tree.map(lambda a: a[:, :batch], outs)


def build_programs(graphdef: Any, cfg: ProgramConfig, model_cfg, dtype, prefix_sharding=None) -> Programs:
    """`dtype`: the prefix cache's (the model's); `prefix_sharding`: where a prefix cache lives on a mesh (None:
    one device)."""

    def model(params) -> Llama:
        return nnx.merge(graphdef, params)

    @functools.partial(jax.jit, out_shardings=prefix_sharding)
    def fresh_cache():
        return init_cache(model_cfg, 1, cfg.max_seq_len, dtype)

    @functools.partial(jax.jit, static_argnames=("attend_len",), donate_argnums=(1,))
    def chunk(params, cache, tokens, start, attend_len: int):
        return chunk_program(model(params), cache, tokens, start, attend_len)

    @functools.partial(jax.jit, static_argnames=("attend_len",))
    def chunk_together(params, tokens, last, attend_len: int):
        return chunk_together_program(model(params), tokens, last, attend_len, dtype)

    @jax.jit
    def chunk_logprobs(params, hidden, targets):
        return chunk_logprobs_program(model(params), hidden, targets, cfg)

    @jax.jit
    def last_logits(params, hidden, index):
        return model(params).logits(jax.lax.dynamic_index_in_dim(hidden, index, keepdims=False))

    @functools.partial(jax.jit, donate_argnums=(0,))
    def insert(
        state: DecodeState, prefix: KVCache, last_logits, slot, prompt_len, one: SlotSampling, allowed
    ):
        return insert_program(state, prefix, last_logits, slot, prompt_len, one, allowed, cfg)

    @functools.partial(jax.jit, static_argnames=("attend_len", "batch", "steps"), donate_argnums=(1,))
    def decode(params, state: DecodeState, allowed, steps_now, attend_len: int, batch: int, steps: int):
        return decode_program(model(params), state, allowed, steps_now, attend_len, batch, steps, cfg)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def release(state: DecodeState, slot):
        return state.replace(active=state.active.at[slot].set(False))

    @functools.partial(jax.jit, out_shardings=prefix_sharding)
    def load(pool: Pool, blocks, count):
        return load_program(pool, init_cache(model_cfg, 1, cfg.max_seq_len, dtype), blocks, count)

    store = jax.jit(store_program, donate_argnums=(0,))
    store_logprobs = jax.jit(store_logprobs_program, donate_argnums=(0,))
    cached_logprobs = jax.jit(cached_logprobs_program)
    return Programs(fresh_cache, chunk, chunk_together, chunk_logprobs, last_logits, insert, decode, release,
                    store, store_logprobs, load, cached_logprobs)  # fmt: skip

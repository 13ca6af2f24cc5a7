"""The jitted programs of the engine, as plain functions over the split NNX state (never `nnx.jit`, which walks
the object graph in Python on every call). Shapes are static per program: a prompt is prefilled in chunks, one
program per (chunk size, attended-length bucket) with the start traced; decode per (attended-length bucket A,
batch bucket b, with its steps N); everything else (per-slot parameters, lengths, slot index, page tables) is
traced. Every program reads and writes keys and values through page tables into the one pool of pages
(model/llama.py), donated from call to call.
A prompt's pages can be shared whatever split of it computed them: see buckets.SHARED_CHUNK."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from tpuserve.model.llama import KVCache, Llama, put_pages, take_pages
from tpuserve.sampler.sampling import NEG_INF, processed_logits, sample, top_logprobs
from tpuserve.sampler.state import DecodeState, SlotSampling

SWAP_PAGES = 16  # pages one swap program moves between the pool and the host
DECODE_ATTENTION = ("auto", "gather", "pallas")  # EngineConfig.decode_attention

log = logging.getLogger(__name__)


def resolve_decode_attention(setting: str) -> str:
    """EngineConfig.decode_attention -> what decode runs: "pallas" (jax's Pallas TPU kernel over the pool in
    place) or "gather" (plain XLA); "auto" is pallas on TPU only. Pallas off TPU runs in jax's TPU interpreter."""
    if setting not in DECODE_ATTENTION:
        raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}; got {setting!r}")
    backend = jax.default_backend()
    if setting == "auto":
        return "pallas" if backend == "tpu" else "gather"
    if setting == "pallas" and backend != "tpu":
        log.warning("decode_attention pallas on %s: the TPU kernel runs in jax's TPU interpreter (slow; for tests)",
                    backend)  # fmt: skip
    return setting


@dataclass(frozen=True)
class ProgramConfig:
    K: int  # logprob width
    chunk: int  # C: prompts are prefilled in chunks of at most C positions
    max_seq_len: int
    processed_logprobs: bool = False
    # A decode bucket of fewer rows computes every operation but the weight products on this many rows (the
    # following free slots, inert): XLA:CPU rounds the norms, rotary embedding, softmax and sampling of fewer than 8
    # rows differently, so this keeps a request's results bit-identical from 2 rows up (0: off, other backends).
    invariant_rows: int = 0
    # A decode step's attention, resolved (`resolve_decode_attention`): "gather" or "pallas"; prompt chunks gather.
    decode_attention: str = "gather"
    # the engine's mesh (jax.sharding.Mesh) or None: the kernel runs per device on the device's KV heads
    mesh: Any = None
    # prompt chunks attend as decode rows do (EngineConfig.rescore_exact; decode then gathers on every backend)
    rescore_exact: bool = False


class StepOut(NamedTuple):
    """One sampled token per row: ids, logprob [B]; top_ids, top_logprobs [B, K]."""

    ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


class Programs(NamedTuple):
    # (params, pool, tokens [size], start, table [pages], write_from; attend_len) -> (pool, hidden [size, H]):
    # positions before write_from are computed but not written (they belong to shared pages)
    chunk: Any
    # (params, pool, tokens [P, size], last [P], tables [P, pages]; attend_len) -> (pool, P logits [V])
    chunk_together: Any
    chunk_logprobs: Any  # (params, hidden [size, H], targets [size]) -> ChunkLogprobs
    last_logits: Any  # (params, hidden [size, H], index) -> logits [V]
    insert: (
        Any  # (state, last_logits, slot, prompt_len, SlotSampling, allowed [W]) -> (state, (StepOut, done))
    )
    # (params, state, pool, table [slots, pages], paused [slots], allowed [slots, W], rows [width], steps_now;
    # attend_len, batch, steps) -> (state, pool, (StepOut, valid, done) each [N, batch])
    decode: Any
    release: Any  # (state, slot) -> state
    copy_page: Any  # (pool, src, dst) -> pool
    swap_out: Any  # (pool, pages [SWAP_PAGES]) -> (k, v) [Hkv, L, SWAP_PAGES, page, D]
    swap_in: Any  # (pool, pages [SWAP_PAGES], k, v) -> pool; pages past the pool are skipped


class Pool(NamedTuple):
    """The device's pages of keys and values, [Hkv, L, P, page, D] each (page 0: the null page; model/llama.py)."""

    k: jax.Array
    v: jax.Array


class ChunkLogprobs(NamedTuple):
    """Prompt logprobs of one chunk's positions: entry j is the logprob of targets[j] (the prompt token after
    position j) given the prompt up to j."""

    chosen: jax.Array  # [size]
    top_ids: jax.Array  # [size, K]
    top_vals: jax.Array  # [size, K]


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


def chunk_program(
    m: Llama,
    pool: Pool,
    tokens: jax.Array,
    start,
    table: jax.Array,
    write_from,
    attend_len: int,
    query_rows: bool = False,
):
    """Prompt positions start..start+size-1 (`start` traced) through the row's page table [pages]; they attend to
    everything written before them, over the first `attend_len` positions (static). -> (pool, hidden)."""
    pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    h, cache = m(tokens[None], pos[None], KVCache(pool.k, pool.v, table[None]), attend_len,
                 write=(pos >= write_from)[None], query_rows=query_rows)  # fmt: skip
    return Pool(cache.k, cache.v), h[0]


def chunk_together_program(m: Llama, pool: Pool, tokens: jax.Array, last: jax.Array, tables: jax.Array,
                           attend_len: int, query_rows: bool = False):  # fmt: skip
    """Short prompts, one per row from position 0 (tokens [P, size]; last [P]: each one's last index; tables
    [P, pages]), in one program: their keys and values into their pages and each last token's logits [V]. A
    row's products give the same numbers whatever the number of rows (>= 2; llama.py), and each row's logits are
    its own one-row product as in `last_logits`, so a prompt's result is the one a `chunk` of its own makes."""
    P, size = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (P, size))
    hidden, cache = m(tokens, pos, KVCache(pool.k, pool.v, tables), attend_len, query_rows=query_rows)
    rows = [jax.lax.dynamic_index_in_dim(h, i, keepdims=False) for h, i in zip(hidden, last)]
    if query_rows:  # one product of P >= 2 rows, rounded as a decode step's and a chunk's logprobs are
        return Pool(cache.k, cache.v), tuple(m.logits(jnp.stack(rows)))
    return Pool(cache.k, cache.v), tuple(m.logits(h) for h in rows)


EXACT_ROWS = 8  # XLA:CPU rounds products of one row, and the log-softmax of fewer than 8, otherwise


def last_logits_program(m: Llama, hidden: jax.Array, index, exact: bool) -> jax.Array:
    """The logits [V] of hidden [size, H] at `index`; `exact`: out of a product of up to EXACT_ROWS rows (those
    ending at index), as decode and prompt logprobs compute them, not of that row alone."""
    if not exact:
        return m.logits(jax.lax.dynamic_index_in_dim(hidden, index, keepdims=False))
    n = min(EXACT_ROWS, hidden.shape[0])
    first = jnp.clip(index - (n - 1), 0, hidden.shape[0] - n)
    logits = m.logits(jax.lax.dynamic_slice_in_dim(hidden, first, n))
    return jax.lax.dynamic_index_in_dim(logits, index - first, keepdims=False)


def chunk_logprobs_program(
    m: Llama, hidden: jax.Array, targets: jax.Array, cfg: ProgramConfig
) -> ChunkLogprobs:
    lp = jax.nn.log_softmax(m.logits(hidden), axis=-1)
    top_vals, top_ids = top_logprobs(lp, cfg.K)
    chosen = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    return ChunkLogprobs(chosen, top_ids, top_vals)


def swap_out_program(pool: Pool, pages: jax.Array):
    return take_pages(pool.k, pages), take_pages(pool.v, pages)


def swap_in_program(pool: Pool, pages: jax.Array, k: jax.Array, v: jax.Array) -> Pool:
    return Pool(put_pages(pool.k, pages, k), put_pages(pool.v, pages, v))


def copy_page_program(pool: Pool, src, dst) -> Pool:
    return Pool(
        put_pages(pool.k, dst, take_pages(pool.k, src)), put_pages(pool.v, dst, take_pages(pool.v, src))
    )


def insert_program(state: DecodeState, last_logits, slot, prompt_len, one: SlotSampling, allowed,
                   cfg: ProgramConfig):  # fmt: skip
    """Set `slot`'s parameters (its pages are in the host's page table) and sample its first token from
    `last_logits` (among the tokens `allowed` [W] lets through)."""
    # [1] parameters; under rescore_exact the row repeated EXACT_ROWS times, so its log-softmax is a decode row's
    n = EXACT_ROWS if cfg.rescore_exact else 1
    row = jax.tree.map(lambda a: jnp.repeat(jnp.asarray(a)[None], n, axis=0), one)
    out = step_outputs(jnp.repeat(last_logits[None], n, axis=0), row, jnp.repeat(prompt_len[None], n), cfg,
                       jnp.repeat(allowed[None], n, axis=0))  # fmt: skip
    out = jax.tree.map(lambda a: a[:1], out)
    row = jax.tree.map(lambda a: a[:1], row)
    done = is_done(out.ids, jnp.ones(1, jnp.int32), row, prompt_len[None], cfg.max_seq_len)
    state = state.replace(
        lengths=state.lengths.at[slot].set(prompt_len),
        last=state.last.at[slot].set(out.ids[0]),
        active=state.active.at[slot].set(~done[0]),
        generated=state.generated.at[slot].set(1),
        sampling=jax.tree.map(lambda full, new: full.at[slot].set(new[0]), state.sampling, row),
    )
    return state, (StepOut(*(a[0] for a in out)), done[0])


def decode_program(m: Llama, state: DecodeState, pool: Pool, table, paused, allowed, rows, steps_now,
                   attend_len: int, batch: int, steps: int, cfg: ProgramConfig):  # fmt: skip
    """Up to `steps` (N, static: the outputs' size) fused decode steps over the slots `rows` [width] names: its
    first `batch` (a static bucket) are the call's, the rest (and any padding among the first `batch`) the
    scratch row, inactive. `steps_now` (traced, 1..N) of them run, so a call whose tokens need the host between
    steps (a constrained row's next mask) costs one step, not N, with no other program. Finished, empty and
    `paused` [slots] slots (moved out of the pool) are masked, not branched, and write no keys or values.
    table: [slots, pages] page tables; allowed: [slots, W] token bitmasks. Outputs are [N, batch], in `rows`'
    order; steps past steps_now are not valid.

    A row's results do not depend on which rows run beside it, nor on the bucket: so the engine may run the
    rows that need a long attended length in a call of their own. Under cfg.invariant_rows (XLA:CPU) `rows`
    has at least that many entries (the scratch row after the bucket), with the weight products on `batch` rows
    only."""
    width = rows.shape[0]
    small = jax.tree.map(lambda a: a[rows], state)
    masks, rows_table = allowed[rows], table[rows]
    live = (jnp.arange(width) < batch) & ~paused[rows]

    def step(s, kv):
        positions = jnp.minimum(s.lengths, cfg.max_seq_len - 1)
        valid = s.active & live
        cache = KVCache(kv.k, kv.v, rows_table)
        hidden, cache = m(s.last[:, None], positions[:, None], cache, attend_len, live_rows=batch,
                          write=valid[:, None], decode_attention=cfg.decode_attention, mesh=cfg.mesh)  # fmt: skip
        logits = m.logits(hidden[:, 0], live_rows=batch)
        out = step_outputs(logits, s.sampling, positions + 1, cfg, masks)
        lengths = jnp.where(valid, s.lengths + 1, s.lengths)
        generated = jnp.where(valid, s.generated + 1, s.generated)
        done = valid & is_done(out.ids, generated, s.sampling, lengths, cfg.max_seq_len)
        s = s.replace(lengths=lengths, generated=generated, active=s.active & ~done,
                      last=jnp.where(valid, out.ids, s.last))  # fmt: skip
        return s, Pool(cache.k, cache.v), (out, valid, done)

    def body(carry):
        i, s, kv, outs = carry
        s, kv, new = step(s, kv)
        outs = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0), outs, new)
        return i + 1, s, kv, outs

    shapes = jax.eval_shape(lambda s, c: step(s, c)[2], small, pool)
    empty = jax.tree.map(lambda a: jnp.zeros((steps, *a.shape), a.dtype), shapes)
    bound = jnp.clip(steps_now, 1, steps)
    _, small, pool, outs = jax.lax.while_loop(
        lambda c: c[0] < bound, body, (jnp.int32(0), small, pool, empty)
    )
    # the scratch row may stand for several entries: it stays inactive whichever write lands
    merged = jax.tree.map(lambda full, part: full.at[rows].set(part), state, small)
    return merged, pool, jax.tree.map(lambda a: a[:, :batch], outs)


def build_programs(graphdef: Any, cfg: ProgramConfig) -> Programs:
    if cfg.rescore_exact:  # the TPU kernel computes a decode step's attention otherwise than a chunk's rows
        cfg = dataclasses.replace(cfg, decode_attention="gather")

    def model(params) -> Llama:
        return nnx.merge(graphdef, params)

    @functools.partial(jax.jit, static_argnames=("attend_len",), donate_argnums=(1,))
    def chunk(params, pool, tokens, start, table, write_from, attend_len: int):
        return chunk_program(
            model(params), pool, tokens, start, table, write_from, attend_len, cfg.rescore_exact
        )

    @functools.partial(jax.jit, static_argnames=("attend_len",), donate_argnums=(1,))
    def chunk_together(params, pool, tokens, last, tables, attend_len: int):
        return chunk_together_program(
            model(params), pool, tokens, last, tables, attend_len, cfg.rescore_exact
        )

    @jax.jit
    def chunk_logprobs(params, hidden, targets):
        return chunk_logprobs_program(model(params), hidden, targets, cfg)

    @jax.jit
    def last_logits(params, hidden, index):
        return last_logits_program(model(params), hidden, index, cfg.rescore_exact)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def insert(state: DecodeState, last_logits, slot, prompt_len, one: SlotSampling, allowed):
        return insert_program(state, last_logits, slot, prompt_len, one, allowed, cfg)

    @functools.partial(jax.jit, static_argnames=("attend_len", "batch", "steps"), donate_argnums=(1, 2))
    def decode(params, state: DecodeState, pool, table, paused, allowed, rows, steps_now, attend_len: int,
               batch: int, steps: int):  # fmt: skip
        return decode_program(model(params), state, pool, table, paused, allowed, rows, steps_now, attend_len,
                              batch, steps, cfg)  # fmt: skip

    @functools.partial(jax.jit, donate_argnums=(0,))
    def release(state: DecodeState, slot):
        return state.replace(active=state.active.at[slot].set(False))

    return Programs(chunk, chunk_together, chunk_logprobs, last_logits, insert, decode, release,
                    jax.jit(copy_page_program, donate_argnums=(0,)), jax.jit(swap_out_program),
                    jax.jit(swap_in_program, donate_argnums=(0,)))  # fmt: skip

"""JaxEngine: the real engine behind `sampler.api.Engine` — continuous batching over B slots with static shapes.

Decode runs on the smallest batch bucket (power of two, at least 2 rows) that covers the occupied slots, and
attends over the smallest length bucket that covers the longest sequence, so its cost follows the live load. A
request's tokens and logprobs do not depend on the bucket (see model/llama.py on the [out, in] weight layout).
Calls are dispatched without waiting (`start_decode`, `start_insert`): host copies of their small outputs
start at once and are read when the caller asks, so host work overlaps the next device call.

Driven by one thread (the orchestrator's engine thread, which also runs `warm_up`); nothing here is shared.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tpuserve.model.llama import cache_bytes
from tpuserve.model.loader import LoadedModel
from tpuserve.model.quant import tree_nbytes
from tpuserve.model.sharding import DEFAULT_RULES, ShardingRules, cache_sharding
from tpuserve.sampler import warmup
from tpuserve.sampler.api import (
    MAX_TOP_LOGPROBS,
    Capabilities,
    Engine,
    Pending,
    PrefixCacheStats,
    PromptLogprobs,
    SlotParams,
    StepArrays,
    TokenOut,
)
from tpuserve.sampler.buckets import Buckets, bucket_for
from tpuserve.sampler.config import EngineConfig
from tpuserve.sampler.prefix_cache import PrefixIndex
from tpuserve.sampler.programs import Pool, ProgramConfig, build_programs, init_pool, pool_block_bytes
from tpuserve.sampler.state import init_decode_state, slot_sampling

log = logging.getLogger(__name__)

# XLA:CPU rounds a decode step's norms, rotary embedding, softmax and sampling of 2 or 4 rows differently from 8 or
# more (its products are the same from 2 rows up): smaller buckets run those on 8 rows (ProgramConfig).
INVARIANT_ROWS = 8
# a prefix and the pool's blocks are split over KV heads only (a prefix has one row; blocks are not slots)
PREFIX_RULES = ShardingRules({**DEFAULT_RULES, "batch": None})


def device_memory_bytes() -> int:
    """This process's first device's memory (its allocator's limit), or the host's RAM for a CPU device."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class Prefix:
    cache: object  # KVCache [L, 1, Hkv, S, D] on the device
    last_logits: jax.Array  # [V]
    prompt_len: int
    # prompt logprobs, part by part (cached blocks, then each chunk): (entries, device arrays (logprobs [>= m],
    # top_ids [>= m, K], top_logprobs [>= m, K])), of which the first `entries` belong to the prompt
    prompt: list[tuple[int, tuple]] | None
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache


def _host_copy(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        leaf.copy_to_host_async()


class JaxEngine(Engine):
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        mesh=None,
        cache_dtype: str | None = None,
        **settings: Any,
    ):
        """An engine on `config` (default: EngineConfig()) with `settings` (EngineConfig fields) replaced; the
        model's own settings (model, dtype, quantization) are `loaded`'s, the service's (queue, limits) unused.
        `cache_dtype`: the KV cache's dtype (default: the model's)."""
        cfg = dataclasses.replace(config or EngineConfig(), **settings)
        self.settings = cfg
        self.config = loaded.config
        self.slots = slots = cfg.slots
        self.max_seq_len = max_seq_len = cfg.max_seq_len
        self.steps_per_call = cfg.steps_per_call
        self.vocab_size = loaded.config.vocab_size
        self.top_k_width = MAX_TOP_LOGPROBS
        self.processed_logprobs = cfg.processed_logprobs
        self.shapes = Buckets.of(cfg)
        self.prefill_chunk = self.shapes.chunk
        self.chunk_sizes = self.shapes.chunk_sizes
        self.attend_buckets = self.shapes.attend
        self.batch_buckets = self.shapes.batch
        self.call_steps = self.shapes.call_steps
        scan_layers = cfg.scan_layers
        if scan_layers is None:  # EngineConfig.scan_layers: unrolled layers decode faster on an accelerator
            scan_layers = jax.default_backend() == "cpu"
        self.scan_layers = scan_layers
        module = loaded.module(scan_layers=scan_layers, mesh=mesh)
        self.quantization = loaded.quantization
        self.weight_bytes = tree_nbytes(nnx.state(module, nnx.Param))  # as the programs hold them
        self.graphdef, self.params = nnx.split(module)  # split once; programs merge inside jit
        dtype = jnp.dtype(cache_dtype) if cache_dtype else module.dtype
        self.cache_dtype = dtype
        self.kv_cache_bytes = cache_bytes(loaded.config, slots, max_seq_len, dtype)
        self.mesh = mesh
        self.state = self._place(init_decode_state(loaded.config, slots, max_seq_len, dtype))
        program_cfg = ProgramConfig(K=MAX_TOP_LOGPROBS, chunk=self.prefill_chunk, max_seq_len=max_seq_len,
                                    processed_logprobs=cfg.processed_logprobs,
                                    invariant_rows=INVARIANT_ROWS if jax.default_backend() == "cpu" else 0)  # fmt: skip
        self.prefix_dtype = module.dtype
        self.programs = build_programs(
            self.graphdef, program_cfg, self.config, self.prefix_dtype, self._prefix_sharding()
        )
        self.pool, self.index = None, None
        if cfg.prefix_cache:
            self._init_prefix_cache(cfg.prefix_cache_bytes)
        self.capabilities = Capabilities(
            structured_outputs=True,
            dtype=str(dtype),
            mesh=tuple((str(k), int(v)) for k, v in mesh.shape.items()) if mesh is not None else (),
            weight_bytes=int(self.weight_bytes),
            kv_cache_bytes=int(self.kv_cache_bytes),
            quantization=str(self.quantization or ""),
        )
        # Host bookkeeping, never read back from the device: which slots hold a sample, and an upper bound of
        # each one's length (what the dispatched calls can have written), for the batch and attention buckets.
        self._occupied = np.zeros(slots, bool)
        self._length_bound = np.zeros(slots, np.int64)
        # Structured outputs: each slot's token bitmask for its next token (all ones = free), set by `constrain`.
        self._allowed = np.full((slots, self.mask_words), -1, np.int32)
        self._constrained = np.zeros(slots, bool)
        self._free_masks = self._place_replicated(np.full((slots, self.mask_words), -1, np.int32))
        self._free_row = np.full(self.mask_words, -1, np.int32)
        log.info("weights: %s, quantization %s, %.1f MiB in memory", loaded.model_id, self.quantization,
                 self.weight_bytes / 2**20)  # fmt: skip
        log.info("KV cache: %d slots x %d positions, %s, %.1f MiB", slots, max_seq_len, dtype.name,
                 self.kv_cache_bytes / 2**20)  # fmt: skip

    def _prefix_sharding(self):
        if self.mesh is None:
            return None
        return cache_sharding(self.config, self.mesh, 1, self.max_seq_len, PREFIX_RULES)

    def _init_prefix_cache(self, budget: int | None) -> None:
        C, K = self.prefill_chunk, MAX_TOP_LOGPROBS
        block_bytes = pool_block_bytes(self.config, C, K, self.prefix_dtype)
        if budget is None:  # half the decode KV cache's size, at most a tenth of the device's memory
            budget = min(self.kv_cache_bytes // 2, device_memory_bytes() // 10)
        blocks = budget // block_bytes
        if blocks < 1:
            log.info("prefix cache: off (a %d-byte budget holds no %d-token block of %d bytes)", budget, C,
                     block_bytes)  # fmt: skip
            return
        pool = init_pool(self.config, blocks, C, K, self.prefix_dtype)
        if self.mesh is not None:  # KV split over KV heads like the KV cache; logprobs replicated
            replicated = NamedSharding(self.mesh, PartitionSpec())
            kv = cache_sharding(self.config, self.mesh, blocks, C, PREFIX_RULES)
            pool = jax.device_put(pool, Pool(kv, kv, *(replicated,) * 4))
        self.pool = pool
        self.index = PrefixIndex(blocks, C, block_bytes)
        log.info("prefix cache: %d blocks of %d tokens, %.1f MiB", blocks, C, blocks * block_bytes / 2**20)

    def _place_replicated(self, array):
        if self.mesh is None:
            return jax.device_put(array)
        return jax.device_put(array, NamedSharding(self.mesh, PartitionSpec()))

    def _place(self, state):
        if self.mesh is None:
            return state
        replicated = NamedSharding(self.mesh, PartitionSpec())  # the small per-slot arrays
        kv = cache_sharding(self.config, self.mesh, self.slots, self.max_seq_len)
        shardings = jax.tree.map(lambda _: replicated, state)
        shardings = shardings.replace(cache=type(state.cache)(kv, kv))
        return jax.device_put(state, shardings)

    # -- Engine API ---------------------------------------------------------------------------------------------
    def prefill_steps(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Generator[Prefix | None, None, None]:
        """Dispatch the prompt chunk by chunk: each `next()` queues one chunk (None) until the last yields the
        Prefix. Chunks start at multiples of C; leading blocks found in the prefix cache are loaded instead of
        computed (never the last token's: its logits are needed), and each full block computed is cached."""
        n = len(tokens)
        if not 0 < n <= self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens: must be 1..{self.max_seq_len}")
        C, p, index = self.prefill_chunk, self.programs, self.index
        keys = index.keys(tokens, cache_salt) if index is not None else []
        hits = index.lookup(keys[: (n - 1) // C], n, want_prompt_logprobs) if index is not None else []
        try:
            padded = np.zeros(-(-n // C) * C + 1, np.int32)  # + 1: the target after the last position
            padded[:n] = tokens
            prompt = [] if want_prompt_logprobs else None
            if hits:
                blocks = np.zeros(self.max_seq_len // C, np.int32)
                blocks[: len(hits)] = [b.id for b in hits]
                cache = p.load(self.pool, blocks, np.int32(len(hits)))
                if want_prompt_logprobs:
                    targets = np.zeros_like(blocks)
                    targets[: len(hits)] = padded[C : (len(hits) + 1) * C : C]
                    prompt.append((len(hits) * C, p.cached_logprobs(self.pool, blocks, targets)))
            else:
                cache = p.fresh()
            for start, real, size, attend in self.chunk_plan(n, len(hits) * C):
                chunk = np.zeros(size, np.int32)
                chunk[:real] = padded[start : start + real]
                cache, hidden = p.chunk(self.params, cache, chunk, np.int32(start), attend_len=attend)
                lp = None
                if want_prompt_logprobs:
                    targets = np.zeros(size, np.int32)
                    targets[:real] = padded[start + 1 : start + real + 1]
                    lp = p.chunk_logprobs(self.params, hidden, targets)
                    prompt.append((real, lp[:3]))
                if real == C and index is not None:
                    self._cache_block(keys[start // C], cache, start, lp)
                if start + C < n:
                    yield None
            last_logits = p.last_logits(self.params, hidden, np.int32(real - 1))
            if prompt is not None:
                _host_copy([arrays for _, arrays in prompt])
            yield Prefix(cache, last_logits, n, prompt, cached_tokens=len(hits) * C)
        finally:
            if index is not None:
                index.unpin(hits)

    def _cache_block(self, key: bytes, cache, start: int, lp) -> None:
        """Keep a just-computed full block: its KV (when new) and its prompt logprobs (when computed and not yet
        kept). Dispatched in order, so a later request's load reads what these stores wrote."""
        block = self.index.get(key)
        if block is None:
            block = self.index.add(key, logprobs=lp is not None)
            if block is None:  # every block pinned: served without caching
                return
            self.pool = self.programs.store(self.pool, cache, np.int32(start), np.int32(block.id))
        elif lp is None or block.logprobs:
            return
        if lp is not None:
            self.pool = self.programs.store_logprobs(self.pool, np.int32(block.id), lp)
            block.logprobs = True

    def prefill(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Prefix:
        *_, prefix = self.prefill_steps(tokens, want_prompt_logprobs, cache_salt)
        return prefix

    def together_shapes(self) -> list[tuple[int, int]]:
        """(rows, padded size) of every `chunk_together` program (Buckets.together_shapes); none on a mesh
        (prompts go one by one)."""
        return [] if self.mesh is not None else self.shapes.together_shapes()

    def prefill_together(
        self, prompts: list[list[int]], cache_salts: list[str | None] | None = None
    ) -> list[Prefix]:
        """Prompts shorter than C grouped by padded size, up to C // size a program (`together_shapes`); a
        group of one, and any prompt on a mesh, is prefilled alone. Each prefix equals `prefill`'s (tested).
        The salts do not matter here: a prompt shorter than C has no block to share."""
        C, prefixes = self.prefill_chunk, [None] * len(prompts)
        salts = cache_salts or [None] * len(prompts)
        if any(not 0 < len(tokens) < C for tokens in prompts):
            raise ValueError(f"prefill_together takes prompts of 1..{C - 1} tokens")
        groups: dict[int, list[int]] = {}
        for i, tokens in enumerate(prompts):
            groups.setdefault(bucket_for(len(tokens), self.chunk_sizes), []).append(i)
        shapes = self.together_shapes()
        for size, members in groups.items():
            row_buckets = [rows for rows, s in shapes if s == size]
            most = row_buckets[-1] if row_buckets else 1
            for first in range(0, len(members), most):
                group = members[first : first + most]
                if len(group) == 1:
                    prefixes[group[0]] = self.prefill(prompts[group[0]], cache_salt=salts[group[0]])
                    continue
                rows = bucket_for(len(group), row_buckets)
                tokens, last = np.zeros((rows, size), np.int32), np.zeros(rows, np.int32)
                for r, i in enumerate(group):
                    tokens[r, : len(prompts[i])] = prompts[i]
                    last[r] = len(prompts[i]) - 1
                    if self.index is not None:  # counted as looked up, as `prefill` does (no full block)
                        self.index.lookup([], len(prompts[i]), False)
                attend = bucket_for(min(size, self.max_seq_len), self.attend_buckets)
                caches, logits = self.programs.chunk_together(self.params, tokens, last, attend_len=attend)
                for r, i in enumerate(group):
                    prefixes[i] = Prefix(caches[r], logits[r], len(prompts[i]), None)
        return prefixes

    def prefill_cost(self, prompt_len: int) -> int:
        # the first chunk's padded size
        return bucket_for(min(prompt_len, self.prefill_chunk), self.chunk_sizes)

    def cached_tokens(self, prefix: Prefix) -> int:
        return prefix.cached_tokens

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.index.stats() if self.index is not None else None

    def prompt_logprobs(self, prefix: Prefix) -> PromptLogprobs | None:
        if prefix.prompt is None:
            return None
        parts = [[np.asarray(a)[:count] for a in arrays] for count, arrays in prefix.prompt]
        chosen, top_ids, top_vals = (np.concatenate([part[i] for part in parts]) for i in range(3))
        n = prefix.prompt_len - 1
        return PromptLogprobs(chosen[:n], top_ids[:n], top_vals[:n])

    def start_insert(
        self, prefix: Prefix, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> Pending[TokenOut]:
        one = slot_sampling(params)  # ValueError for a bad seed or too many stop ids, before anything runs
        row = self._free_row if allowed is None else self._mask_row(allowed)
        self.state, (out, done) = self.programs.insert(
            self.state,
            prefix.cache,
            prefix.last_logits,
            np.int32(slot),
            np.int32(prefix.prompt_len),
            one,
            row,
        )
        _host_copy((out, done))
        self._occupied[slot] = True
        self._length_bound[slot] = prefix.prompt_len

        def read() -> TokenOut:
            token_id, lp, top_ids, top_vals = (np.asarray(a) for a in out)
            return TokenOut(int(token_id), float(lp), top_ids, top_vals, bool(done))

        return Pending(read)

    def insert(
        self, prefix: Prefix, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> TokenOut:
        return self.start_insert(prefix, slot, params, allowed).result()

    def _mask_row(self, allowed: np.ndarray) -> np.ndarray:
        row = np.asarray(allowed, np.int32).reshape(-1)
        if row.shape != (self.mask_words,):
            raise ValueError(f"a token bitmask has {self.mask_words} int32 words, got {row.shape}")
        return row

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self._allowed[slot] = self._free_row if allowed is None else self._mask_row(allowed)
        self._constrained[slot] = allowed is not None

    def buckets(self) -> tuple[int, int, int]:
        """(attend_len, batch, steps) of the next decode call: they cover every occupied slot for its steps."""
        live = np.flatnonzero(self._occupied)
        longest = int(self._length_bound[live].max()) if live.size else 0
        batch = bucket_for(int(live.max()) + 1 if live.size else 1, self.batch_buckets)
        steps = self.call_steps[batch]
        attend = bucket_for(min(longest + steps, self.max_seq_len), self.attend_buckets)
        return attend, batch, steps

    def next_call_steps(self) -> int:
        # a constrained row needs the host (its next mask) after every token: the call makes one step
        return 1 if self._constrained[self._occupied].any() else self.buckets()[2]

    def start_decode(self) -> Pending[StepArrays]:
        attend, batch, steps = self.buckets()
        steps_now = self.next_call_steps()
        masks = self._free_masks
        if self._constrained[self._occupied].any():
            # a copy (a CPU device may alias host memory), put without a program (jnp.asarray compiles one)
            masks = self._place_replicated(self._allowed.copy())
        self.state, (out, valid, done) = self.programs.decode(
            self.params, self.state, masks, np.int32(steps_now), attend_len=attend, batch=batch, steps=steps
        )
        _host_copy((out, valid, done))
        self._length_bound[self._occupied] += steps_now

        def read() -> StepArrays:
            ids, lps, top_ids, top_vals = (self._pad(np.asarray(a)) for a in out)
            return StepArrays(
                ids, lps, top_ids, top_vals, self._pad(np.asarray(valid)), self._pad(np.asarray(done))
            )

        return Pending(read)

    def decode(self) -> StepArrays:
        return self.start_decode().result()

    def _pad(self, a: np.ndarray) -> np.ndarray:
        """[N, batch, ...] -> [N, slots, ...]: slots past the batch bucket were not run (valid/done False)."""
        if a.shape[1] == self.slots:
            return a
        out = np.zeros((a.shape[0], self.slots) + a.shape[2:], a.dtype)
        out[:, : a.shape[1]] = a
        return out

    @property
    def occupied_slots(self) -> list[int]:
        """Slots holding a sample (inserted, not yet released)."""
        return np.flatnonzero(self._occupied).tolist()

    def release(self, slot: int) -> None:
        self.state = self.programs.release(self.state, np.int32(slot))
        self._occupied[slot] = False
        self._length_bound[slot] = 0
        self.constrain(slot, None)

    # -- start-up -----------------------------------------------------------------------------------------------
    def chunk_plan(self, n: int, first: int = 0) -> list[tuple[int, int, int, int]]:
        return self.shapes.chunk_plan(n, first)

    def warm_up(
        self, prompt_logprobs: bool = True, progress: Callable[[int, int, str, float], None] | None = None
    ) -> None:
        """Compile every program the serving loop can call (sampler/warmup.py); leaves all slots free.
        `progress(k, n, stage, seconds)` is called after each stage."""
        warmup.run(self, prompt_logprobs, progress)

    def _forget_slots(self) -> None:
        """Every slot free in the host's bookkeeping (after warm-up, whose programs ran on slot 0 or none)."""
        self._occupied[:] = False
        self._length_bound[:] = 0

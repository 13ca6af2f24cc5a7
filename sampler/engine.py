"""JaxEngine: the real engine behind `sampler.api.Engine` — continuous batching over B slots with static shapes.

Keys and values live in one pool of pages (model/llama.py) shared by every slot; the host hands pages out
(sampler/pages.py): a prompt takes its pages when its prefill starts (the service admits it when they are there,
`admits`), a decode call takes the pages its steps will fill, and a released slot lets its pages go. Full prompt
pages are named and shared by the prefix cache. When running sequences need a page and none is left, the one
inserted last is moved to host memory (its pages copied out, exactly) and paused; it comes back, bit for bit,
before any new request starts.

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
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tpuserve.model.config import ModelLoadError
from tpuserve.model.llama import cache_bytes, init_pages, pool_pages
from tpuserve.model.loader import LoadedModel, from_arrays, load_model, weights_mismatch
from tpuserve.model.quant import tree_nbytes
from tpuserve.model.sharding import cache_sharding
from tpuserve.sampler import warmup
from tpuserve.sampler.api import (
    MAX_TOP_LOGPROBS,
    Capabilities,
    Engine,
    PageStats,
    Pending,
    PrefixCacheStats,
    PromptLogprobs,
    SlotParams,
    StepArrays,
    TokenOut,
)
from tpuserve.sampler.buckets import SHARED_CHUNK, Buckets, bucket_for
from tpuserve.sampler.config import EngineConfig
from tpuserve.sampler.pages import PageLogprobs, Pages, PromptParts
from tpuserve.sampler.programs import (
    SWAP_PAGES,
    Pool,
    ProgramConfig,
    build_programs,
    resolve_decode_attention,
)
from tpuserve.sampler.state import init_decode_state, slot_sampling

log = logging.getLogger(__name__)

# XLA:CPU rounds a decode step's norms, rotary embedding, softmax and sampling of 2 or 4 rows differently from 8 or
# more (its products are the same from 2 rows up): smaller buckets run those on 8 rows (ProgramConfig).
INVARIANT_ROWS = 8
# Rows that need an attended length at most 1/SPLIT_ATTEND of the longest row's decode in a call of their own: a
# second call costs its weight products again (tens of milliseconds a step here), while attending 64 rows over
# 4x the positions they need costs more from about 512 positions on (measured per layer: 64 rows x 128
# positions 2 ms, x 1024 44 ms).
SPLIT_ATTEND = 4
# The pool's default size (EngineConfig.kv_cache_bytes): a share of the device's memory.
CPU_KV_SHARE = 1 / 16  # of a CPU host's RAM, which everything else shares too
ACCELERATOR_KV_SHARE = 0.8  # of what the weights leave on an accelerator


def device_memory_bytes() -> int:
    """This process's first device's memory (its allocator's limit), or the host's RAM for a CPU device."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(eq=False)
class Prefix:
    """A prefilled prompt: the pages holding its keys and values (held until the prefix is let go), the last
    token's logits, and its prompt logprobs when asked for."""

    pages: list[int]
    last_logits: jax.Array  # [V]
    prompt_len: int
    prompt: PromptParts | None
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache


class NoRoom(RuntimeError):
    """The pool has no room for a prompt's pages now (the service asks `admits` first)."""


@dataclass
class Paused:
    """A sequence moved out of the pool: its pages' keys and values on the host, SWAP_PAGES at a time."""

    pages: int
    kv: list[tuple[np.ndarray, np.ndarray]]


def _host_copy(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):  # a cached page's logprobs are on the host already
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
        if cfg.max_seq_len is None:  # the model's trained context
            cfg = dataclasses.replace(cfg, max_seq_len=loaded.config.max_position_embeddings)
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
        self.mesh = mesh
        # the pool of pages
        self.page = page = cfg.kv_page_size
        self.max_pages = -(-max_seq_len // page)  # a page table's width
        page_bytes = cache_bytes(loaded.config, 1, page, dtype)
        total = cfg.kv_pages
        if total is None:
            budget = cfg.kv_cache_bytes
            if budget is None:
                memory = device_memory_bytes()
                if jax.default_backend() == "cpu":
                    budget = int(memory * CPU_KV_SHARE)
                else:  # the mesh's memory beside the weights (a pool replicated over devices overcounts)
                    devices = mesh.size if mesh is not None else 1
                    budget = int((memory * devices - self.weight_bytes) * ACCELERATOR_KV_SHARE)
            # never more than every slot could fill, and a prompt being prefilled beside them
            total = min(budget // page_bytes, (slots + 1) * self.max_pages)
        if total < 2:
            raise ValueError(f"a KV pool of {total} pages of {page} positions holds no sequence")
        self.kv_cache_bytes = (total + 1) * page_bytes
        self.pool = self._place_pool(Pool(*init_pages(loaded.config, total + 1, page, dtype)))
        shared = cfg.prefix_cache and self.shapes.small_prompt < max_seq_len
        if cfg.prefix_cache and not shared:
            log.info("prefix cache: off (prefill_chunk %d < %d: no chunk computes a page as any other would)",
                     self.prefill_chunk, SHARED_CHUNK)  # fmt: skip
        self.pages = Pages(total, page, page_bytes, prefix_cache=shared)
        # each slot's pages in position order ([slots, max_pages], 0 = none), on the host; its device copy is
        # put again when it changed
        # row `slots` is the scratch row: a decode call's padding entries name it (inactive, no pages)
        self.table = np.zeros((slots + 1, self.max_pages), np.int32)
        self._table_device = None
        self._slot_pages: list[list[int]] = [[] for _ in range(slots)]
        self._paused: dict[int, Paused] = {}  # slot -> its sequence on the host, oldest first
        self._paused_device = None
        self._inserted = np.zeros(slots, np.int64)  # when each slot's sample came in (preempted: the latest)
        self._insertions = 0
        self.state = self._place_replicated(init_decode_state(slots + 1))
        self.invariant_rows = INVARIANT_ROWS if jax.default_backend() == "cpu" else 0
        program_cfg = ProgramConfig(K=MAX_TOP_LOGPROBS, chunk=self.prefill_chunk, max_seq_len=max_seq_len,
                                    processed_logprobs=cfg.processed_logprobs, invariant_rows=self.invariant_rows,
                                    decode_attention=resolve_decode_attention(cfg.decode_attention),
                                    mesh=mesh, rescore_exact=cfg.rescore_exact)  # fmt: skip
        self.programs = build_programs(self.graphdef, program_cfg)
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
        self._allowed = np.full((slots + 1, self.mask_words), -1, np.int32)
        self._constrained = np.zeros(slots, bool)
        self._free_masks = self._place_replicated(np.full((slots + 1, self.mask_words), -1, np.int32))
        self._free_row = np.full(self.mask_words, -1, np.int32)
        log.info("weights: %s, quantization %s, %.1f MiB in memory", loaded.model_id, self.quantization,
                 self.weight_bytes / 2**20)  # fmt: skip
        log.info("KV cache: %d pages of %d positions (%d tokens), %s, %.1f MiB; %d slots x up to %d positions",
                 total, page, total * page, dtype.name, self.kv_cache_bytes / 2**20, slots, max_seq_len)  # fmt: skip

    @property
    def max_prompt_len(self) -> int:
        # a prompt must fit the pool beside one page for its first sample's own last page
        return min(self.max_seq_len, (self.pages.total - 1) * self.page)

    def _place_pool(self, pool: Pool) -> Pool:
        if self.mesh is None:
            return jax.device_put(pool)
        kv = cache_sharding(self.config, self.mesh, pool_pages(pool.k), self.page)  # split over KV heads
        return jax.device_put(pool, Pool(kv, kv))

    def _place_replicated(self, array):
        if self.mesh is None:
            return jax.device_put(array)
        return jax.device_put(array, NamedSharding(self.mesh, PartitionSpec()))

    # -- Engine API ---------------------------------------------------------------------------------------------
    def prefill_steps(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> Generator[Prefix | None, None, None]:
        """Take the prompt's pages now (leading pages found in the prefix cache are shared, never the last
        token's: its logits are needed), then dispatch the rest chunk by chunk: each `next()` queues one chunk
        (None) until the last yields the Prefix. After a cache hit the first chunk starts one position early and
        writes nothing there: that position's logits give the first uncached token's logprob. Each full page
        computed is named in the prefix cache. NoRoom when the pool cannot hold the prompt now."""
        n, page, pages = len(tokens), self.page, self.pages
        if not 0 < n <= self.max_prompt_len:
            raise ValueError(f"prompt of {n} tokens: must be 1..{self.max_prompt_len}")
        keys = self._page_keys(tokens, cache_salt)
        hits = pages.lookup(keys[: (n - 1) // page], n, want_prompt_logprobs) if pages.prefix_cache else []
        own = pages.allocate(-(-n // page) - len(hits))
        if own is None:
            pages.let_go([h.id for h in hits])
            raise NoRoom(
                f"no room for a prompt of {n} tokens: {pages.available()} of {pages.total} pages free"
            )
        steps = self._prefill_chunks(tokens, [h.id for h in hits] + own, hits, keys, want_prompt_logprobs)
        next(steps)  # started: closing it from now on lets go of the pages
        return steps

    def _prefill_chunks(self, tokens, row: list[int], hits, keys, want: bool):
        n, page, p, pages = len(tokens), self.page, self.programs, self.pages
        done = False
        pages.computing(keys[len(hits) :], want)
        try:
            yield None  # the start (`prefill_steps`)
            table = np.zeros(self.max_pages, np.int32)
            table[: len(row)] = row
            table = self._place_replicated(table)
            cached = len(hits) * page
            padded = np.zeros(n + self.prefill_chunk + 1, np.int32)  # + 1: the target after the last position
            padded[:n] = tokens
            parts: list[tuple[int, tuple]] | None = [] if want else None
            if hits and want:  # the cached pages' logprobs of their own tokens; the very first token has none
                entries = [h.logprobs.entries(page) for h in hits]
                parts.append(
                    (cached - 1, tuple(np.concatenate([e[i] for e in entries])[1:] for i in range(3)))
                )
            first = cached - 1 if hits else 0
            for start, real, size, attend in self.chunk_plan(n, first):
                chunk = np.zeros(size, np.int32)
                chunk[:real] = padded[start : start + real]
                self.pool, hidden = p.chunk(self.params, self.pool, chunk, np.int32(start), table, np.int32(cached),
                                            attend_len=attend)  # fmt: skip
                if want:
                    targets = np.zeros(size, np.int32)
                    targets[:real] = padded[start + 1 : start + real + 1]
                    parts.append((real, p.chunk_logprobs(self.params, hidden, targets)))
                if start + real < n:
                    yield None
            last_logits = p.last_logits(self.params, hidden, np.int32(real - 1))
            prompt = None
            if parts is not None:
                _host_copy([arrays for _, arrays in parts])
                prompt = PromptParts(parts)
            for i in range(len(hits), len(keys)):  # the full pages computed now
                pages.register(keys[i], row[i], PageLogprobs(prompt, i) if prompt is not None else None)
            prefix = Prefix(row, last_logits, n, prompt, cached_tokens=cached)
            weakref.finalize(prefix, pages.let_go, row)
            done = True
            yield prefix
        finally:
            pages.computed(keys[len(hits) :], want)
            if not done:  # closed early or failed: nobody will read these pages
                pages.let_go(row)

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
        group of one, any prompt whose pages can be shared, and any prompt on a mesh, is prefilled alone. Each
        prefix equals `prefill`'s (tested)."""
        C, prefixes = self.prefill_chunk, [None] * len(prompts)
        salts = cache_salts or [None] * len(prompts)
        if any(not 0 < len(tokens) < C for tokens in prompts):
            raise ValueError(f"prefill_together takes prompts of 1..{C - 1} tokens")
        groups: dict[int, list[int]] = {}
        for i, tokens in enumerate(prompts):
            if len(tokens) > self.shapes.small_prompt:  # its pages may be shared: its own chunks
                prefixes[i] = self.prefill(tokens, cache_salt=salts[i])
                continue
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
                tables = np.zeros((rows, self.max_pages), np.int32)
                held = []
                for r, i in enumerate(group):
                    n = len(prompts[i])
                    own = self.pages.allocate(-(-n // self.page))
                    if own is None:
                        for pages in held:
                            self.pages.let_go(pages)
                        raise NoRoom(f"no room for {len(group)} prompts of up to {size} tokens")
                    held.append(own)
                    tokens[r, :n] = prompts[i]
                    last[r] = n - 1
                    tables[r, : len(own)] = own
                    if self.pages.prefix_cache:  # counted as looked up, as `prefill` does (nothing to share)
                        self.pages.lookup([], n, False)
                attend = bucket_for(min(size, self.max_seq_len), self.attend_buckets)
                self.pool, logits = self.programs.chunk_together(
                    self.params, self.pool, tokens, last, self._place_replicated(tables), attend_len=attend
                )
                for r, i in enumerate(group):
                    prefixes[i] = Prefix(held[r], logits[r], len(prompts[i]), None)
                    weakref.finalize(prefixes[i], self.pages.let_go, held[r])
        return prefixes

    def prefill_cost(self, prompt_len: int) -> int:
        # the first chunk's padded size
        return self.chunk_plan(prompt_len)[0][2]

    def cached_tokens(self, prefix: Prefix) -> int:
        return prefix.cached_tokens

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.pages.prefix_stats() if self.pages.prefix_cache else None

    def page_stats(self) -> PageStats:
        return self.pages.stats()

    def awaits_prefill(
        self, tokens: Sequence[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> bool:
        """Whether a prefill in progress is computing this prompt's next uncached pages (`Pages.awaits`): several
        prompts of one context arriving together (an eval harness's continuations) then compute it once."""
        if not self.pages.in_progress():  # the common case: no prompt hashed twice on the way in
            return False
        # the pages `prefill_steps` looks up
        keys = self._page_keys(tokens, cache_salt)[: (len(tokens) - 1) // self.page]
        return self.pages.awaits(keys, want_prompt_logprobs)

    def _page_keys(self, tokens: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The names of the prompt's full pages; none for a prompt too short to share (`small_prompt`), or with the
        prefix cache off."""
        return self.pages.keys(tokens, cache_salt) if len(tokens) > self.shapes.small_prompt else []

    def admits(self, prompt_len: int, samples: int) -> bool:
        """Room for the prompt's pages and each sample's own last page, with a page to spare for each running
        sequence's next call; none while a paused sequence waits to come back."""
        if self._paused:
            return False
        need = -(-prompt_len // self.page) + samples + int(self._occupied.sum())
        return need <= self.pages.available()

    def prompt_logprobs(self, prefix: Prefix) -> PromptLogprobs | None:
        if prefix.prompt is None:
            return None
        chosen, top_ids, top_vals = prefix.prompt.arrays()
        n = prefix.prompt_len - 1
        return PromptLogprobs(chosen[:n], top_ids[:n], top_vals[:n])

    def start_insert(
        self, prefix: Prefix, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> Pending[TokenOut]:
        """The slot reads the prefix's pages, but for a last page the prompt does not fill: decode writes there,
        so the slot gets its own copy (several samples of one prompt write different tokens)."""
        one = slot_sampling(params)  # ValueError for a bad seed or too many stop ids, before anything runs
        row = self._free_row if allowed is None else self._mask_row(allowed)
        pages = list(prefix.pages)
        if prefix.prompt_len % self.page:
            (own,) = self._allocate(1)  # the slot is not running yet: never paused for itself
            self.pool = self.programs.copy_page(self.pool, np.int32(pages[-1]), np.int32(own))
            self.pages.hold(pages[:-1])
            pages[-1] = own
        else:
            self.pages.hold(pages)
        self._set_pages(slot, pages)
        self.state, (out, done) = self.programs.insert(
            self.state, prefix.last_logits, np.int32(slot), np.int32(prefix.prompt_len), one, row
        )
        _host_copy((out, done))
        self._occupied[slot] = True
        self._length_bound[slot] = prefix.prompt_len
        self._insertions += 1
        self._inserted[slot] = self._insertions

        def read() -> TokenOut:
            token_id, lp, top_ids, top_vals = (np.asarray(a) for a in out)
            return TokenOut(int(token_id), float(lp), top_ids, top_vals, bool(done))

        return Pending(read)

    def insert(
        self, prefix: Prefix, slot: int, params: SlotParams, allowed: np.ndarray | None = None
    ) -> TokenOut:
        return self.start_insert(prefix, slot, params, allowed).result()

    # -- pages of the slots ---------------------------------------------------------------------------------
    def _set_pages(self, slot: int, pages: list[int]) -> None:
        self._slot_pages[slot] = pages
        self.table[slot] = 0
        self.table[slot, : len(pages)] = pages
        self._table_device = None

    def _allocate(self, n: int, keep: int | None = None) -> list[int] | None:
        """n pages; while there are not enough, the running sequence inserted last other than `keep` is paused
        to make room, and `keep` itself when no other runs (pages held by prompts being prefilled or waiting for
        their insert come back when those sequences end): then None. NoRoom when nothing is left to pause."""
        while (got := self.pages.allocate(n)) is None:
            running = [s for s in self._running() if s != keep]
            if running:
                self._pause(max(running, key=lambda s: self._inserted[s]))
            elif keep is not None and keep in self._running():
                self._pause(keep)
                return None
            else:
                raise NoRoom(f"no room for {n} pages: {self.pages.available()} of {self.pages.total} free")
        return got

    def _pause(self, slot: int) -> None:
        """Copy the slot's pages to the host and let them go; the slot makes no tokens until `_resume`."""
        pages = self._slot_pages[slot]
        kv = []
        for i in range(0, len(pages), SWAP_PAGES):
            ids = np.zeros(SWAP_PAGES, np.int32)
            part = pages[i : i + SWAP_PAGES]
            ids[: len(part)] = part
            k, v = self.programs.swap_out(self.pool, ids)
            kv.append((np.asarray(k), np.asarray(v)))
        self._paused[slot] = Paused(len(pages), kv)
        self.pages.let_go(pages)
        self._set_pages(slot, [])
        self.pages.preemptions += 1
        self._paused_device = None
        log.info("paused slot %d (%d pages to host memory): the pool is full", slot, len(pages))

    def _resume(self, slot: int) -> None:
        paused = self._paused.pop(slot)
        pages = self.pages.allocate(paused.pages)
        assert pages is not None
        beyond = pool_pages(self.pool.k)  # past the pool: skipped
        for i, (k, v) in zip(range(0, paused.pages, SWAP_PAGES), paused.kv):
            ids = np.full(SWAP_PAGES, beyond, np.int32)
            part = pages[i : i + SWAP_PAGES]
            ids[: len(part)] = part
            self.pool = self.programs.swap_in(self.pool, ids, k, v)
        self._set_pages(slot, pages)
        self._paused_device = None

    def _make_room(self, steps: int) -> None:
        """Before a decode call: paused sequences come back while there is room for them (oldest first), then
        each running one gets the pages its next `steps` tokens fill (pausing the latest when there are none)."""
        for slot in list(self._paused):
            bound = min(int(self._length_bound[slot]) + steps, self.max_seq_len)
            need = max(self._paused[slot].pages, -(-bound // self.page))
            if need + 1 > self.pages.available():
                break
            self._resume(slot)
        for slot in sorted(np.flatnonzero(self._occupied), key=lambda s: self._inserted[s]):
            if slot in self._paused:
                continue
            bound = min(int(self._length_bound[slot]) + steps, self.max_seq_len)
            missing = -(-bound // self.page) - len(self._slot_pages[slot])
            if missing > 0:
                got = self._allocate(missing, keep=slot)
                if got is not None:  # None: paused itself, nothing else to pause
                    self._set_pages(slot, self._slot_pages[slot] + got)

    def _mask_row(self, allowed: np.ndarray) -> np.ndarray:
        row = np.asarray(allowed, np.int32).reshape(-1)
        if row.shape != (self.mask_words,):
            raise ValueError(f"a token bitmask has {self.mask_words} int32 words, got {row.shape}")
        return row

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self._allowed[slot] = self._free_row if allowed is None else self._mask_row(allowed)
        self._constrained[slot] = allowed is not None

    def _running(self) -> list[int]:
        """Occupied slots not paused, in slot order."""
        return [int(s) for s in np.flatnonzero(self._occupied) if s not in self._paused]

    def buckets(self) -> tuple[int, int, int]:
        """(attend_len, batch, steps) of the next decode call over every running slot: the batch bucket covers
        their count, the attended length their longest sequence after the call's steps."""
        running = self._running()
        longest = int(self._length_bound[running].max()) if running else 0
        batch = bucket_for(max(len(running), 1), self.batch_buckets)
        steps = self.call_steps[batch]
        attend = bucket_for(min(longest + steps, self.max_seq_len), self.attend_buckets)
        return attend, batch, steps

    def _groups(self) -> list[tuple[list[int], int, int, int]]:
        """(slots, attend_len, batch, steps) of each call of the next decode: one over every running slot, or,
        when some need an attended length at least SPLIT_ATTEND times the others', the others in a call of their
        own (a long sequence would make every row of one call attend its length). A row's results are the same
        in either (decode_program)."""
        attend, batch, steps = self.buckets()
        running = self._running()
        need = {s: bucket_for(min(int(self._length_bound[s]) + steps, self.max_seq_len), self.attend_buckets)
                for s in running}  # fmt: skip
        short = [s for s in running if need[s] * SPLIT_ATTEND <= attend]
        if not short or len(short) == len(running):
            return [(running, attend, batch, steps)]
        groups = []
        for part in (short, [s for s in running if need[s] * SPLIT_ATTEND > attend]):
            b = bucket_for(len(part), self.batch_buckets)
            groups.append((part, max(need[s] for s in part), b, self.call_steps[b]))
        return groups

    def next_call_steps(self) -> int:
        # a constrained row needs the host (its next mask) after every token: the call makes one step
        if self._constrained[self._occupied].any():
            return 1
        return min(steps for _, _, _, steps in self._groups())

    def start_decode(self, max_steps: int | None = None) -> Pending[StepArrays]:
        # steps_now is an input of the decode programs, not a shape: a shorter call compiles nothing
        steps_now = self.next_call_steps()
        if max_steps is not None:
            steps_now = max(1, min(steps_now, max_steps))
        self._make_room(steps_now)
        masks = self._free_masks
        if self._constrained[self._occupied].any():
            # a copy (a CPU device may alias host memory), put without a program (jnp.asarray compiles one)
            masks = self._place_replicated(self._allowed.copy())
        if self._table_device is None:
            self._table_device = self._place_replicated(self.table.copy())
        if self._paused_device is None:
            paused = np.zeros(self.slots + 1, bool)
            paused[list(self._paused)] = True
            self._paused_device = self._place_replicated(paused)
        calls = []
        for slots, attend, batch, steps in self._groups():
            rows = np.full(max(batch, self.invariant_rows), self.slots, np.int32)  # the scratch row pads
            rows[: len(slots)] = slots
            self.state, self.pool, out = self.programs.decode(
                self.params, self.state, self.pool, self._table_device, self._paused_device, masks, rows,
                np.int32(steps_now), attend_len=attend, batch=batch, steps=steps,
            )  # fmt: skip
            _host_copy(out)
            calls.append((slots, out))
        self._length_bound[self._running()] += steps_now

        def read() -> StepArrays:
            n = max(out[0].ids.shape[0] for _, out in calls)
            full = None
            for slots, (tokens, valid, done) in calls:
                arrays = [np.asarray(a) for a in (*tokens, valid, done)]
                if full is None:
                    full = [np.zeros((n, self.slots, *a.shape[2:]), a.dtype) for a in arrays]
                for dst, src in zip(full, arrays, strict=True):
                    dst[: src.shape[0], slots] = src[:, : len(slots)]
            return StepArrays(*full)

        return Pending(read)

    def decode(self) -> StepArrays:
        return self.start_decode().result()

    @property
    def occupied_slots(self) -> list[int]:
        """Slots holding a sample (inserted, not yet released)."""
        return np.flatnonzero(self._occupied).tolist()

    def release(self, slot: int) -> None:
        self.state = self.programs.release(self.state, np.int32(slot))
        self._occupied[slot] = False
        self._length_bound[slot] = 0
        if self._paused.pop(slot, None) is not None:
            self._paused_device = None
        self.pages.let_go(self._slot_pages[slot])
        self._set_pages(slot, [])
        self.constrain(slot, None)

    # -- weights ------------------------------------------------------------------------------------------------
    def load_weights(self, path: str) -> Any:
        loaded = load_model(path, dtype=self.settings.dtype, mesh=self.mesh, with_tokenizer=False,
                            quantization=self.quantization)  # fmt: skip
        return self._served_form(loaded, str(path))

    def weights_from_arrays(self, params: dict[str, Any]) -> Any:
        # the trainer's arrays leave its devices for the host only where quantization needs it (from_arrays)
        loaded = from_arrays(self.config, params, dtype=self.settings.dtype, mesh=self.mesh,
                             quantization=self.quantization)  # fmt: skip
        return self._served_form(loaded, "the arrays")

    def _served_form(self, loaded: LoadedModel, source: str) -> Any:
        """The module parameters of `loaded` as the programs take the served ones, or ModelLoadError naming the
        first thing that differs (then the programs would compute another model, or compile again)."""
        _, params = nnx.split(loaded.module(scan_layers=self.scan_layers, mesh=self.mesh))
        old_leaves = jax.tree_util.tree_flatten_with_path(self.params)[0]
        new_leaves, new_def = jax.tree_util.tree_flatten_with_path(params)
        if new_def != jax.tree.structure(self.params):
            old_names = {jax.tree_util.keystr(k) for k, _ in old_leaves}
            new_names = {jax.tree_util.keystr(k) for k, _ in new_leaves}
            diff = sorted(old_names ^ new_names) or sorted(new_names)
            raise ModelLoadError(f"{source}: its parameters are not the served ones' (first: {diff[0]})")
        placed = []
        for (key, old), (_, new) in zip(old_leaves, new_leaves, strict=True):
            if (old.shape, old.dtype) != (new.shape, new.dtype):
                raise ModelLoadError(f"{source}: parameter {jax.tree_util.keystr(key)} is {new.dtype}"
                                     f"{list(new.shape)}, the served one {old.dtype}{list(old.shape)}")  # fmt: skip
            # the served arrays' own placement: the programs then take the new ones without compiling again
            placed.append(new if new.sharding == old.sharding else jax.device_put(new, old.sharding))
        # fields no array shows (RoPE base, norms' epsilon, ...)
        why = weights_mismatch(self.config, loaded.config)
        if why is not None:
            raise ModelLoadError(f"{source}: {why}")
        return jax.tree.unflatten(new_def, placed)

    def swap_weights(self, weights: Any, version: str) -> None:
        if self._occupied.any():
            raise RuntimeError("swap_weights with sequences in the engine's slots")
        self.params = weights
        self.weight_version = version
        self.pages.forget_cache(reset_counts=False)  # their keys and values are the old weights'
        log.info("weights swapped: serving version %r", version)

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

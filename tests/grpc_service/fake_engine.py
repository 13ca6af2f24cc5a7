"""A fake Engine with hand-computable outputs, for driving the orchestrator and the gRPC service.

Sample tokens come from `scripts[prompt]` or `script(prompt, seed)` (a list of ids, EOS after its end); by
default token j of a sample is `pool[(seed + j) % len(pool)]`. Logprob of generated token j: -0.25 * (j % 4 + 1); alternative k (k = 0 is the
sampled token): id (token + k) % vocab, logprob `logprob - k / 2`. Prompt token j (j >= 1): logprob -j / 8,
alternative k: id (token + k) % vocab, logprob -j / 8 - k / 2.

Prefix cache (host-only, no KV): a finished prefill stores its prompt's full blocks of BLOCK tokens under its
cache_salt; a later prompt of the same salt gets `cached_tokens` = BLOCK x its leading blocks stored, at most
len - 1 tokens (the last one is always computed): the longest common prefix with an earlier prompt of that salt,
rounded down to a block. Each stored block counts BLOCK_BYTES; over `prefix_cache_bytes` the least recently
used blocks are evicted. Outputs never depend on the cache (the real engine's promise).

Pages: `page_stats()` is `self.pages`, None (no paged KV cache) unless given (PAGES: fixed, plausible counts); a
test may replace it between reads (the real engine's is a snapshot read from any thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
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

K = MAX_TOP_LOGPROBS
BLOCK = 4  # tokens per prefix-cache block
BLOCK_BYTES = 64  # what one stored block counts in cached_bytes
# A pool of 40 pages of 16 positions (640, not slots x max_seq_len of any test engine): 12 held (3 of them twice),
# 7 named by the prefix cache (4 of those held), 28 an allocation can take (total - used); 2 preemptions so far.
PAGES = PageStats(page_tokens=16, total=40, used=12, shared=3, cached=7, free=28, preemptions=2)


def token_logprob(j: int) -> float:
    return -0.25 * (j % 4 + 1)


def prompt_logprob(j: int) -> float:
    return -j / 8


class FakePrefix(NamedTuple):
    tokens: tuple[int, ...]
    wanted: bool  # prompt logprobs asked
    cached: int  # prompt tokens from the prefix cache


@dataclass
class _Slot:
    tokens: list[int]
    params: SlotParams
    prompt_len: int
    generated: int = 0
    done: bool = False


class FakeEngine(Engine):
    capabilities = Capabilities()  # no token masks (its server has no structured outputs), no device memory

    def __init__(
        self,
        vocab_size: int,
        eos_id: int,
        pool: Sequence[int] = (1, 2, 3),
        slots: int = 8,
        max_seq_len: int = 512,
        steps_per_call: int = 4,
        script: Callable[[tuple[int, ...], int], Sequence[int]] | None = None,
        delay_s: float = 0.0,
        step_delay_s: float = 0.0,
        prefill_chunk: int = 512,
        prefix_cache_bytes: int | None = 1 << 20,
        pages: PageStats | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.steps_per_call = steps_per_call
        self.eos_id = eos_id
        self.pool = list(pool)
        self.script = script
        self.scripts: dict[tuple[int, ...], list[int]] = {}  # prompt -> the tokens every sample generates
        self.delay_s = delay_s  # each decode call lasts this long, and step_delay_s per step it makes
        self.step_delay_s = step_delay_s
        self.prefill_chunk = prefill_chunk
        # "prefill" (one step of one prompt), "decode" (when a decode call computes)
        self.log: list[str] = []
        self.gate: threading.Event | None = None  # when set up, decode() waits for it
        self.fail_prefill: Callable[[list[int]], bool] = lambda tokens: False
        self.fail_decode = False
        self.prefills: list[list[int]] = []
        self.inserts: list[tuple[int, SlotParams]] = []
        self.releases: list[int] = []
        self.decode_calls = 0
        self.call_steps: list[int] = []  # each decode call's steps, as dispatched
        self._active: dict[int, _Slot] = {}
        # prefix cache (None or 0 bytes: off): (salt, prompt[:BLOCK * k]) -> stored, least recently used first
        self.prefix_cache_bytes = prefix_cache_bytes or 0
        self.blocks: dict[tuple[str | None, tuple[int, ...]], None] = {}
        self.salts: list[str | None] = []  # cache_salt of each prefill, as `prefills`
        self.lookup_tokens = self.hit_tokens = self.evictions = 0
        self.together: list[list[list[int]]] = []  # the prompts of each prefill_together call
        self.open_prefills = 0  # prefill_steps iterators started and not yet finished or closed
        self.abandoned: list[list[int]] = []  # prompts whose prefill steps were closed before the prefix
        self.pages = pages  # what page_stats() reports (None: no paged KV cache)

    # ---- hand-computable outputs -----------------------------------------------------------------------

    def continuation(self, prompt: tuple[int, ...], seed: int) -> list[int]:
        if tuple(prompt) in self.scripts:
            return list(self.scripts[tuple(prompt)])
        if self.script is not None:
            return list(self.script(prompt, seed))
        return [self.pool[(seed + j) % len(self.pool)] for j in range(self.max_seq_len)]

    def _token_out(self, slot: _Slot) -> TokenOut:
        j = slot.generated
        tid = slot.tokens[j] if j < len(slot.tokens) else self.eos_id
        lp = token_logprob(j)
        slot.generated += 1
        slot.done = (
            tid in slot.params.stop_ids
            or slot.generated >= slot.params.max_tokens
            or slot.prompt_len + slot.generated >= self.max_seq_len
        )
        top_ids = (tid + np.arange(K)) % self.vocab_size
        top_lps = lp - np.arange(K) / 2
        return TokenOut(tid, lp, top_ids.astype(np.int32), top_lps.astype(np.float32), slot.done)

    # ---- Engine ---------------------------------------------------------------------------------------

    # ---- the prefix cache ---------------------------------------------------------------------------

    def _lookup_and_store(self, tokens: tuple[int, ...], salt: str | None) -> int:
        """Prompt tokens found in the cache (its leading stored blocks, at most len - 1 tokens); then store its
        blocks."""
        if not self.prefix_cache_bytes:
            return 0
        hit = 0
        while hit + BLOCK <= len(tokens) - 1 and (salt, tokens[: hit + BLOCK]) in self.blocks:
            hit += BLOCK
        self.lookup_tokens += len(tokens)
        self.hit_tokens += hit
        for end in range(BLOCK, len(tokens) + 1, BLOCK):
            key = (salt, tokens[:end])
            self.blocks.pop(key, None)  # used again: now the most recent
            self.blocks[key] = None
        while len(self.blocks) * BLOCK_BYTES > self.prefix_cache_bytes:
            del self.blocks[next(iter(self.blocks))]
            self.evictions += 1
        return hit

    def cached_tokens(self, prefix: FakePrefix) -> int:
        return prefix.cached

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.prefix_cache_bytes:
            return None
        return PrefixCacheStats(
            lookup_tokens=self.lookup_tokens,
            hit_tokens=self.hit_tokens,
            cached_bytes=len(self.blocks) * BLOCK_BYTES,
            capacity_bytes=self.prefix_cache_bytes,
            evictions=self.evictions,
        )

    def page_stats(self) -> PageStats | None:
        return self.pages

    # ---- Engine ---------------------------------------------------------------------------------------

    def prefill(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ) -> FakePrefix:
        self.prefills.append(list(tokens))
        self.salts.append(cache_salt)
        if self.fail_prefill(tokens):
            raise RuntimeError("fake prefill failure")
        cached = self._lookup_and_store(tuple(tokens), cache_salt)
        return FakePrefix(tuple(tokens), want_prompt_logprobs, cached)

    def prefill_steps(
        self, tokens: list[int], want_prompt_logprobs: bool = False, cache_salt: str | None = None
    ):
        """One step per `prefill_chunk` tokens, like the real engine's chunked prefill. An iterator closed
        before it yielded its prefix (a request cancelled mid-prefill) is recorded in `abandoned`."""
        steps = max(1, -(-len(tokens) // self.prefill_chunk))
        self.open_prefills += 1
        done = False
        try:
            for _ in range(steps - 1):
                self.log.append("prefill")
                yield None
            self.log.append("prefill")
            prefix = self.prefill(tokens, want_prompt_logprobs, cache_salt)
            done = True
            yield prefix
        except GeneratorExit:
            if not done:
                self.abandoned.append(list(tokens))
            raise
        finally:
            self.open_prefills -= 1

    def prefill_together(self, prompts: list[list[int]], cache_salts: list[str | None] | None = None) -> list:
        """The prompts one by one, logged as one prefill step each; each call's prompts recorded in `together`."""
        self.together.append([list(tokens) for tokens in prompts])
        for _ in prompts:
            self.log.append("prefill")
        return super().prefill_together(prompts, cache_salts)

    def start_decode(self, max_steps: int | None = None) -> Pending[StepArrays]:
        """Deferred until read, as the real engine's asynchronous dispatch: the orchestrator dispatches the next
        call before it reads this one (and a held `gate` holds only the read)."""
        live = dict(self._active)  # what the call computes: the samples in the slots now, not later ones
        steps = self.steps_per_call if max_steps is None else max(1, min(max_steps, self.steps_per_call))
        self.call_steps.append(steps)
        return Pending(lambda: self.decode(only=live, steps=steps))

    def prompt_logprobs(self, prefix: FakePrefix) -> PromptLogprobs | None:
        tokens, wanted = prefix.tokens, prefix.wanted
        if not wanted:
            return None
        rows = range(1, len(tokens))
        lps = np.array([prompt_logprob(j) for j in rows], np.float32)
        top_ids = np.array([(tokens[j] + np.arange(K)) % self.vocab_size for j in rows], np.int32).reshape(
            -1, K
        )
        top_lps = (lps[:, None] - np.arange(K)[None, :] / 2).astype(np.float32)
        return PromptLogprobs(lps, top_ids, top_lps)

    def insert(self, prefix: FakePrefix, slot: int, params: SlotParams, allowed=None) -> TokenOut:
        assert allowed is None, "the fake engine takes no token masks (its server has no structured outputs)"
        assert slot not in self._active, f"slot {slot} inserted while still active"
        assert 0 <= slot < self.slots
        tokens = prefix.tokens
        state = _Slot(self.continuation(tokens, params.seed), params, len(tokens))
        self._active[slot] = state
        self.inserts.append((slot, params))
        return self._token_out(state)

    def decode(self, only: dict[int, _Slot] | None = None, steps: int | None = None) -> StepArrays:
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s or self.step_delay_s:
            time.sleep(self.delay_s + self.step_delay_s * (steps or self.steps_per_call))
        if self.fail_decode:
            raise RuntimeError("fake decode failure")
        self.decode_calls += 1
        self.log.append("decode")
        n, b = steps or self.steps_per_call, self.slots
        out = StepArrays(
            ids=np.zeros((n, b), np.int32),
            logprobs=np.zeros((n, b), np.float32),
            top_ids=np.zeros((n, b, K), np.int32),
            top_logprobs=np.zeros((n, b, K), np.float32),
            valid=np.zeros((n, b), bool),
            done=np.zeros((n, b), bool),
        )
        for step in range(n):
            for slot, state in self._active.items():
                if state.done or (only is not None and only.get(slot) is not state):
                    continue
                tok = self._token_out(state)
                out.ids[step, slot], out.logprobs[step, slot] = tok.token_id, tok.logprob
                out.top_ids[step, slot], out.top_logprobs[step, slot] = tok.top_ids, tok.top_logprobs
                out.valid[step, slot], out.done[step, slot] = True, tok.done
        return out

    def release(self, slot: int) -> None:
        self.releases.append(slot)
        self._active.pop(slot, None)

    @property
    def active_slots(self) -> list[int]:
        return sorted(self._active)


def make_engine(tokenizer, **kw) -> FakeEngine:
    """A fake engine over a real tokenizer's ids: it writes " the quick brown fox ..." from a seed-dependent start."""
    pool = tokenizer.encode(" the quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    return FakeEngine(tokenizer.vocab_size, tokenizer.eos_ids[0], pool=pool, **kw)

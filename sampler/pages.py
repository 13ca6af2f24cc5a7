"""The KV pool's host side: which pages are free, who holds each one, and the prefix cache over them.

The device holds one pool of pages (model/llama.py); page 0 is the null page, pages 1..total are handed out here.
A page is held by reference: by a prefill in progress, by a prefix not yet let go, by each slot whose sequence
reads it. The prefix cache names full prompt pages by a chained digest of the namespace (the request's
`cache_salt`) and tokens 0..(i+1)*page-1, so a page is found only under the same salt after the same tokens; a
found page is shared by reference, never copied. A cached page nobody holds stays cached until its room is needed
(least recently let go first).

Prompt logprobs of a cached page (the logprobs of its own tokens, each given everything before it; all determined
by the page's name) stay on the host, next to the name (`PageLogprobs`): a later request that wants them reads them
from there.

Driven by the engine thread; `stats()` may be read from any thread (a snapshot of ints).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tpuserve.sampler.api import PageStats, PrefixCacheStats


class PromptParts:
    """A prompt's logprob entries as computed, part by part ((entries, arrays (chosen, top_ids, top_vals)) each,
    device or host arrays); `arrays()` joins them on the host once. Entry j: the logprob of token j + 1."""

    def __init__(self, parts: list[tuple[int, tuple]]) -> None:
        self.parts = parts
        self._joined: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._joined is None:
            host = [[np.asarray(a)[:count] for a in arrays] for count, arrays in self.parts]
            self._joined = tuple(np.concatenate([part[i] for part in host]) for i in range(3))  # type: ignore
            self.parts = []
        return self._joined


@dataclass
class PageLogprobs:
    """The logprobs of page `index`'s tokens within the prompt whose entries `prompt` holds."""

    prompt: PromptParts
    index: int

    def entries(self, page: int) -> tuple[np.ndarray, ...]:
        """[page] chosen, [page, K] ids, [page, K] values for the page's tokens; the very first token of a prompt
        has none (zeros)."""
        chosen, ids, vals = self.prompt.arrays()
        lo, hi = self.index * page - 1, (self.index + 1) * page - 1
        out = [a[max(lo, 0) : hi] for a in (chosen, ids, vals)]
        if lo < 0:
            out = [np.concatenate([np.zeros((1, *a.shape[1:]), a.dtype), a]) for a in out]
        return tuple(out)


@dataclass
class CachedPage:
    id: int
    key: bytes
    logprobs: PageLogprobs | None = None


class Pages:
    def __init__(self, total: int, page: int, page_bytes: int, prefix_cache: bool) -> None:
        self.total = total  # pages 1..total
        self.page = page
        self.page_bytes = page_bytes
        self.prefix_cache = prefix_cache
        self.refs = np.zeros(total + 1, np.int32)
        self._free = list(range(total, 0, -1))  # pop() takes the lowest id
        self._cached: dict[bytes, CachedPage] = {}
        self._by_id: dict[int, CachedPage] = {}
        self._idle: collections.OrderedDict[int, None] = (
            collections.OrderedDict()
        )  # cached, unheld: oldest first
        # names of the pages prefills in progress will register (a name per prefill that computes it), and those
        # registered with their prompt logprobs: a prompt that needs them waits for that prefill (`awaits`)
        self._computing: collections.Counter[bytes] = collections.Counter()
        self._computing_logprobs: collections.Counter[bytes] = collections.Counter()
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0
        self.preemptions = 0

    # ---- allocation -----------------------------------------------------------------------------------------
    def available(self) -> int:
        """Pages an allocation can take now: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, each held once by the caller; None (and nothing taken) when fewer are available."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # the cached page let go longest ago
                page, _ = self._idle.popitem(last=False)
                del self._cached[self._by_id.pop(page).key]
                self.evictions += 1
            self.refs[page] = 1
            out.append(page)
        return out

    def hold(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self.refs[page] == 0:
                self._idle.pop(page, None)
            self.refs[page] += 1

    def let_go(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} let go more often than held"
            if self.refs[page] == 0:
                if page in self._by_id:
                    self._idle[page] = None
                else:
                    self._free.append(page)

    # ---- the prefix cache -----------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], salt: str | None) -> list[bytes]:
        """Digests of the prompt's full pages, each chained on the one before (and on the salt)."""
        if not self.prefix_cache:
            return []
        p = self.page
        root = hashlib.blake2b(b"salt\0" + (salt.encode() if salt is not None else b"\1"), digest_size=16)
        key, out = root.digest(), []
        ids = np.asarray(tokens, np.int64)
        for i in range(len(tokens) // p):
            key = hashlib.blake2b(key + ids[i * p : (i + 1) * p].tobytes(), digest_size=16).digest()
            out.append(key)
        return out

    def lookup(self, keys: Sequence[bytes], prompt_len: int, logprobs: bool) -> list[CachedPage]:
        """The longest run of leading pages cached (with their prompt logprobs when `logprobs`), held once by the
        caller; counts the prompt's tokens as looked up and the run's as hits."""
        found = []
        for key in keys:
            cached = self._found(key, logprobs)
            if cached is None:
                break
            found.append(cached)
        self.hold([c.id for c in found])
        self.lookup_tokens += prompt_len
        self.hit_tokens += len(found) * self.page
        return found

    def _found(self, key: bytes, logprobs: bool) -> CachedPage | None:
        """The cached page of this name, if it serves a request (one that wants prompt logprobs needs its
        logprobs: a page without them is a miss)."""
        cached = self._cached.get(key)
        return None if cached is None or (logprobs and cached.logprobs is None) else cached

    def in_progress(self) -> bool:
        """Whether any prefill in progress will name pages."""
        return bool(self._computing)

    def computing(self, keys: Sequence[bytes], logprobs: bool) -> None:
        """A prefill started that will name these pages (with their prompt logprobs when `logprobs`)."""
        self._computing.update(keys)
        if logprobs:
            self._computing_logprobs.update(keys)

    def computed(self, keys: Sequence[bytes], logprobs: bool) -> None:
        """That prefill ended: named them, or failed or was cancelled."""
        self._computing -= collections.Counter(keys)
        if logprobs:
            self._computing_logprobs -= collections.Counter(keys)

    def awaits(self, keys: Sequence[bytes], logprobs: bool) -> bool:
        """Whether the first of a prompt's leading pages that `lookup` would not find now is one a prefill in
        progress will name (with prompt logprobs when `logprobs`): the prompt would then find it by waiting for
        that prefill instead of computing it again."""
        computing = self._computing_logprobs if logprobs else self._computing
        missed = next((key for key in keys if self._found(key, logprobs) is None), None)
        return missed is not None and missed in computing

    def register(self, key: bytes, page: int, logprobs: PageLogprobs | None) -> None:
        """Name a held, fully computed prompt page; a name already taken keeps its page (this one stays private),
        and gains these logprobs if it had none."""
        cached = self._cached.get(key)
        if cached is not None:
            if cached.logprobs is None:
                cached.logprobs = logprobs
            return
        if page in self._by_id:
            return
        self._cached[key] = self._by_id[page] = CachedPage(page, key, logprobs)

    def forget_cache(self, reset_counts: bool = True) -> None:
        """Drop every name (warm-up's, or the old weights' at a weight swap): held pages stay held, unheld cached
        ones become free; counts restart unless `reset_counts` is False."""
        for page in self._idle:
            self._free.append(page)
        self._idle.clear()
        self._cached.clear()
        self._by_id.clear()
        self._free.sort(reverse=True)
        if reset_counts:
            self.lookup_tokens = self.hit_tokens = self.evictions = self.preemptions = 0

    # ---- reading --------------------------------------------------------------------------------------------
    def stats(self) -> PageStats:
        held = self.refs[1:]
        return PageStats(
            page_tokens=self.page,
            total=self.total,
            used=int(np.count_nonzero(held)),
            shared=int(np.count_nonzero(held >= 2)),
            cached=len(self._cached),
            free=self.available(),
            preemptions=self.preemptions,
        )

    def prefix_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            lookup_tokens=self.lookup_tokens,
            hit_tokens=self.hit_tokens,
            cached_bytes=len(self._cached) * self.page_bytes,
            capacity_bytes=self.total * self.page_bytes,
            evictions=self.evictions,
        )

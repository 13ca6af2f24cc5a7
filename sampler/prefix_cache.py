"""The prefix cache's host side: which pool block holds which prompt block, least recently used first.

A prompt is cut into blocks of C tokens; block i is named by a chained digest of the namespace (the request's
`cache_salt`) and tokens 0..(i+1)*C-1, so a block is found only under the same salt after the same tokens. The
device arrays live in the engine (programs.Pool); this index only hands out block ids. Blocks that an in-flight
prefill uses are pinned and never evicted under it; when every block is pinned there is no room, and the prompt
is served without caching (nobody waits on eviction).

Driven by the engine thread; `stats()` may be read from any thread (a snapshot of ints).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tpuserve.sampler.api import PrefixCacheStats


@dataclass
class Block:
    id: int
    logprobs: bool  # the pool holds this block's prompt logprobs too
    pins: int = 0


class PrefixIndex:
    def __init__(self, blocks: int, block_size: int, block_bytes: int) -> None:
        self.capacity = blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self._free = list(range(blocks - 1, -1, -1))
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()  # oldest use first
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    def keys(self, tokens: Sequence[int], salt: str | None) -> list[bytes]:
        """Digests of the prompt's full blocks, each chained on the one before (and on the salt)."""
        C = self.block_size
        root = hashlib.blake2b(b"salt\0" + (salt.encode() if salt is not None else b"\1"), digest_size=16)
        key, out = root.digest(), []
        ids = np.asarray(tokens, np.int64)
        for i in range(len(tokens) // C):
            key = hashlib.blake2b(key + ids[i * C : (i + 1) * C].tobytes(), digest_size=16).digest()
            out.append(key)
        return out

    def lookup(self, keys: Sequence[bytes], prompt_len: int, logprobs: bool) -> list[Block]:
        """The longest run of leading blocks found (with their prompt logprobs when `logprobs`), pinned and made
        most recently used; counts the prompt's tokens as looked up and the run's as hits."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None or (logprobs and not block.logprobs):
                break
            found.append(block)
            block.pins += 1
            self._blocks.move_to_end(key)
        self.lookup_tokens += prompt_len
        self.hit_tokens += len(found) * self.block_size
        return found

    def unpin(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            block.pins -= 1

    def get(self, key: bytes) -> Block | None:
        return self._blocks.get(key)

    def add(self, key: bytes, logprobs: bool) -> Block | None:
        """A block for `key` (not cached yet): a free one, else the least recently used unpinned one, evicted;
        None when every block is pinned."""
        if self._free:
            block_id = self._free.pop()
        else:
            victim = next((k for k, b in self._blocks.items() if b.pins == 0), None)
            if victim is None:
                return None
            block_id = self._blocks.pop(victim).id
            self.evictions += 1
        block = self._blocks[key] = Block(block_id, logprobs)
        return block

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            lookup_tokens=self.lookup_tokens,
            hit_tokens=self.hit_tokens,
            cached_bytes=len(self._blocks) * self.block_bytes,
            capacity_bytes=self.capacity * self.block_bytes,
            evictions=self.evictions,
        )

"""The prefix cache is invisible in the numbers: a request's tokens, logprobs, top-20 alternatives and prompt
logprobs are bit-identical with its prompt's blocks cold, warm or partly warm (real weights, the shared engine:
blocks of 32 tokens). Each test takes a fresh `cache_salt` for its cold runs, so no other test's blocks can warm
them. Also: salts isolate, blocks without prompt logprobs are recomputed for a request that wants them, pinned
blocks are never evicted, a full cache serves without caching, and the host index on its own."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine
from tpuserve.sampler.prefix_cache import PrefixIndex

from tests.helpers import engine_config
from tests.sampler.test_engine import PROMPTS

# 4 tokens: the first (sampled from the prefill's logits) and three decode steps that attend over the prefix's KV
GREEDY = SlotParams(max_tokens=4, temperature=0.0)
SEEDED = SlotParams(max_tokens=4, temperature=1.0, top_p=0.9, top_k=40, seed=1234)
_salts = itertools.count()


def fresh_salt() -> str:
    return f"test-prefix-cache-{next(_salts)}"


CONTEXT = (
    "The lighthouse keeper wrote in his log every evening. He noted the wind, the colour of the sea, the ships "
    "that passed and the birds that rested on the rail. In winter the storms came from the north-west and the "
    "lamp had to be trimmed twice a night; in summer the fog rolled in without warning and the horn sounded "
    "until dawn. His daughter kept the accounts: oil, wicks, bread, and letters to the harbour master asking for "
    "a new lens. One spring a small boat drifted onto the rocks below the tower, empty except for a compass and "
    "a tin box of photographs. Nobody in the village recognised the faces. "
)


def long_prompt(tok, words: int = 0) -> list[int]:
    """~150 tokens of real text, then `words` extra words."""
    ids = tok.encode(CONTEXT + " ".join(PROMPTS) + "".join(f" word{i}" for i in range(words)))
    assert len(ids) > 4 * 32, len(ids)
    return ids


def run(engine, ids, params, want_prompt_logprobs=True, salt=None, slot=5):
    """prefill -> insert -> decode until done; (cached tokens, [(id, logprob, top_ids, top_logprobs)], prompt)."""
    prefix = engine.prefill(ids, want_prompt_logprobs, salt)
    prompt = engine.prompt_logprobs(prefix)
    first = engine.insert(prefix, slot, params)
    tokens = [first]
    while not tokens[-1].done:
        step = engine.decode()
        tokens += [step.token(i, slot) for i in range(step.ids.shape[0]) if step.valid[i, slot]]
    engine.release(slot)
    out = [(t.token_id, t.logprob, t.top_ids.copy(), t.top_logprobs.copy()) for t in tokens]
    return prefix.cached_tokens, out, prompt


def assert_identical(a, b):
    (_, out_a, prompt_a), (_, out_b, prompt_b) = a, b
    assert len(out_a) == len(out_b)
    for (ia, la, ta, va), (ib, lb, tb, vb) in zip(out_a, out_b, strict=True):
        assert ia == ib and la == lb  # bit-identical, not close
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(va, vb)
    assert (prompt_a is None) == (prompt_b is None)
    if prompt_a is not None:
        np.testing.assert_array_equal(prompt_a.logprobs, prompt_b.logprobs)
        np.testing.assert_array_equal(prompt_a.top_ids, prompt_b.top_ids)
        np.testing.assert_array_equal(prompt_a.top_logprobs, prompt_b.top_logprobs)


def test_cold_warm_and_partly_warm_are_bit_identical(engine, embedded, params=SEEDED):
    tok, C = embedded.tokenizer, engine.prefill_chunk
    assert C == 32 and engine.index is not None
    ids = long_prompt(tok)
    salt = fresh_salt()
    cold = run(engine, ids, params, salt=salt)
    warm = run(engine, ids, params, salt=salt)
    assert cold[0] == 0 and warm[0] == (len(ids) - 1) // C * C
    assert_identical(cold, warm)
    # a longer prompt that shares the first one whole: its hit ends where the shared blocks do, mid-way through
    # the first prompt's last (partial) block; the rest is computed
    longer = ids + tok.encode(" And one more question about the weather tomorrow?")
    partly = run(engine, longer, params, salt=salt)
    assert partly[0] == len(ids) // C * C
    assert_identical(partly, run(engine, longer, params, salt=fresh_salt()))
    # a prompt that diverges inside a block: only the blocks before the divergence are shared
    diverged = ids[: 3 * C + 7] + tok.encode(" something else entirely, as a different question")
    hit = run(engine, diverged, params, salt=salt)
    assert hit[0] == 3 * C
    assert_identical(hit, run(engine, diverged, params, salt=fresh_salt()))


def test_a_fully_cached_prompt_recomputes_its_last_block_greedy(engine, embedded):
    C = engine.prefill_chunk
    ids = long_prompt(embedded.tokenizer)[: 4 * C]  # exactly four blocks
    salt = fresh_salt()
    cold = run(engine, ids, GREEDY, salt=salt)
    warm = run(engine, ids, GREEDY, salt=salt)
    assert warm[0] == 3 * C  # the last token's logits are needed: its block is computed again
    assert_identical(cold, warm)
    assert len(warm[2].logprobs) == 4 * C - 1


def test_blocks_without_prompt_logprobs_are_recomputed_for_a_request_that_wants_them(engine, embedded):
    ids = long_prompt(embedded.tokenizer)
    salt = fresh_salt()
    plain = run(engine, ids, SEEDED, want_prompt_logprobs=False, salt=salt)
    assert plain[0] == 0 and plain[2] is None
    assert run(engine, ids, SEEDED, want_prompt_logprobs=False, salt=salt)[0] > 0  # warm for a plain request
    wants = run(engine, ids, SEEDED, salt=salt)
    assert wants[0] == 0  # those blocks kept no prompt logprobs: computed again (and now kept)
    again = run(engine, ids, SEEDED, salt=salt)
    assert again[0] > 0
    assert_identical(wants, again)
    assert_identical(wants, run(engine, ids, SEEDED, salt=fresh_salt()))


def test_salts_never_share_blocks_and_stats_count_hits(engine, embedded):
    ids = long_prompt(embedded.tokenizer, words=3)
    a, b = fresh_salt(), fresh_salt()
    before = engine.prefix_cache_stats()
    assert run(engine, ids, GREEDY, salt=a)[0] == 0
    assert run(engine, ids, GREEDY, salt=b)[0] == 0  # same tokens, other tenant: nothing shared
    assert run(engine, ids, GREEDY, salt=None)[0] == 0  # the default namespace is a namespace of its own
    warm = run(engine, ids, GREEDY, salt=b)[0]
    after = engine.prefix_cache_stats()
    assert after.lookup_tokens - before.lookup_tokens == 4 * len(ids)
    assert after.hit_tokens - before.hit_tokens == warm > 0
    assert 0 < after.cached_bytes <= after.capacity_bytes


def test_a_cancelled_prefill_lets_go_of_its_blocks(engine, embedded):
    ids = long_prompt(embedded.tokenizer, words=5)
    salt = fresh_salt()
    run(engine, ids, GREEDY, want_prompt_logprobs=False, salt=salt)
    steps = engine.prefill_steps(ids + ids[:40], False, salt)  # longer than the cached part: several chunks
    assert next(steps) is None
    key = engine.index.keys(ids, salt)[0]
    assert engine.index.get(key).pins == 1
    steps.close()  # the request was cancelled mid-prefill
    assert engine.index.get(key).pins == 0


# ---- a small budget: eviction and pinning, on an engine of its own ----------------------------------------


@pytest.fixture(scope="module")
def small(embedded):
    """The real model with room for 3 blocks of 32 tokens (no warm-up: the few programs compile on first use)."""
    from tpuserve.sampler.programs import pool_block_bytes

    block = pool_block_bytes(embedded.config, 32, 20, np.float32)
    return JaxEngine(embedded, engine_config(slots=2, max_seq_len=256, prefill_chunk=32, min_prefill_bucket=32,
                     min_attend_bucket=128, min_batch_bucket=2, prefix_cache_bytes=3 * block + 100))  # fmt: skip


def test_least_recently_used_blocks_are_evicted_and_pinned_ones_never(small, embedded):
    tok = embedded.tokenizer
    first = tok.encode(CONTEXT)[:97]  # three full blocks + 1
    second = tok.encode(" ".join(PROMPTS[::-1]) * 6)[:97]
    assert len(first) == len(second) == 97
    assert small.index.capacity == 3
    cold = run(small, first, GREEDY, slot=0)
    held = small.prefill_steps(first, True, None)
    prefix = next(held)  # one chunk left to compute: the prefix, its three blocks pinned until the steps end
    assert prefix.cached_tokens == 96
    evictions = small.index.evictions
    assert run(small, second, GREEDY, slot=0)[0] == 0  # no unpinned block to evict: served without caching
    assert small.index.evictions == evictions
    assert all(small.index.get(k) is not None for k in small.index.keys(first, None))
    np.testing.assert_array_equal(small.prompt_logprobs(prefix).logprobs, cold[2].logprobs)
    held.close()
    assert run(small, second, GREEDY, slot=0)[0] == 0  # computed again; now its blocks evict the first's
    assert small.index.evictions == evictions + 3
    assert run(small, second, GREEDY, slot=0)[0] == 96
    assert run(small, first, GREEDY, slot=0)[0] == 0


# ---- the host index ----------------------------------------------------------------------------------------


def test_index_keys_chain_over_every_earlier_token_and_the_salt():
    index = PrefixIndex(blocks=4, block_size=2, block_bytes=10)
    a = index.keys([1, 2, 3, 4, 5], None)
    assert len(a) == 2  # full blocks only
    assert index.keys([1, 2, 3, 4], None) == a
    assert index.keys([9, 2, 3, 4], None)[1] != a[1]  # block 1's key depends on block 0's tokens
    assert index.keys([1, 2, 3, 4], "tenant")[0] != a[0]
    assert index.keys([1, 2, 3, 4], "")[0] != a[0]  # an empty salt is not the default namespace


def test_index_lookup_pins_and_evicts_least_recently_used():
    index = PrefixIndex(blocks=2, block_size=2, block_bytes=10)
    ka, kb, kc = (index.keys([t, t], None)[0] for t in (1, 2, 3))
    assert index.add(ka, logprobs=False).id != index.add(kb, logprobs=True).id
    assert [b.id for b in index.lookup([ka], 2, logprobs=False)] == [index.get(ka).id]  # a used again: newest
    assert index.lookup([ka], 2, logprobs=True) == []  # a kept no prompt logprobs
    index.unpin([index.get(ka)])
    assert index.add(kc, logprobs=False) is not None  # evicts b, the least recently used
    assert index.get(kb) is None and index.evictions == 1
    pinned = index.lookup([ka], 2, logprobs=False) + index.lookup([kc], 2, logprobs=False)
    assert index.add(kb, logprobs=False) is None  # every block pinned: no room, nothing evicted
    index.unpin(pinned)
    stats = index.stats()
    assert (stats.lookup_tokens, stats.hit_tokens, stats.cached_bytes, stats.capacity_bytes) == (8, 6, 20, 20)

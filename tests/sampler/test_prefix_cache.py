"""The prefix cache is invisible in the numbers: a request's tokens, logprobs, top-20 alternatives and prompt
logprobs are bit-identical with its prompt's pages cold, warm or partly warm (real weights, the shared engine:
pages of 16 tokens, chunks of 64). Each test takes a fresh `cache_salt` for its cold runs, so no other test's
pages can warm them. Also: salts isolate, pages without prompt logprobs are recomputed for a request that wants
them, held pages are never evicted, and the host's page bookkeeping on its own. A sequence paused to make room
(its pages moved to the host and back) goes on bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine, NoRoom
from tpuserve.sampler.pages import Pages

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
    assert len(ids) > 8 * 16, len(ids)
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
    tok, P = embedded.tokenizer, engine.page
    assert P == 16 and engine.pages.prefix_cache
    ids = long_prompt(tok)
    salt = fresh_salt()
    cold = run(engine, ids, params, salt=salt)
    warm = run(engine, ids, params, salt=salt)
    assert cold[0] == 0 and warm[0] == (len(ids) - 1) // P * P
    assert_identical(cold, warm)
    # a longer prompt that shares the first one whole: its hit ends where the shared pages do, mid-way through
    # the first prompt's last (partial) page; the rest is computed
    longer = ids + tok.encode(" And one more question about the weather tomorrow?")
    partly = run(engine, longer, params, salt=salt)
    assert partly[0] == len(ids) // P * P
    assert_identical(partly, run(engine, longer, params, salt=fresh_salt()))
    # a prompt that diverges inside a page: only the pages before the divergence are shared
    diverged = ids[: 5 * P + 7] + tok.encode(" something else entirely, as a different question")
    hit = run(engine, diverged, params, salt=salt)
    assert hit[0] == 5 * P
    assert_identical(hit, run(engine, diverged, params, salt=fresh_salt()))


def test_a_shared_system_prompt_shorter_than_a_chunk_is_shared_page_by_page(engine, embedded):
    tok, P = embedded.tokenizer, engine.page
    system = tok.encode(CONTEXT)[:60]  # a ~60-token system prompt: three full pages
    salt = fresh_salt()
    first = run(engine, system + tok.encode(" What does the keeper write?"), GREEDY, salt=salt)
    second_ids = system + tok.encode(" Who found the boat?")
    second = run(engine, second_ids, GREEDY, salt=salt)
    assert first[0] == 0 and second[0] == 60 // P * P
    assert_identical(second, run(engine, second_ids, GREEDY, salt=fresh_salt()))


def test_a_fully_cached_prompt_recomputes_its_last_page_greedy(engine, embedded):
    P = engine.page
    ids = long_prompt(embedded.tokenizer)[: 8 * P]  # exactly eight pages
    salt = fresh_salt()
    cold = run(engine, ids, GREEDY, salt=salt)
    warm = run(engine, ids, GREEDY, salt=salt)
    assert warm[0] == 7 * P  # the last token's logits are needed: its page is computed again
    assert_identical(cold, warm)
    assert len(warm[2].logprobs) == 8 * P - 1


def test_pages_without_prompt_logprobs_are_recomputed_for_a_request_that_wants_them(engine, embedded):
    ids = long_prompt(embedded.tokenizer)
    salt = fresh_salt()
    plain = run(engine, ids, SEEDED, want_prompt_logprobs=False, salt=salt)
    assert plain[0] == 0 and plain[2] is None
    assert run(engine, ids, SEEDED, want_prompt_logprobs=False, salt=salt)[0] > 0  # warm for a plain request
    wants = run(engine, ids, SEEDED, salt=salt)
    assert wants[0] == 0  # those pages kept no prompt logprobs: computed again (and now kept)
    again = run(engine, ids, SEEDED, salt=salt)
    assert again[0] > 0
    assert_identical(wants, again)
    assert_identical(wants, run(engine, ids, SEEDED, salt=fresh_salt()))


def test_salts_never_share_pages_and_stats_count_hits(engine, embedded):
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


def test_a_cancelled_prefill_lets_go_of_its_pages(engine, embedded):
    ids = long_prompt(embedded.tokenizer, words=5)
    salt = fresh_salt()
    run(engine, ids, GREEDY, want_prompt_logprobs=False, salt=salt)
    page = engine.pages._cached[engine.pages.keys(ids, salt)[0]].id
    assert engine.pages.refs[page] == 0  # cached, held by nobody
    used = engine.page_stats().used
    steps = engine.prefill_steps(ids + ids[:90], False, salt)  # longer than the cached part: several chunks
    assert engine.pages.refs[page] == 1 and engine.page_stats().used > used
    assert next(steps) is None
    steps.close()  # the request was cancelled mid-prefill
    assert engine.pages.refs[page] == 0 and engine.page_stats().used == used


# ---- a small pool: eviction, holding, admission and pausing, on an engine of its own --------------------------


@pytest.fixture(scope="module")
def small(embedded):
    """The real model with a pool of 16 pages of 16 tokens (no warm-up: the few programs compile on first use);
    8 slots, so a decode step is the shared engine's (batch invariance)."""
    return JaxEngine(embedded, engine_config(slots=8, max_seq_len=256, prefill_chunk=64, min_prefill_bucket=32,
                     min_attend_bucket=128, min_batch_bucket=2, kv_pages=16))  # fmt: skip


def test_least_recently_let_go_pages_are_evicted_and_held_ones_never(small, embedded):
    tok = embedded.tokenizer
    texts = [CONTEXT, " ".join(PROMPTS[::-1]) * 6, " ".join(PROMPTS) * 6]
    first, second, third = (tok.encode(t)[:97] for t in texts)  # six full pages + 1 each
    assert len(first) == len(second) == len(third) == 97
    cold = run(small, first, GREEDY, slot=0)
    prefix = small.prefill(first, True, None)  # held: its six cached pages and its own last one
    assert prefix.cached_tokens == 96
    evictions = small.pages.evictions
    assert run(small, second, GREEDY, slot=0)[0] == 0  # room enough: nothing evicted
    assert small.pages.evictions == evictions
    assert run(small, third, GREEDY, slot=0)[0] == 0  # takes the free pages, then evicts the second's oldest
    assert small.pages.evictions > evictions
    assert all(k in small.pages._cached for k in small.pages.keys(first, None))  # held: never evicted
    np.testing.assert_array_equal(small.prompt_logprobs(prefix).logprobs, cold[2].logprobs)
    assert not small.admits(16 * 16, 1)  # the whole pool: not while the prefix holds seven pages
    with pytest.raises(NoRoom):
        small.prefill(tok.encode(" ".join(PROMPTS) * 12)[: 15 * 16], False, "no room")
    del prefix  # let go: its pages stay cached, evictable
    assert small.admits(15 * 16 - 16, 1)
    assert run(small, first, GREEDY, slot=0)[0] == 96


def test_a_sequence_paused_for_room_goes_on_bit_identical(small, embedded):
    """Two sequences that outgrow the pool together: the one inserted last is moved to the host while the other
    runs, then comes back; each one's tokens and logprobs equal its run alone (seeded and greedy)."""
    tok = embedded.tokenizer
    a, b = tok.encode(CONTEXT)[:40], tok.encode(" ".join(PROMPTS))[:40]
    pa = SlotParams(max_tokens=100, temperature=1.0, top_p=0.9, seed=7, stop_ids=())
    pb = SlotParams(max_tokens=100, temperature=0.0, stop_ids=())
    alone_a = run(small, a, pa, want_prompt_logprobs=False, salt=fresh_salt(), slot=0)
    alone_b = run(small, b, pb, want_prompt_logprobs=False, salt=fresh_salt(), slot=1)
    assert len(alone_a[1]) == len(alone_b[1]) == 100  # 140 positions: 9 pages each, 18 > 16
    preempted = small.page_stats().preemptions
    out = {0: [], 1: []}
    for slot, ids, params in ((0, a, pa), (1, b, pb)):
        out[slot].append(small.insert(small.prefill(ids, False, fresh_salt()), slot, params))
    running = {0, 1}
    while running:
        step = small.decode()
        for slot in sorted(running):
            out[slot] += [step.token(i, slot) for i in range(step.ids.shape[0]) if step.valid[i, slot]]
            if out[slot][-1].done:  # as the service does: a finished sample lets its slot go
                small.release(slot)
                running.discard(slot)
    assert small.page_stats().preemptions > preempted
    for slot, alone in ((0, alone_a), (1, alone_b)):
        got = [(t.token_id, t.logprob, t.top_ids.copy(), t.top_logprobs.copy()) for t in out[slot]]
        assert_identical((0, got, None), (0, alone[1], None))


def test_the_only_running_sequence_pauses_itself_while_prompts_hold_the_pool(small, embedded):
    """A prefilled prompt waiting for its insert holds most of the pool; the one running sequence outgrows the rest.
    With no other sequence to move out, it is paused itself (never a NoRoom that would fail every request) and
    comes back, bit-identical to its run alone, once the prompt's pages are let go."""
    tok = embedded.tokenizer
    a = tok.encode(CONTEXT)[:40]
    params = SlotParams(max_tokens=100, temperature=1.0, top_p=0.9, seed=11, stop_ids=())
    alone = run(small, a, params, want_prompt_logprobs=False, salt=fresh_salt(), slot=0)
    assert len(alone[1]) == 100  # 140 positions: 9 pages
    held = tok.encode(" ".join(PROMPTS) * 8)[:113]
    assert len(held) == 113
    waiting = small.prefill(held, False, fresh_salt())  # holds 8 of the 16 pages: 8 + 9 > 16
    preempted = small.page_stats().preemptions
    out = [small.insert(small.prefill(a, False, fresh_salt()), 0, params)]
    idle_calls = 0
    while not out[-1].done:
        step = small.decode()
        got = [step.token(i, 0) for i in range(step.ids.shape[0]) if step.valid[i, 0]]
        if not got:  # paused: the waiting prompt's pages go back to the pool (its insert would use them)
            idle_calls += 1
            del waiting
        out += got
    small.release(0)
    assert idle_calls == 1 and small.page_stats().preemptions == preempted + 1
    got = [(t.token_id, t.logprob, t.top_ids.copy(), t.top_logprobs.copy()) for t in out]
    assert_identical((0, got, None), (0, alone[1], None))


# ---- the host's page bookkeeping ---------------------------------------------------------------------------


def test_keys_chain_over_every_earlier_token_and_the_salt():
    pages = Pages(total=4, page=2, page_bytes=10, prefix_cache=True)
    a = pages.keys([1, 2, 3, 4, 5], None)
    assert len(a) == 2  # full pages only
    assert pages.keys([1, 2, 3, 4], None) == a
    assert pages.keys([9, 2, 3, 4], None)[1] != a[1]  # page 1's key depends on page 0's tokens
    assert pages.keys([1, 2, 3, 4], "tenant")[0] != a[0]
    assert pages.keys([1, 2, 3, 4], "")[0] != a[0]  # an empty salt is not the default namespace


def test_pages_are_held_by_reference_and_evicted_least_recently_let_go_first():
    pages = Pages(total=3, page=2, page_bytes=10, prefix_cache=True)
    ka, kb, kc = (pages.keys([t, t], None)[0] for t in (1, 2, 3))
    (pa,), (pb,) = pages.allocate(1), pages.allocate(1)
    pages.register(ka, pa, None)
    pages.register(kb, pb, None)
    assert [c.id for c in pages.lookup([ka], 2, logprobs=False)] == [pa]  # shared: held twice now
    assert pages.stats().shared == 1 and pages.lookup([ka], 2, logprobs=True) == []  # a kept no logprobs
    pages.let_go([pa, pa, pb])  # nobody holds a or b: cached, evictable (a let go first)
    assert pages.available() == 3 and pages.stats().used == 0
    (pc,) = pages.allocate(1)  # the free page first
    assert pc not in (pa, pb) and pages.evictions == 0
    pages.register(kc, pc, None)
    assert pages.allocate(1) == [pa] and pages.evictions == 1 and ka not in pages._cached
    assert pages.allocate(2) is None  # only b is left (c is held): nothing taken
    assert pages.available() == 1 and kb in pages._cached
    stats = pages.prefix_stats()
    assert (stats.lookup_tokens, stats.hit_tokens, stats.cached_bytes, stats.capacity_bytes) == (4, 2, 20, 30)

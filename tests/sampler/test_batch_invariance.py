"""Decode runs on the smallest batch bucket that covers the occupied slots, and a request's tokens and logprobs
are bit-identical whatever the bucket: alone (2 rows, 8 steps per call), beside 1 other (4 rows), beside 7 others
(16 rows, 4 steps: it sits in slot 12), beside 63 others (64 rows, 1 step). Real weights; greedy and seeded
sampling. Also: every bit of a 64-bit seed counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tpuserve.sampler.api import SlotParams

from tests.conftest import ENGINE
from tests.helpers import compiles, engine_config
from tests.helpers import run_engine as run
from tests.sampler.test_engine import PROMPTS


@pytest.fixture(scope="module")
def calls(engine):
    """(batch bucket, steps) of every decode call the shared engine makes while the test runs."""
    yield _spy_buckets(engine)
    del engine.buckets


def _others(tok, slots):
    return [(s, tok.encode(f"Request {s}: " + PROMPTS[s % 3]), SlotParams(max_tokens=20, temperature=0.8, seed=s))
            for s in slots]  # fmt: skip


GREEDY = SlotParams(max_tokens=16, temperature=0.0)
SEEDED = SlotParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=77)


def test_bit_identical_alone_beside_7_and_beside_63(engine, embedded, calls):
    """A greedy and a seeded request (slots s, s+1) alone, beside 1 other, beside 7 others and beside 62 others."""
    _alone_and_beside(engine, embedded.tokenizer, calls)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_quantized_modes_bit_identical_alone_beside_7_beside_63_and_from_the_prefix_cache(mode):
    """The same in the modes that scale products' outputs (int8 weight-only per channel; W8A8's integer products):
    their rescale runs on every row after the products' padding, so XLA fuses it with the residual add alike in
    every bucket (quant.linear's `rows`). And again from the prefix cache; W8A8 compiles nothing after warm-up."""
    from tpuserve.model.loader import load_model
    from tpuserve.sampler.engine import JaxEngine

    model = load_model(quantization=mode)
    long = model.tokenizer.encode(" ".join(PROMPTS * 2))
    assert len(long) > 32  # prompts over 32 tokens share their full pages
    engine = JaxEngine(model, dataclasses.replace(ENGINE, quantization=mode))
    assert engine.quantization == mode
    if mode == "w8a8":  # its target: no compilation after warm-up (int8's programs compile on first use)
        engine.warm_up(prompt_logprobs=False)
    seen = _spy_buckets(engine)
    with compiles() as compiled:
        alone = _alone_and_beside(engine, model.tokenizer, seen)
        first, _ = run(engine, [(0, long, GREEDY)])
        hits = engine.prefix_cache_stats().hit_tokens
        cached, _ = run(engine, [(0, long, GREEDY)])
    assert engine.prefix_cache_stats().hit_tokens > hits
    assert compiled == [] or mode == "int8"
    for a, b in zip(first[0], cached[0], strict=True):
        assert np.array_equal(np.array(a), np.array(b))
    print(f"\n{mode} greedy: {model.tokenizer.decode(alone[0][0])!r}")


def _spy_buckets(engine) -> list[tuple[int, int]]:
    """(batch bucket, steps) of every decode call `engine` makes from now on."""
    seen: list[tuple[int, int]] = []
    original = engine.buckets

    def spy():
        attend, batch, steps = original()
        seen.append((batch, steps))
        return attend, batch, steps

    engine.buckets = spy
    return seen


def _alone_and_beside(engine, tok, calls: list[tuple[int, int]]) -> tuple:
    """Runs the greedy and seeded requests alone and beside 1, 7 and 62 others; asserts each bit-identical to
    alone; returns alone's outputs."""
    assert engine.batch_buckets == [2, 4, 8, 16, 32, 64]
    assert engine.call_steps == {2: 8, 4: 8, 8: 8, 16: 4, 32: 2, 64: 1}
    ids = tok.encode(PROMPTS[0])

    def mine(first: int) -> list:
        return [(first, ids, GREEDY), (first + 1, ids, SEEDED)]

    calls.clear()
    alone, _ = run(engine, mine(0))
    assert set(calls) == {(2, 8)}, "requests in slots 0-1 decode on the 2-row bucket, 8 steps a call"
    calls.clear()
    one, _ = run(engine, _others(tok, [2]) + mine(0))
    assert (4, 8) in calls, "slot 2 needs the 4-row bucket"
    calls.clear()
    seven, _ = run(engine, _others(tok, range(7)) + mine(12))
    assert set(calls) == {(16, 4)}, "slots 12-13 need the 16-row bucket (4 steps a call)"
    calls.clear()
    crowded, _ = run(engine, _others(tok, range(2, 64)) + mine(0))
    assert (64, 1) in calls
    for ref, others in (
        (alone[0], (one[0], seven[12], crowded[0])),
        (alone[1], (one[1], seven[13], crowded[1])),
    ):
        for other in others:
            assert other[0] == ref[0]  # token ids
            assert np.array_equal(np.array(other[1]), np.array(ref[1]))  # sampled-token logprobs, bit for bit
            assert np.array_equal(np.stack(other[2]), np.stack(ref[2]))  # top-20 ids
            assert np.array_equal(np.stack(other[3]), np.stack(ref[3]))  # top-20 logprobs
    return alone


def test_prompts_prefilled_together_match_each_alone(together_engine, embedded, monkeypatch):
    """Short prompts prefilled in one program a group (`prefill_together`, on `make serve`'s chunk settings:
    prompts of <= 16 tokens 8 a program, of 17-32 tokens 4) give each request the tokens and logprobs it gets
    with its prompt prefilled alone, bit for bit: the first token (sampled from the prefill's logits) and the
    decoded ones (read from the prefix's KV). Greedy and seeded. Warm-up compiles their programs."""

    eng = together_engine
    # prompts over 32 tokens are prefilled alone (their pages may be shared)
    assert eng.together_shapes() == [(2, 16), (4, 16), (8, 16), (2, 32), (4, 32)]
    text = embedded.tokenizer.encode(" ".join(PROMPTS * 4))
    # 10 of size 16 (8 + 2 rows), 3 of size 32 (4 rows)
    lengths = [5, 9, 12, 14, 15, 16, 16, 11, 7, 13, 17, 24, 31]
    requests = [(s, text[s : s + n], GREEDY if s % 2 else SEEDED) for s, n in enumerate(lengths)]
    assert [len(ids) for _, ids, _ in requests] == lengths
    programs: list[tuple[int, int]] = []
    original = eng.programs.chunk_together

    def spy(params, pool, tokens, last, tables, attend_len):
        programs.append(tokens.shape)
        return original(params, pool, tokens, last, tables, attend_len=attend_len)

    with compiles() as compiled:
        alone, _ = run(eng, requests)
        monkeypatch.setattr(eng, "programs", eng.programs._replace(chunk_together=spy))
        together, _ = run(eng, requests, together=True)
    assert compiled == []
    assert sorted(programs) == [(2, 16), (4, 32), (8, 16)]
    for slot in alone:
        for a, b in zip(alone[slot], together[slot], strict=True):
            assert np.array_equal(np.array(a), np.array(b)), f"slot {slot}"
    with pytest.raises(ValueError, match="prompts of 1"):
        eng.prefill_together([text[:5], [1] * eng.prefill_chunk])


def test_buckets_never_go_below_two_rows(embedded):
    """One row takes XLA:CPU's matrix-vector kernel, which rounds differently: buckets start at 2."""
    from tpuserve.sampler.engine import JaxEngine

    eng = JaxEngine(embedded, engine_config(slots=4, max_seq_len=64, min_batch_bucket=1))
    assert eng.batch_buckets == [2, 4]


def test_steps_per_call_hold_up_to_steps_per_call_rows_then_scale_down(embedded):
    """N steps on buckets of up to steps_per_call_rows rows, rows x steps held above; by default (None) from the
    smallest bucket; never below min_steps_per_call."""
    from tpuserve.sampler.engine import JaxEngine

    def steps(**kw) -> dict[int, int]:
        cfg = engine_config(slots=16, max_seq_len=64, min_batch_bucket=2, steps_per_call=8, **kw)
        engine = JaxEngine(embedded, cfg)
        return engine.call_steps

    assert steps(steps_per_call_rows=4) == {2: 8, 4: 8, 8: 4, 16: 2}
    assert steps() == {2: 8, 4: 4, 8: 2, 16: 1}
    assert steps(steps_per_call_rows=4, min_steps_per_call=4) == {2: 8, 4: 8, 8: 4, 16: 4}


def test_seeds_differ_in_their_high_bits(engine, embedded):
    """Seeds s, s + 2**32 and s + 2**63 give three different streams; the same seed, the same stream."""
    ids = embedded.tokenizer.encode(PROMPTS[2])
    streams = []
    for seed in (5, 5 + 2**32, 5 + 2**63, 5):
        out, _ = run(engine, [(0, ids, SlotParams(max_tokens=16, temperature=1.5, seed=seed))])
        streams.append(out[0][0])
    assert streams[0] == streams[3]
    assert len({tuple(s) for s in streams[:3]}) == 3


def test_bit_identical_beside_a_long_sequence_whose_rows_decode_in_a_call_of_their_own(embedded):
    """A long sequence among short ones: the short rows decode in a call of their own over their own attended
    length (sampler/engine.py, SPLIT_ATTEND), the long one over its own; each request's tokens and logprobs are
    the ones it gets alone. A context of 1024 positions, no warm-up (the few programs compile on first use)."""
    from tpuserve.sampler.engine import JaxEngine

    eng = JaxEngine(embedded, engine_config(slots=8, max_seq_len=1024, prefill_chunk=128))
    tok = embedded.tokenizer
    long_ids = tok.encode(" ".join(PROMPTS * 40))[:700]
    assert len(long_ids) == 700
    ids = tok.encode(PROMPTS[0])
    mine = [(0, ids, GREEDY), (1, ids, SEEDED)]
    groups: list[list[tuple[int, int]]] = []
    original = eng._groups

    def spy():
        out = original()
        groups.append([(attend, batch) for _, attend, batch, _ in out])
        return out

    eng._groups = spy
    alone, _ = run(eng, mine)
    assert all(len(g) == 1 for g in groups)
    groups.clear()
    beside, _ = run(eng, [(2, long_ids, SlotParams(max_tokens=16, temperature=0.0))] + mine)
    assert [(128, 8), (1024, 8)] in groups, groups  # the short rows apart, over 128 positions
    for slot in (0, 1):
        for a, b in zip(alone[slot], beside[slot], strict=True):
            assert np.array_equal(np.array(a), np.array(b)), f"slot {slot}"

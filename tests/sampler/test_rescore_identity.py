"""Sampled = re-scored, bit for bit (EngineConfig.rescore_exact): a generated token's logprob and top-20 equal what
the engine's prompt-logprob path (`echo` with max_tokens 0) gives over prompt + generated tokens, and what
tpuserve.model.scoring.score gives in-process on the same weights. Real weights; greedy and seeded sampling at
temperature 1; prompts of 10, ~300 and ~1,500 tokens; alone and beside 63 other requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tpuserve.model.scoring import score
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.config import EngineConfig

from tests.helpers import run_engine

TEXT = ("The history of the city goes back to a small fishing village on the river, where traders from the south "
        "met farmers from the hills. Over the centuries it grew into a market town, then a port. ")  # fmt: skip


@pytest.fixture(scope="module")
def exact_engine(embedded):
    from tpuserve.sampler.engine import JaxEngine

    cfg = dataclasses.replace(EngineConfig(), max_seq_len=2048, rescore_exact=True, warm_up=False)
    return JaxEngine(embedded, cfg)


@pytest.fixture(scope="module")
def model(embedded, exact_engine):
    return embedded.module(scan_layers=exact_engine.scan_layers)


def _prompt(tok, n: int, salt: int = 0) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(f"Part {len(ids) + salt}. " + TEXT)
    return ids[:n]


def _check(engine, model, prompt: list[int], sampled, in_process: bool = True) -> None:
    ids, lps, top_ids, top_lps = sampled
    n, full = len(prompt), prompt + ids
    echo = engine.prompt_logprobs(engine.prefill(full, want_prompt_logprobs=True))
    got = (np.array(lps, np.float32), np.stack(top_ids), np.stack(top_lps).astype(np.float32))
    for rescored in (echo, score(model, full)) if in_process else (echo,):
        # entry j scores token j+1: generated token i is token n+i
        arrays = (rescored.logprobs, rescored.top_ids, rescored.top_logprobs)
        want = [a[n - 1 : n - 1 + len(ids)] for a in arrays]
        assert (got[0] == want[0]).all(), (len(prompt), got[0] - want[0])
        assert (got[1] == want[1]).all() and (got[2] == want[2]).all(), len(prompt)


GREEDY = SlotParams(max_tokens=12, temperature=0.0)
SAMPLED = SlotParams(max_tokens=12, temperature=1.0, seed=1234)


@pytest.mark.parametrize("length", [10, 300, 1500])
def test_sampled_equals_rescored_alone(exact_engine, model, embedded, length):
    prompt = _prompt(embedded.tokenizer, length)
    out, _ = run_engine(exact_engine, [(0, prompt, GREEDY), (1, prompt, SAMPLED)])
    for slot in (0, 1):  # in-process: the long prompt's greedy sample only (each score prefills it whole)
        _check(exact_engine, model, prompt, out[slot], in_process=length < 1000 or slot == 0)


def test_sampled_equals_rescored_beside_63_others(exact_engine, model, embedded):
    tok = embedded.tokenizer
    mine = {0: (_prompt(tok, 10), GREEDY), 1: (_prompt(tok, 300), SAMPLED)}
    requests = [(s, p, params) for s, (p, params) in mine.items()]
    requests += [(s, _prompt(tok, 8 + 5 * s, salt=s), SlotParams(max_tokens=12, temperature=1.0, seed=s))
                 for s in range(2, 64)]  # fmt: skip
    out, _ = run_engine(exact_engine, requests)
    for slot, (prompt, _) in mine.items():
        _check(exact_engine, model, prompt, out[slot])

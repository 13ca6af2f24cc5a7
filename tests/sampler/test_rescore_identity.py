"""Sampled = re-scored, bit for bit (EngineConfig.rescore_exact): a generated token's logprob and top-20 equal what
the engine's prompt-logprob path (`echo` with max_tokens 0) gives over prompt + generated tokens, and what
tpuserve.model.scoring.score gives in-process on the same weights. Real weights; greedy and seeded sampling at
temperature 1; prompts of 10, ~300 and ~1,500 tokens; alone and beside 63 other requests; and over HTTP (chat and
completions with the openai SDK against `echo`)."""

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
    for slot in (0, 1):  # in-process: not the long prompt (each score prefills it whole; 10 and 300 suffice)
        _check(exact_engine, model, prompt, out[slot], in_process=length < 1000)


def test_sampled_equals_rescored_beside_63_others(exact_engine, model, embedded):
    tok = embedded.tokenizer
    mine = {0: (_prompt(tok, 10), GREEDY), 1: (_prompt(tok, 300), SAMPLED)}
    requests = [(s, p, params) for s, (p, params) in mine.items()]
    requests += [(s, _prompt(tok, 8 + 5 * s, salt=s), SlotParams(max_tokens=12, temperature=1.0, seed=s))
                 for s in range(2, 64)]  # fmt: skip
    out, _ = run_engine(exact_engine, requests)
    for slot, (prompt, _) in mine.items():
        _check(exact_engine, model, prompt, out[slot])


def test_over_http_chat_and_completions_samples_equal_their_echo(exact_engine, embedded):
    """As a client meets it, through the real backend and gateway and the openai SDK: seeded and greedy samples of
    chat and of completions, each alone and then four at once, and their tokens re-scored with `echo`,
    `max_tokens: 0` (prompt ids + sampled ids as the prompt): every logprob and every top-20 entry equal, `==`."""
    from tests.grpc_service.conftest import ServerThread
    from tests.helpers import require_extra
    from tests.http_gateway.gateway_harness import GatewayServer

    openai = require_extra("openai")
    server = ServerThread(exact_engine, embedded.tokenizer, model_id="smol")
    gateway = GatewayServer([server.address]).start()
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x")
    tok = embedded.tokenizer

    def chat(seed):
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": tok.decode(_prompt(tok, 40, salt=seed or 0))}],
            max_tokens=10, logprobs=True, top_logprobs=20, extra_body={"return_token_ids": True},
            **({"temperature": 0} if seed is None else {"temperature": 1, "seed": seed}),
        )  # fmt: skip
        choice = r.choices[0]
        # chat names alternatives by their text as chat writes it; compared by value with the echo's
        entries = [(e.logprob, sorted(t.logprob for t in e.top_logprobs)) for e in choice.logprobs.content]
        return r.model_extra["prompt_token_ids"], choice.model_extra["token_ids"], entries

    def completion(seed):
        r = client.completions.create(
            model="smol", prompt=_prompt(tok, 300, salt=seed or 0), max_tokens=10, logprobs=20,
            extra_body={"return_token_ids": True},
            **({"temperature": 0} if seed is None else {"temperature": 1, "seed": seed}),
        )  # fmt: skip
        c = r.choices[0]
        lp = c.logprobs
        entries = [
            (v, sorted((p, t) for t, p in top.items())) for v, top in zip(lp.token_logprobs, lp.top_logprobs)
        ]
        return c.model_extra["prompt_token_ids"], c.model_extra["token_ids"], entries

    def rescored(prompt_ids, ids):
        r = client.completions.create(
            model="smol", prompt=prompt_ids + ids, max_tokens=0, echo=True, logprobs=20
        )
        lp = r.choices[0].logprobs
        n = len(prompt_ids)
        return [(v, sorted((p, t) for t, p in top.items()))
                for v, top in zip(lp.token_logprobs[n:], lp.top_logprobs[n:])]  # fmt: skip

    try:
        import concurrent.futures

        calls = [(chat, None), (chat, 7), (completion, None), (completion, 11)]
        alone = [fn(seed) for fn, seed in calls]
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            together = list(pool.map(lambda c: c[0](c[1]), calls))
        for (fn, _), (prompt_ids, ids, entries) in zip(calls + calls, alone + together, strict=True):
            want = rescored(prompt_ids, ids)[: len(entries)]
            # chat shows no entry for the EOS that ended a sample (the echo scores it)
            assert len(entries) >= len(ids) - 1 and len(want) == len(entries)
            for (value, tops), (want_value, want_tops) in zip(entries, want, strict=True):
                assert value == want_value
                if fn is completion:
                    assert tops == want_tops
                else:  # chat's alternatives by value: the echo's dict is the top 20 and the token itself, one
                    # entry per distinct text
                    values = sorted(v for v, _ in want_tops)
                    if len(values) == 21:
                        values.remove(want_value)
                    assert tops == values if len(values) == 20 else set(values) - {want_value} <= set(tops)
    finally:
        gateway.stop()
        server.close()

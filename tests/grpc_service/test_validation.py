"""Every invalid request is INVALID_ARGUMENT naming its field, before it takes a place in the queue."""

from __future__ import annotations

import grpc
import pytest
from tpuserve.grpc_service.validation import InvalidRequest, stop_ids
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.sampler.state import MAX_STOP_IDS

from tests.grpc_service.conftest import generate

S = 256  # the shared server's context length

CASES = {
    "no prompt": ({}, "prompt"),
    "empty text": ({"text": ""}, "prompt.text"),
    "empty ids": ({"token_ids": pb.TokenIds(ids=[])}, "prompt.token_ids"),
    "id over vocab": ({"token_ids": pb.TokenIds(ids=[1, 49152])}, "prompt.token_ids"),
    "negative id": ({"token_ids": pb.TokenIds(ids=[-1])}, "prompt.token_ids"),
    "no chat messages": ({"chat": pb.ChatMessages()}, "prompt.chat.messages"),
    "prompt over context": ({"token_ids": pb.TokenIds(ids=[5] * (S + 1))}, "prompt"),
    "prompt fills context": ({"token_ids": pb.TokenIds(ids=[5] * S)}, "prompt"),
    "prompt + max_tokens over context": (
        {"token_ids": pb.TokenIds(ids=[5] * 200), "stopping": pb.StoppingCriteria(max_tokens=57)},
        "stopping.max_tokens",
    ),
    "top_logprobs 21": (
        {"logprobs": pb.LogprobOptions(enabled=True, top_logprobs=21)},
        "logprobs.top_logprobs",
    ),
    "top_logprobs -1": (
        {"logprobs": pb.LogprobOptions(enabled=True, top_logprobs=-1)},
        "logprobs.top_logprobs",
    ),
    "temperature < 0": ({"sampling": pb.SamplingParams(temperature=-0.1)}, "sampling.temperature"),
    "temperature nan": ({"sampling": pb.SamplingParams(temperature=float("nan"))}, "sampling.temperature"),
    "top_p 0": ({"sampling": pb.SamplingParams(top_p=0.0)}, "sampling.top_p"),
    "top_p > 1": ({"sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    "top_k < 0": ({"sampling": pb.SamplingParams(top_k=-1)}, "sampling.top_k"),
    "min_p > 1": ({"sampling": pb.SamplingParams(min_p=2.0)}, "sampling.min_p"),
    "n < 0": ({"n": -1}, "n"),
    "n over max_n": ({"n": 17}, "n"),
    "max_tokens < 0": ({"stopping": pb.StoppingCriteria(max_tokens=-1)}, "stopping.max_tokens"),
    "max_tokens 0 without prompt logprobs": (
        {"stopping": pb.StoppingCriteria(max_tokens=0)},
        "stopping.max_tokens",
    ),
    "empty stop string": ({"stopping": pb.StoppingCriteria(stop=["a", ""])}, "stopping.stop"),
    "stop id over vocab": (
        {"stopping": pb.StoppingCriteria(stop_token_ids=[10**6])},
        "stopping.stop_token_ids",
    ),
    "more stop ids than the engine holds": (
        {"stopping": pb.StoppingCriteria(stop_token_ids=range(100, 101 + MAX_STOP_IDS))},
        "stopping.stop_token_ids",
    ),
    "cache_salt over 256 characters": ({"cache_salt": "s" * 257}, "cache_salt"),
    "cache_salt empty": ({"cache_salt": ""}, "cache_salt"),
}


@pytest.mark.parametrize("fields,field", CASES.values(), ids=CASES.keys())
def test_invalid_request(served, fields, field):
    if "prompt" not in field and not any(k in fields for k in ("text", "token_ids", "chat")):
        fields = {"text": "hello", **fields}
    before = len(served.engine.prefills)
    with pytest.raises(grpc.RpcError) as info:
        generate(served.stub, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: "), info.value.details()
    assert len(served.engine.prefills) == before


def test_limits_are_inclusive(served):
    full = generate(
        served.stub,
        token_ids=pb.TokenIds(ids=[5] * 200),
        stopping=pb.StoppingCriteria(max_tokens=56),
        logprobs=pb.LogprobOptions(enabled=True, top_logprobs=20),
        n=16,
    )
    assert sum(len(r.tokens) for r in full) == 16 * 56
    scored = generate(
        served.stub,
        token_ids=pb.TokenIds(ids=[5] * S),
        stopping=pb.StoppingCriteria(max_tokens=0),
        logprobs=pb.LogprobOptions(prompt_logprobs=True),
    )
    assert len(scored[0].prompt_tokens) == S
    salted = generate(
        served.stub, text="hello", cache_salt="é" * 256, stopping=pb.StoppingCriteria(max_tokens=1)
    )
    assert salted[-1].finished and served.engine.salts[-1] == "é" * 256  # characters, not UTF-8 bytes


def test_absent_max_tokens_fills_the_context(served):
    before = len(served.engine.inserts)
    generate(served.stub, token_ids=pb.TokenIds(ids=[5] * 250), stopping=pb.StoppingCriteria(ignore_eos=True))
    assert served.engine.inserts[before][1].max_tokens == S - 250


def test_stop_ids_share_the_engines_places_with_the_eos_ids():
    eos = (2, 0)
    room = list(range(100, 100 + MAX_STOP_IDS - len(eos)))
    assert stop_ids(pb.StoppingCriteria(stop_token_ids=room), eos) == (
        frozenset(eos),
        tuple(sorted([*eos, *room])),
    )
    # an EOS id or a repeated id in the request takes no second place
    assert len(stop_ids(pb.StoppingCriteria(stop_token_ids=[*room, 2, room[0]]), eos)[1]) == MAX_STOP_IDS
    with pytest.raises(InvalidRequest) as info:
        stop_ids(pb.StoppingCriteria(stop_token_ids=[*room, 99]), eos)
    assert info.value.field == "stopping.stop_token_ids"
    assert f"at most {MAX_STOP_IDS}" in str(info.value) and "[0, 2]" in str(info.value)
    # without the EOS ids (ignore_eos) the request has every place
    every = list(range(100, 100 + MAX_STOP_IDS))
    assert stop_ids(pb.StoppingCriteria(stop_token_ids=every, ignore_eos=True), eos) == (
        frozenset(),
        tuple(every),
    )


def test_sample_seeds_are_seed_plus_i_within_64_bits(served):
    before = len(served.engine.inserts)
    generate(
        served.stub,
        text="hello",
        n=2,
        sampling=pb.SamplingParams(seed=2**64 - 1),
        stopping=pb.StoppingCriteria(max_tokens=1),
    )
    assert sorted(p.seed for _, p in served.engine.inserts[before:]) == [0, 2**64 - 1]


def test_a_prompt_longer_than_the_kv_pool_names_the_pool():
    """An engine whose pool holds fewer tokens than its context: a longer prompt is refused before it queues, and
    the message names the pool's size (a paged engine's `max_prompt_len`, Limits.pool_tokens); the servicer also
    bounds prompt + max_tokens by it (context_length), so no sequence can outgrow the pool."""
    from tpuserve.grpc_service.validation import Limits, prompt_ids

    limits = Limits(vocab_size=100, context_length=64, max_n=1, pool_tokens=64)  # as the servicer sets them
    assert prompt_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 64)), None, limits) == [5] * 64
    with pytest.raises(InvalidRequest, match="KV cache holds \\(64 tokens\\)") as refused:
        prompt_ids(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 65)), None, limits)
    assert refused.value.field == "prompt"

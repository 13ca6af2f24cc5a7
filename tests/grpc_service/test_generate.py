"""Generate over a real channel: tokens, raw bytes, text, logprobs, samples, seeds, stops, prompt scoring."""

from __future__ import annotations

import grpc
import pytest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.grpc_service.conftest import FAIL_PREFILL_TEXT, generate
from tests.grpc_service.fake_engine import K, prompt_logprob, token_logprob

EMOJI_TEXT = "héllo 😀 世界"


def sample_messages(responses, index=0):
    return [r for r in responses if r.index == index and (r.tokens or r.text or r.finished)]


def tokens_of(responses, index=0):
    return [t for r in sample_messages(responses, index) for t in r.tokens]


def text_of(responses, index=0):
    return "".join(r.text for r in sample_messages(responses, index))


def script(served, tokenizer, prompt: str, generated: list[int]) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(prompt))
    served.engine.scripts[ids] = generated
    return ids


def test_split_characters_stream_as_raw_bytes_and_whole_text(served, tokenizer):
    ids = tokenizer.encode(EMOJI_TEXT, add_special_tokens=False)
    assert any(
        not tokenizer.token_bytes[i].decode("utf-8", "ignore") for i in ids
    )  # a token splits a character
    script(served, tokenizer, "emoji please", ids)
    responses = generate(
        served.stub, text="emoji please", request_id="r-emoji", logprobs=pb.LogprobOptions(enabled=True)
    )
    assert {r.request_id for r in responses} == {"r-emoji"}
    tokens = tokens_of(responses)
    assert [t.token_id for t in tokens] == [*ids, tokenizer.eos_ids[0]]
    assert [t.index for t in tokens] == list(range(len(ids) + 1))
    assert text_of(responses) == EMOJI_TEXT
    assert b"".join(t.token_bytes for t in tokens) == EMOJI_TEXT.encode()
    for r in responses:  # each message's tokens carry exactly its text
        assert b"".join(t.token_bytes for t in r.tokens) == r.text.encode()
        assert "\ufffd" not in r.text
    eos = tokens[-1]
    assert eos.special and eos.special_text == "<|im_end|>" and eos.token_bytes == b""
    assert eos.logprob == pytest.approx(token_logprob(len(ids)))
    last = responses[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_EOS
    assert last.completion_tokens_count == len(ids) + 1  # the EOS is counted
    assert last.prompt_tokens_count == len(tokenizer.encode("emoji please"))


def test_logprobs_and_top_k_sorted_and_trimmed(served):
    for k in (0, 5, K):
        responses = generate(
            served.stub,
            text="top k",
            stopping=pb.StoppingCriteria(max_tokens=6),
            logprobs=pb.LogprobOptions(enabled=True, top_logprobs=k),
        )
        tokens = tokens_of(responses)
        assert len(tokens) == 6
        for j, t in enumerate(tokens):
            assert t.HasField("logprob") and t.logprob == pytest.approx(token_logprob(j))
            assert len(t.top_logprobs) == k
            lps = [a.logprob for a in t.top_logprobs]
            assert lps == sorted(lps, reverse=True)
            if k:
                assert (
                    t.top_logprobs[0].token_id == t.token_id
                    and t.top_logprobs[0].token_bytes == t.token_bytes
                )
                assert lps == pytest.approx([token_logprob(j) - a / 2 for a in range(k)])
                assert [a.token_id for a in t.top_logprobs][1] == (t.token_id + 1) % served.engine.vocab_size


def test_logprobs_off_sends_none(served):
    tokens = tokens_of(generate(served.stub, text="no logprobs", stopping=pb.StoppingCriteria(max_tokens=3)))
    assert len(tokens) == 3 and not any(t.HasField("logprob") or t.top_logprobs for t in tokens)


def test_n_samples_with_seeds_passed_through(served):
    before = len(served.engine.inserts)
    request = {
        "text": "three samples",
        "n": 3,
        "sampling": pb.SamplingParams(seed=41, temperature=0.7, top_p=0.9, top_k=7),
        "stopping": pb.StoppingCriteria(max_tokens=5),
    }
    responses = generate(served.stub, **request)
    params = [p for _, p in served.engine.inserts[before:]]
    assert sorted(p.seed for p in params) == [41, 42, 43]
    assert all((p.temperature, p.top_k, p.max_tokens) == (pytest.approx(0.7), 7, 5) for p in params)
    assert all(p.top_p == pytest.approx(0.9) for p in params)
    texts = [text_of(responses, i) for i in range(3)]
    assert len(set(texts)) == 3  # the fake's output depends on the seed
    for i in range(3):
        last = sample_messages(responses, i)[-1]
        assert (
            last.finished
            and last.finish_reason == pb.FINISH_REASON_LENGTH
            and last.completion_tokens_count == 5
        )
    again = generate(served.stub, **request)
    assert [text_of(again, i) for i in range(3)] == texts


def test_random_seed_when_absent(served):
    before = len(served.engine.inserts)
    generate(served.stub, text="random", n=2, stopping=pb.StoppingCriteria(max_tokens=1))
    seeds = sorted(p.seed for _, p in served.engine.inserts[before:])
    assert seeds[1] == seeds[0] + 1


def test_stop_string_spanning_tokens(served, tokenizer):
    ids = tokenizer.encode("hello world. Goodbye", add_special_tokens=False)
    script(served, tokenizer, "stop test", ids)
    responses = generate(served.stub, text="stop test", stopping=pb.StoppingCriteria(stop=["ld. Go"]))
    assert text_of(responses) == "hello wor"
    kept = tokens_of(responses)
    assert b"".join(t.token_bytes for t in kept) == b"hello world"  # " world" began before the stop string
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_reason == "ld. Go"
    assert last.completion_tokens_count == len(kept)

    included = generate(
        served.stub, text="stop test", stopping=pb.StoppingCriteria(stop=["ld. Go"], include_stop_str=True)
    )
    assert text_of(included) == "hello world. Go"
    assert b"".join(t.token_bytes for t in tokens_of(included)) == b"hello world. Good"


def test_stop_token_id(served, tokenizer):
    ids = tokenizer.encode("one, two, three", add_special_tokens=False)
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    script(served, tokenizer, "stop id test", ids)
    responses = generate(
        served.stub, text="stop id test", stopping=pb.StoppingCriteria(stop_token_ids=[comma])
    )
    assert text_of(responses) == "one"
    assert tokens_of(responses)[-1].token_id == comma
    last = responses[-1]
    assert (
        last.finish_reason == pb.FINISH_REASON_STOP and last.stop_token_id == comma and not last.stop_reason
    )


def test_ignore_eos_runs_to_max_tokens(served, tokenizer):
    ids = tokenizer.encode("ab", add_special_tokens=False)
    script(served, tokenizer, "ignore eos", ids)
    responses = generate(
        served.stub, text="ignore eos", stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True)
    )
    assert len(tokens_of(responses)) == 4 and responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_max_tokens_zero_scores_the_prompt(served, tokenizer):
    before = len(served.engine.inserts)
    prompt = tokenizer.encode("Score this 😀 text")
    responses = generate(
        served.stub,
        token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingCriteria(max_tokens=0),
        logprobs=pb.LogprobOptions(prompt_logprobs=True, top_logprobs=2),
    )
    first = responses[0]
    assert [t.token_id for t in first.prompt_tokens] == prompt and first.prompt_tokens_count == len(prompt)
    assert b"".join(t.token_bytes for t in first.prompt_tokens) == "Score this 😀 text".encode()
    assert not first.prompt_tokens[0].HasField("logprob") and not first.prompt_tokens[0].top_logprobs
    for j, t in enumerate(first.prompt_tokens[1:], start=1):
        assert t.logprob == pytest.approx(prompt_logprob(j)) and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token_id == t.token_id
    last = responses[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert not tokens_of(responses) and last.completion_tokens_count == 0
    assert len(served.engine.inserts) == before  # no slot taken


def test_prompt_logprobs_come_once_before_the_tokens(served):
    responses = generate(
        served.stub,
        text="prompt and tokens",
        n=2,
        stopping=pb.StoppingCriteria(max_tokens=3),
        logprobs=pb.LogprobOptions(enabled=True, prompt_logprobs=True),
    )
    with_prompt = [r for r in responses if r.prompt_tokens]
    assert len(with_prompt) == 1 and responses[0] is with_prompt[0] and responses[0].index == 0
    assert [len(tokens_of(responses, i)) for i in range(2)] == [3, 3]


def test_chat_prompt(served, tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi <|im_end|>")])
    _, ids = tokenizer.render_chat([{"role": "user", "content": "hi <|im_end|>"}])
    before = len(served.engine.prefills)
    generate(served.stub, chat=chat, stopping=pb.StoppingCriteria(max_tokens=1))
    assert served.engine.prefills[before] == ids


def test_engine_error_is_internal(served):
    with pytest.raises(grpc.RpcError) as info:
        generate(served.stub, text=FAIL_PREFILL_TEXT)
    assert info.value.code() == grpc.StatusCode.INTERNAL and "prefill" in info.value.details()
    assert (
        len(
            tokens_of(generate(served.stub, text="still serving", stopping=pb.StoppingCriteria(max_tokens=2)))
        )
        == 2
    )


def test_cached_prompt_tokens_reach_every_final_message(served):
    """The fake engine's cache (fake_engine.py): a repeat of a 10-token prompt under the same salt finds 8 tokens
    (2 blocks of 4; the last token is always computed). The count is on each sample's final message and on the
    prompt-logprobs message, 0 elsewhere; another salt or none shares nothing."""
    ids = [1000 + i for i in range(10)]  # a prompt no other test sends

    def run(**fields):
        return generate(
            served.stub,
            token_ids=pb.TokenIds(ids=ids),
            stopping=pb.StoppingCriteria(max_tokens=3),
            sampling=pb.SamplingParams(seed=5),
            **fields,
        )

    def finals(responses):
        return [
            (r.index, r.prompt_tokens_count, r.cached_prompt_tokens_count) for r in responses if r.finished
        ]

    cold = run(cache_salt="test-generate", n=2)
    warm = run(cache_salt="test-generate", n=2, logprobs=pb.LogprobOptions(prompt_logprobs=True))
    assert sorted(finals(cold)) == [(0, 10, 0), (1, 10, 0)]
    assert sorted(finals(warm)) == [(0, 10, 8), (1, 10, 8)]
    assert warm[0].prompt_tokens and warm[0].cached_prompt_tokens_count == 8
    assert all(r.cached_prompt_tokens_count == 0 for r in warm[1:] if not r.finished)
    assert [tokens_of(cold, i) for i in range(2)] == [tokens_of(warm, i) for i in range(2)]  # same outputs
    assert finals(run(cache_salt="another tenant")) == [(0, 10, 0)]
    assert finals(run()) == [(0, 10, 0)]  # absent: the default namespace, which has not seen it
    assert finals(run()) == [(0, 10, 8)]
    assert served.engine.salts[-5:] == ["test-generate", "test-generate", "another tenant", None, None]

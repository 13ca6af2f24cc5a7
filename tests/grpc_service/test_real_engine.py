"""The real gRPC backend over the REAL engine and the embedded SmolLM2, through a real channel: streamed bytes
and text, greedy = the engine's own full-sequence forward, logprobs and top-k, partial-UTF-8 tokens, n samples
with a seed, the context limit, and cancellation freeing every slot. Few tokens each: the whole file is cheap."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.sampler.state import MAX_STOP_IDS

from tests.grpc_service.conftest import generate
from tests.helpers import wait_until


def chat(text: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])


def greedy(max_tokens: int, **fields) -> dict:
    return dict(
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
        **fields,
    )


def samples(
    responses: list[pb.GenerateResponse],
) -> dict[int, tuple[list[pb.Token], str, pb.GenerateResponse]]:
    """Per sample index: (all tokens, all text, the final message)."""
    out: dict[int, tuple[list[pb.Token], str, pb.GenerateResponse | None]] = {}
    for r in responses:
        if r.prompt_tokens:
            continue
        tokens, text, _ = out.get(r.index, ([], "", None))
        out[r.index] = (tokens + list(r.tokens), text + r.text, r if r.finished else None)
    for index, (_, _, last) in out.items():
        assert last is not None and last.finished, f"sample {index} never finished"
    return out


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_chat_streams_paris_and_ends_with_im_end(real_backend):
    responses = generate(real_backend.stub, chat=chat("What is the capital of France?"), **greedy(16))
    assert len(responses) > 1  # really streamed, not one message at the end
    tokens, text, last = samples(responses)[0]
    assert b"".join(t.token_bytes for t in tokens) == text.encode("utf-8")
    assert "Paris" in text
    assert last.finish_reason == pb.FINISH_REASON_EOS
    assert tokens[-1].special and tokens[-1].special_text == "<|im_end|>" and tokens[-1].token_bytes == b""
    assert not any(t.special for t in tokens[:-1])
    assert last.completion_tokens_count == len(tokens)
    assert [t.index for t in tokens] == list(range(len(tokens)))


def test_greedy_and_logprobs_equal_the_engines_forward_pass(real_backend, engine, embedded):
    prompt = "The capital of France is"
    responses = generate(
        real_backend.stub, text=prompt, logprobs=pb.LogprobOptions(enabled=True, top_logprobs=5), **greedy(12)
    )
    tokens, _, last = samples(responses)[0]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 12
    for t in tokens:
        assert t.HasField("logprob") and len(t.top_logprobs) == 5  # K honoured
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        assert t.top_logprobs[0].token_id == t.token_id  # greedy: the sampled token is the top alternative
        assert t.logprob == pytest.approx(alts[0], abs=1e-6)
        assert all(a.token_bytes == embedded.tokenizer.token_bytes[a.token_id] for a in t.top_logprobs)

    # Reference: one prefill of prompt + generated tokens scores every generated token given its prefix (the
    # prefill program, not the decode loop); each must be the argmax there, with the same logprobs.
    prompt_ids = embedded.tokenizer.encode(prompt)
    ids = prompt_ids + [t.token_id for t in tokens]
    ref = engine.prompt_logprobs(engine.prefill(ids, want_prompt_logprobs=True))
    for j, t in enumerate(tokens):
        row = len(prompt_ids) - 1 + j  # entry of token prompt_len + j
        assert int(ref.top_ids[row, 0]) == t.token_id or ref.top_logprobs[row, 0] - ref.logprobs[row] < 1e-3
        assert t.logprob == pytest.approx(float(ref.logprobs[row]), abs=2e-3)
        np.testing.assert_allclose([a.logprob for a in t.top_logprobs], ref.top_logprobs[row, :5], atol=2e-3)


def test_emoji_and_cjk_tokens_split_utf8(real_backend):
    prompt = "😀 世界 🎉"
    responses = generate(
        real_backend.stub,
        text=prompt,
        add_special_tokens=False,
        logprobs=pb.LogprobOptions(enabled=True, top_logprobs=2, prompt_logprobs=True),
        stopping=pb.StoppingCriteria(max_tokens=0),
    )
    prompt_msgs = [r for r in responses if r.prompt_tokens]
    assert len(prompt_msgs) == 1
    ptoks = prompt_msgs[0].prompt_tokens
    assert b"".join(t.token_bytes for t in ptoks) == prompt.encode("utf-8")
    assert any(not is_utf8(t.token_bytes) for t in ptoks), "expected tokens that are partial UTF-8"
    assert not ptoks[0].HasField("logprob") and all(t.HasField("logprob") for t in ptoks[1:])
    assert prompt_msgs[0].prompt_tokens_count == len(ptoks)

    # A reply in a script the model splits into partial-UTF-8 tokens: bytes still add up to the text, except a
    # half character cut by max_tokens (kept in the tokens, not in the text).
    responses = generate(real_backend.stub, text="世界你好。中文：你好世界！😀🎉🎉", **greedy(12))
    tokens, text, _ = samples(responses)[0]
    raw = b"".join(t.token_bytes for t in tokens)
    assert raw.startswith(text.encode("utf-8")) and len(raw) - len(text.encode("utf-8")) < 4
    assert "\ufffd" not in text


def test_n_samples_with_a_seed_are_reproducible(real_backend):
    fields = {
        "text": "Once upon a time",
        "n": 3,
        "sampling": pb.SamplingParams(temperature=1.0, seed=1234),
        "stopping": pb.StoppingCriteria(max_tokens=8),
    }
    first = samples(generate(real_backend.stub, **fields))
    second = samples(generate(real_backend.stub, **fields))
    assert sorted(first) == [0, 1, 2]
    ids = {i: [t.token_id for t in first[i][0]] for i in first}
    assert ids == {i: [t.token_id for t in second[i][0]] for i in second}
    assert {i: first[i][1] for i in first} == {i: second[i][1] for i in second}
    assert len({tuple(v) for v in ids.values()}) > 1  # different seeds per sample


def test_prompt_plus_max_tokens_over_the_context_is_invalid(real_backend, embedded):
    ids = embedded.tokenizer.encode("word " * 250)
    assert 240 < len(ids) <= 256
    with pytest.raises(grpc.RpcError) as err:
        generate(
            real_backend.stub, token_ids=pb.TokenIds(ids=ids), stopping=pb.StoppingCriteria(max_tokens=16)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "256" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        generate(
            real_backend.stub, token_ids=pb.TokenIds(ids=ids * 2), stopping=pb.StoppingCriteria(max_tokens=1)
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_more_stop_ids_than_the_engine_holds_are_invalid_not_internal(real_backend, embedded):
    """The request's stop ids and the model's EOS ids share MAX_STOP_IDS places: one more is INVALID_ARGUMENT
    naming the field (it reached the engine, an INTERNAL error, before); as many as fit still serve."""
    eos = set(embedded.tokenizer.eos_ids)
    ids = [i for i in range(100, 200) if i not in eos]
    fit = ids[: MAX_STOP_IDS - len(eos)]
    with pytest.raises(grpc.RpcError) as err:
        generate(
            real_backend.stub, text="Hi", stopping=pb.StoppingCriteria(stop_token_ids=[*fit, ids[len(fit)]])
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("stopping.stop_token_ids: "), err.value.details()
    tokens, _, last = samples(
        generate(real_backend.stub, text="Hi", stopping=pb.StoppingCriteria(max_tokens=2, stop_token_ids=fit))
    )[0]
    assert last.finished and 1 <= len(tokens) <= 2


def test_cancelled_streams_free_their_slots(real_backend, engine):
    request = pb.GenerateRequest(
        text="Tell me a very long story.",
        sampling=pb.SamplingParams(temperature=1.0, seed=7),
        stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True),
    )
    calls = [real_backend.stub.Generate(request, timeout=60) for _ in range(6)]
    for call in calls:
        assert next(call).tokens  # mid-generation
    assert real_backend.orchestrator.free_slots <= engine.slots - 6
    for call in calls:
        call.cancel()
    assert wait_until(
        lambda: real_backend.orchestrator.free_slots == engine.slots and not engine.occupied_slots, timeout=60
    ), "cancelled streams still hold slots"
    tokens, _, last = samples(generate(real_backend.stub, text="after", **greedy(3)))[0]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 3


def test_special_alternatives_carry_their_text(real_backend, embedded):
    """<|im_end|> offered as an alternative has no bytes: its special_text names it for the renderers."""
    tok = embedded.tokenizer
    _, ids = tok.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=24),
        logprobs=pb.LogprobOptions(enabled=True, top_logprobs=20),
    )
    alts = [a for r in real_backend.stub.Generate(req) for t in r.tokens for a in t.top_logprobs]
    specials = [a for a in alts if a.token_id in tok.special_ids]
    assert specials, "the EOS ending the reply is its own top alternative"
    for a in specials:
        assert a.special and a.special_text == tok.token_text(a.token_id) and a.token_bytes == b""
    assert all(not a.special and a.special_text == "" for a in alts if a.token_id not in tok.special_ids)


def test_short_prompts_arriving_together_stream_what_each_streams_alone(
    together_engine, embedded, monkeypatch
):
    """8 short prompts sent at once while another stream decodes are prefilled in one program (make serve's
    prefill settings), and each streams the tokens and logprobs it streams when sent alone, greedy and seeded."""
    import threading

    from tests.grpc_service.conftest import ServerThread

    rows: list[int] = []
    original = together_engine.programs.chunk_together

    def spy(params, pool, tokens, last, tables, attend_len):
        rows.append(tokens.shape[0])
        return original(params, pool, tokens, last, tables, attend_len=attend_len)

    monkeypatch.setattr(together_engine, "programs", together_engine.programs._replace(chunk_together=spy))
    server = ServerThread(together_engine, embedded.tokenizer, model_id=embedded.model_id)
    texts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Roses are red,",
             "1, 2, 3, 4,", "Dear diary, today", "The recipe begins with", "In a galaxy far away"]  # fmt: skip

    def fields(i: int) -> dict:
        sampling = pb.SamplingParams(temperature=0.0) if i % 2 else pb.SamplingParams(temperature=1.0, seed=i)
        return {
            "text": texts[i],
            "sampling": sampling,
            "stopping": pb.StoppingCriteria(max_tokens=6, ignore_eos=True),
            "logprobs": pb.LogprobOptions(enabled=True, top_logprobs=3),
        }

    def streamed(responses) -> list[tuple]:
        tokens, _, _ = samples(responses)[0]
        return [(t.token_id, t.logprob, [(a.token_id, a.logprob) for a in t.top_logprobs]) for t in tokens]

    try:
        background = server.stub.Generate(
            pb.GenerateRequest(text="Tell me a very long story.", sampling=pb.SamplingParams(temperature=0.0),
                               stopping=pb.StoppingCriteria(max_tokens=200, ignore_eos=True)), timeout=120)  # fmt: skip
        assert next(background).tokens  # decoding: the 8 below arrive during one of its decode calls
        together: dict[int, list] = {}

        def send(i: int) -> None:
            together[i] = streamed(generate(server.stub, timeout=120, **fields(i)))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        background.cancel()
        assert max(rows) >= 4, f"rows of each prefill_together program: {rows}"
        rows.clear()
        for i in range(len(texts)):
            assert streamed(generate(server.stub, timeout=120, **fields(i))) == together[i], texts[i]
        assert rows == []  # one at a time: each prompt prefilled alone
    finally:
        server.close()

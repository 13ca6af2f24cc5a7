"""The seed bug reports, verbatim, against the gateway (any backend)."""

from __future__ import annotations

from gateway_checks import check_chat_choice, post


def test_seed_chat_logprobs_true_without_top_logprobs_is_200_with_empty_top_logprobs(gateway) -> None:
    # vLLM: 400 "Top logprobs must be set when logprobs is." OpenAI: 200, every entry top_logprobs=[].
    data = post(
        gateway.http,
        "/v1/chat/completions",
        {
            "model": gateway.model,
            "messages": [{"role": "user", "content": "Hi!"}],
            "logprobs": True,
            "max_tokens": 16,
        },
    )
    choice = data["choices"][0]
    assert choice["logprobs"]["content"], "logprobs.content is empty"
    for entry in choice["logprobs"]["content"]:
        assert entry["top_logprobs"] == []
        assert set(entry) == {"token", "bytes", "logprob", "top_logprobs"}
    check_chat_choice(choice, logprobs=True, k=None)
    assert data["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])


def test_seed_chat_top_logprobs_1_has_the_chat_shape_not_the_legacy_one(gateway) -> None:
    # vLLM returned content=None plus tokens/token_logprobs/top_logprobs dicts/text_offset with 'Ġ' tokens.
    data = post(
        gateway.http,
        "/v1/chat/completions",
        {
            "model": gateway.model,
            "messages": [{"role": "user", "content": "Hi!"}],
            "logprobs": True,
            "top_logprobs": 1,
            "max_tokens": 16,
        },
    )
    choice = data["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"content", "refusal"}
    for legacy in ("tokens", "token_logprobs", "text_offset"):
        assert legacy not in lp
    assert lp["content"]
    for entry in lp["content"]:
        assert len(entry["top_logprobs"]) == 1
        assert isinstance(entry["top_logprobs"][0], dict) and set(entry["top_logprobs"][0]) == {
            "token",
            "bytes",
            "logprob",
        }
        assert "Ġ" not in entry["token"] and "Ċ" not in entry["token"]
        assert entry["bytes"] == list(entry["token"].encode()) or "\\x" in entry["token"]
    assert "<|im_end|>" not in [e["token"] for e in lp["content"]]
    check_chat_choice(choice, logprobs=True, k=1)


def test_seed_fastchat_completions_logprobs_1_is_not_null(gateway) -> None:
    # FastChat: `Completion.create(..., logprobs=1)` returned 'logprobs': null.
    data = post(
        gateway.http,
        "/v1/completions",
        {"model": gateway.model, "prompt": "Once upon a time", "logprobs": 1, "max_tokens": 8},
    )
    lp = data["choices"][0]["logprobs"]
    assert lp is not None
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        >= 1
    )
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 2 and top[token] == logprob

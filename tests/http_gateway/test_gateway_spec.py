"""The OpenAI spec checks themselves: the file is there, and the converted schemas reject what they should."""

from __future__ import annotations

import jsonschema
import pytest

GOOD_CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def test_openai_spec_present(spec) -> None:
    assert spec.SPEC_PATH.exists()


def test_spec_accepts_a_good_chat_completion(spec) -> None:
    spec.validate(GOOD_CHAT, "CreateChatCompletionResponse")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["choices"][0]["message"].pop("refusal"),
        lambda d: d["choices"][0].pop("logprobs"),
        lambda d: d["choices"][0].update(finish_reason="eos"),
        lambda d: d["choices"][0].update(
            logprobs={"content": [{"token": "a", "logprob": -1.0}], "refusal": None}
        ),
        lambda d: d.update(object="text_completion"),
    ],
    ids=["no-refusal", "no-logprobs-key", "bad-finish", "entry-missing-fields", "wrong-object"],
)
def test_spec_rejects_broken_chat_completions(spec, mutate) -> None:
    import copy

    bad = copy.deepcopy(GOOD_CHAT)
    mutate(bad)
    with pytest.raises(jsonschema.ValidationError):
        spec.validate(bad, "CreateChatCompletionResponse")


def test_nullable_fields_accept_null_only_where_the_spec_says(spec) -> None:
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "usage": None,
        "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}],
    }
    spec.validate(chunk, "CreateChatCompletionStreamResponse")
    chunk["choices"][0]["delta"]["role"] = None  # role is not nullable
    with pytest.raises(jsonschema.ValidationError):
        spec.validate(chunk, "CreateChatCompletionStreamResponse")


def test_error_response_needs_all_four_fields(spec) -> None:
    spec.validate({"error": {"message": "m", "type": "t", "param": None, "code": None}}, "ErrorResponse")
    with pytest.raises(jsonschema.ValidationError):
        spec.validate({"error": {"message": "m", "type": "t"}}, "ErrorResponse")
    with pytest.raises(jsonschema.ValidationError):
        spec.validate({"detail": [{"msg": "422-style"}]}, "ErrorResponse")

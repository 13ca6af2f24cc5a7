"""The official `openai` Python SDK drives the gateway and reads logprobs through its typed objects."""

from __future__ import annotations

import openai
import pytest
from gateway_harness import API_KEY
from scripted_backend import DEFAULT_REPLY


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def scripted_client(scripted_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_list(client, gateway) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [gateway.model]
    assert client.models.retrieve(gateway.model).id == gateway.model


def test_chat_with_logprobs_true_reads_typed_entries(scripted_client, scripted_gateway) -> None:
    completion = scripted_client.chat.completions.create(
        model=scripted_gateway.model,
        messages=[{"role": "user", "content": "Hi!"}],
        logprobs=True,
        max_tokens=16,
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.logprobs is not None
    entries = choice.logprobs.content
    assert entries and all(e.top_logprobs == [] for e in entries)
    assert choice.finish_reason == "stop"  # the scripted reply ends with EOS: neither an entry nor counted
    assert b"".join(bytes(e.bytes) for e in entries) == choice.message.content.encode()
    assert completion.usage.completion_tokens == len(entries)


def test_chat_top_logprobs_typed(scripted_client, scripted_gateway) -> None:
    completion = scripted_client.chat.completions.create(
        model=scripted_gateway.model,
        messages=[{"role": "user", "content": "Hi!"}],
        logprobs=True,
        top_logprobs=2,
    )
    choice = completion.choices[0]
    assert choice.message.content == DEFAULT_REPLY and choice.finish_reason == "stop"
    assert [e.token for e in choice.logprobs.content][:3] == ["Hello", "!", " How"]
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert completion.usage.completion_tokens == len(choice.logprobs.content) == 9


def test_chat_without_logprobs_has_none(scripted_client, scripted_gateway) -> None:
    completion = scripted_client.chat.completions.create(
        model=scripted_gateway.model, messages=[{"role": "user", "content": "Hi!"}], max_completion_tokens=8
    )
    assert completion.choices[0].logprobs is None


def test_chat_stream_with_usage(client, gateway) -> None:
    stream = client.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],  # both backends stop (EOS)
        logprobs=True,
        top_logprobs=1,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, entries, finish, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                entries += choice.logprobs.content
            finish = choice.finish_reason or finish
    assert finish == "stop" and usage is not None
    assert all(len(e.top_logprobs) == 1 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
    assert usage.completion_tokens == len(entries)  # the ending EOS is neither an entry nor counted


def test_completions_with_logprobs_and_echo(scripted_client, scripted_gateway) -> None:
    completion = scripted_client.completions.create(
        model=scripted_gateway.model, prompt="say:Hi there", echo=True, logprobs=1, max_tokens=8
    )
    choice = completion.choices[0]
    lp = choice.logprobs
    assert choice.text == "say:Hi thereHi there"
    assert lp.tokens[-1] == "<|im_end|>"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0
    assert completion.usage.completion_tokens == 3


def test_completions_any_backend(client, gateway) -> None:
    completion = client.completions.create(
        model=gateway.model, prompt=["Once", "Twice"], logprobs=2, max_tokens=4, n=2
    )
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    for c in completion.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.text_offset) >= 1
        assert c.logprobs.text_offset[0] == len("Once" if c.index < 2 else "Twice")


def test_completions_stream(client, gateway) -> None:
    stream = client.completions.create(
        model=gateway.model,
        prompt="Hello",
        max_tokens=6,
        logprobs=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    tokens = [t for c in chunks[:-1] for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"model": "no-such-model"}, openai.NotFoundError),
        ({"top_logprobs": 2}, openai.BadRequestError),
        ({"extra_body": {"bogus": 1}}, openai.BadRequestError),
        ({"temperature": 3}, openai.BadRequestError),
    ],
)
def test_sdk_errors_are_typed(client, gateway, kwargs, exc) -> None:
    args = {"model": gateway.model, "messages": [{"role": "user", "content": "x"}], **kwargs}
    with pytest.raises(exc) as info:
        client.chat.completions.create(**args)
    assert info.value.body is not None  # the SDK parsed our error object


def test_sdk_auth_and_rate_limit_errors(keyed_gateway, scripted_gateway) -> None:
    bad = openai.OpenAI(base_url=keyed_gateway.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=keyed_gateway.url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == keyed_gateway.model
    client = openai.OpenAI(base_url=scripted_gateway.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(
            model=scripted_gateway.model,
            messages=[{"role": "user", "content": "fail:RESOURCE_EXHAUSTED:busy"}],
        )


def test_sdk_raises_on_a_mid_stream_error(scripted_client, scripted_gateway) -> None:
    stream = scripted_client.chat.completions.create(
        model=scripted_gateway.model,
        messages=[{"role": "user", "content": "failmid:say:one two"}],
        stream=True,
    )
    with pytest.raises(openai.APIError, match="engine failed mid-stream"):
        for _ in stream:
            pass

"""Prefix caching through the gateway: `cache_salt` (validated, passed on) and
`usage.prompt_tokens_details.cached_tokens` on chat and completions, plain and streamed with include_usage.

The scripted backend reports what a prompt's `cached:<k>` directive says (exact gateway arithmetic); the
end-to-end tests run the real gRPC service over the fake engine, whose cache is hand-computable
(tests/grpc_service/fake_engine.py: the longest common prefix with an earlier prompt of the same salt, in blocks
of 4, at most len - 1).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from gateway_checks import error, post, stream
from gateway_harness import GatewayServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(model: str, content: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def completion(model: str, prompt: object, **kw) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 4, **kw}


def body_for(path: str, model: str, text: str, **kw) -> dict:
    return chat(model, text, **kw) if path == CHAT else completion(model, text, **kw)


def usage_of(http: httpx.Client, path: str, body: dict, streamed: bool) -> dict:
    if not streamed:
        return post(http, path, body)["usage"]
    chunks = stream(http, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == []
    return chunks[-1]["usage"]


both = pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])
paths = pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])


# ---- cache_salt: validated and passed on ---------------------------------------------------------------


@paths
@pytest.mark.parametrize(
    "salt",
    [123, ["a"], {"a": "b"}, True, "", "s" * 257],
    ids=["int", "list", "object", "bool", "empty", "257"],
)
def test_cache_salt_not_a_string_empty_or_over_256_characters_is_400_naming_it(
    scripted_gateway, path, salt
) -> None:
    gw = scripted_gateway
    before = len(gw.scripted.servicer.requests)
    err = error(gw.http, path, body_for(path, gw.model, "say:hi", cache_salt=salt), 400, "cache_salt")
    assert err["type"] == "invalid_request_error"
    assert len(gw.scripted.servicer.requests) == before  # nothing reached the backend


@paths
def test_cache_salt_up_to_256_characters_reaches_the_backend(scripted_gateway, path) -> None:
    gw = scripted_gateway
    salt = "租户" * 128  # 256 characters (768 UTF-8 bytes)
    post(gw.http, path, body_for(path, gw.model, "say:hi", cache_salt=salt))
    assert gw.scripted.servicer.requests[-1].cache_salt == salt
    for absent in ({}, {"cache_salt": None}):
        post(gw.http, path, body_for(path, gw.model, "say:hi", **absent))
        assert not gw.scripted.servicer.requests[-1].HasField("cache_salt")


def test_openapi_document_lists_cache_salt() -> None:
    from tpuserve.http_gateway import openapi

    schemas = openapi.build()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        salt = schemas[name]["properties"]["cache_salt"]
        assert {"type": "string", "minLength": 1, "maxLength": 256} in salt["anyOf"]
        assert "salt" in salt["description"]


# ---- usage.prompt_tokens_details.cached_tokens (scripted backend) ---------------------------------------------


@both
def test_chat_usage_reports_cached_tokens(scripted_gateway, streamed) -> None:
    gw = scripted_gateway
    usage = usage_of(gw.http, CHAT, chat(gw.model, "cached:5 say:Hi there", n=2), streamed)
    assert usage == {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": 4,  # "Hi", " there" per sample; the EOS is not counted in chat
        "total_tokens": usage["prompt_tokens"] + 4,
        "prompt_tokens_details": {"cached_tokens": 5},  # once, though n = 2
    }
    assert usage_of(gw.http, CHAT, chat(gw.model, "say:Hi"), streamed)["prompt_tokens_details"] == {
        "cached_tokens": 0
    }


@both
def test_completions_usage_sums_cached_tokens_over_the_prompts_once_each(scripted_gateway, streamed) -> None:
    gw = scripted_gateway
    prompts = ["cached:3 say:a", "cached:5 say:b", "say:c"]
    usage = usage_of(gw.http, COMPLETIONS, completion(gw.model, prompts, n=2), streamed)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 3 + 5 + 0}
    echoed = completion(
        gw.model, "cached:7 say:a", echo=True, logprobs=1
    )  # a prompt-logprobs message as well
    assert usage_of(gw.http, COMPLETIONS, echoed, streamed)["prompt_tokens_details"] == {"cached_tokens": 7}


# ---- end to end: the gRPC service over the fake engine's cache -----------------------------------------------


@pytest.fixture(scope="module")
def fake_stack() -> Iterator[tuple[httpx.Client, object]]:
    """(client of a gateway in front of the real gRPC service over a fresh fake engine, the engine's tokenizer)."""
    from tpuserve.model.embedded import default_model_path
    from tpuserve.model.tokenizer import load_tokenizer

    from tests.grpc_service.conftest import ServerThread
    from tests.grpc_service.fake_engine import make_engine

    tokenizer = load_tokenizer(default_model_path())
    backend = ServerThread(make_engine(tokenizer, slots=4, max_seq_len=256, steps_per_call=4), tokenizer)
    gateway = GatewayServer([backend.address]).start()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            yield http, tokenizer
    finally:
        gateway.stop()
        backend.close()


def test_chat_cached_tokens_end_to_end_and_salts_never_share(fake_stack) -> None:
    http, tokenizer = fake_stack
    content = "Tell me about prefix caches, please."
    length = len(tokenizer.render_chat([{"role": "user", "content": content}])[1])
    warm = (length - 1) // 4 * 4

    def cached(streamed: bool, **kw) -> int:
        usage = usage_of(http, CHAT, chat("fake-smollm2", content, seed=1, **kw), streamed)
        assert usage["prompt_tokens"] == length
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached(False, cache_salt="tenant-a") == 0
    assert cached(False, cache_salt="tenant-a") == warm > 0
    assert cached(True, cache_salt="tenant-a") == warm
    assert cached(False, cache_salt="tenant-b") == 0  # another tenant's salt shares nothing
    assert cached(True) == 0  # nor does the default namespace
    assert cached(True) == warm


@both
def test_completions_prompt_list_sums_cached_tokens_end_to_end(fake_stack, streamed) -> None:
    http, _ = fake_stack
    salt = f"list-{streamed}"  # each case starts cold
    warm_up = [300] * 12 + [301]
    assert usage_of(http, COMPLETIONS, completion("fake-smollm2", warm_up, cache_salt=salt), streamed)[
        "prompt_tokens_details"
    ] == {"cached_tokens": 0}
    prompts = [[300] * 12 + [302, 303], [400] * 10]  # 12 shared with the warm-up (3 blocks); nothing shared
    body = completion("fake-smollm2", prompts, n=2, cache_salt=salt, seed=3)
    usage = usage_of(http, COMPLETIONS, body, streamed)
    assert usage["prompt_tokens"] == 24 and usage["prompt_tokens_details"] == {"cached_tokens": 12}
    again = usage_of(
        http, COMPLETIONS, body, streamed
    )  # now both are known: 12 + 8 (at most len - 1 = 9 -> 8)
    assert again["prompt_tokens_details"] == {"cached_tokens": 20}

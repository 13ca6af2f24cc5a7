"""vLLM's extensions for RL pipelines over the scripted backend: `return_token_ids` on chat and completions
(`prompt_token_ids`, per-choice `token_ids`, plain and streamed) and `prompt_logprobs` on chat, in vLLM's shapes.

scripted_backend.py: chat prompts render as `render_chat`, text prompts tokenize as `encode(text, True)`; the
default reply is DEFAULT_REPLY then EOS; prompt token p has logprob -1 - 0.01 p and the alternatives of
`alternatives(id, logprob, p)` (two tokens rank above it when p % 4 == 3).
"""

from __future__ import annotations

import openai
import pytest
from gateway_checks import error, post, stream
from scripted_backend import (
    DEFAULT_REPLY,
    EOS,
    SPECIALS,
    alternatives,
    encode,
    is_special,
    render_chat,
    token_bytes,
)
from tpuserve.http_gateway.chat import prompt_logprobs
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
REPLY_IDS = encode(DEFAULT_REPLY, False)


def chat(gw, content: str = "Hi!", **kw) -> dict:
    return {"model": gw.model, "messages": [{"role": "user", "content": content}], "max_tokens": 32, **kw}


def chat_prompt_ids(content: str = "Hi!") -> list[int]:
    return render_chat([pb.ChatMessage(role="user", content=content)])


def sent(gw):
    return gw.scripted.servicer.requests[-1]


# ---- return_token_ids: chat ---------------------------------------------------------------------------------


def test_chat_token_ids_are_the_prompt_and_the_shown_tokens(scripted_gateway) -> None:
    gw = scripted_gateway
    data = post(gw.http, CHAT, chat(gw, return_token_ids=True, logprobs=True, n=2))
    assert data["prompt_token_ids"] == chat_prompt_ids()
    for choice in data["choices"]:
        assert choice["token_ids"] == REPLY_IDS  # the EOS is not shown, as in logprobs.content
        entries = choice["logprobs"]["content"]
        assert [bytes(e["bytes"]) for e in entries] == [token_bytes(i) for i in choice["token_ids"]]
    assert sent(gw).return_prompt_token_ids


def test_chat_token_ids_follow_a_stop_string_cut(scripted_gateway) -> None:
    gw = scripted_gateway
    data = post(
        gw.http, CHAT, chat(gw, "say:Hi there world", stop=[" wor"], return_token_ids=True, logprobs=True)
    )
    choice = data["choices"][0]
    assert choice["message"]["content"] == "Hi there"
    assert [bytes(e["bytes"]) for e in choice["logprobs"]["content"]] == [
        token_bytes(i) for i in choice["token_ids"]
    ]


def test_chat_streamed_token_ids(scripted_gateway) -> None:
    gw = scripted_gateway
    chunks = stream(gw.http, CHAT, chat(gw, return_token_ids=True, logprobs=True, n=2))
    roles = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    assert all(c["prompt_token_ids"] == chat_prompt_ids() for c in roles)
    assert all("prompt_token_ids" not in c for c in chunks if c not in roles)
    ids: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            assert "token_ids" in ch or ch["delta"].get("role") or ch["finish_reason"]
            entries = ch["logprobs"]["content"] if ch["logprobs"] else []
            assert len(ch.get("token_ids", [])) == len(entries)  # each chunk: the ids of exactly its tokens
            ids[ch["index"]] += ch.get("token_ids", [])
    assert ids == {0: REPLY_IDS, 1: REPLY_IDS}


@pytest.mark.parametrize("streamed", [False, True])
def test_without_return_token_ids_there_are_none(scripted_gateway, streamed) -> None:
    gw = scripted_gateway
    if streamed:
        objs = stream(gw.http, CHAT, chat(gw))
        assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        objs = [post(gw.http, CHAT, chat(gw))]
    for o in objs:
        assert "prompt_token_ids" not in o and "prompt_logprobs" not in o
        assert all("token_ids" not in ch for ch in o["choices"])
    assert not sent(gw).return_prompt_token_ids


# ---- return_token_ids: completions ----------------------------------------------------------------------------


def test_completion_token_ids_include_the_eos_like_its_logprobs(scripted_gateway) -> None:
    gw = scripted_gateway
    req = {"model": gw.model, "prompt": ["Hi", "Hello there"], "max_tokens": 32, "logprobs": 1, "n": 2,
           "return_token_ids": True}  # fmt: skip
    data = post(gw.http, COMPLETIONS, req)
    for choice in data["choices"]:
        prompt = req["prompt"][choice["index"] // 2]
        assert choice["prompt_token_ids"] == encode(prompt, True)
        assert choice["token_ids"] == [*REPLY_IDS, EOS]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["tokens"])


def test_completion_echo_keeps_prompt_ids_apart(scripted_gateway) -> None:
    gw = scripted_gateway
    req = {
        "model": gw.model,
        "prompt": "Hi",
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "return_token_ids": True,
    }
    choice = post(gw.http, COMPLETIONS, req)["choices"][0]
    assert choice["prompt_token_ids"] == encode("Hi", True)
    assert choice["token_ids"] == REPLY_IDS[:1]
    assert len(choice["logprobs"]["tokens"]) == len(choice["prompt_token_ids"]) + len(choice["token_ids"])


def test_completion_best_of_keeps_the_ids_of_the_kept_samples(scripted_gateway) -> None:
    gw = scripted_gateway
    req = {"model": gw.model, "prompt": "say:ab", "max_tokens": 8, "best_of": 3, "return_token_ids": True}
    choice = post(gw.http, COMPLETIONS, req)["choices"][0]
    assert choice["text"] == "ab" and choice["token_ids"] == [*encode("ab", False), EOS]


def test_completion_streamed_token_ids(scripted_gateway) -> None:
    gw = scripted_gateway
    req = {
        "model": gw.model,
        "prompt": ["Hi", "Hello"],
        "max_tokens": 32,
        "logprobs": 0,
        "return_token_ids": True,
    }
    chunks = stream(gw.http, COMPLETIONS, req)
    ids: dict[int, list[int]] = {0: [], 1: []}
    prompts: dict[int, list[list[int]]] = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            if "prompt_token_ids" in ch:
                assert not ids[ch["index"]], "prompt ids after the first chunk"
                prompts[ch["index"]].append(ch["prompt_token_ids"])
            assert len(ch["token_ids"]) == len(ch["logprobs"]["tokens"])
            ids[ch["index"]] += ch["token_ids"]
    assert prompts == {0: [encode("Hi", True)], 1: [encode("Hello", True)]}
    assert ids == {0: [*REPLY_IDS, EOS], 1: [*REPLY_IDS, EOS]}


# ---- prompt_logprobs (chat) -----------------------------------------------------------------------------------


def _text(tid: int) -> str:
    return SPECIALS[tid] if is_special(tid) else token_bytes(tid).decode("utf-8", errors="backslashreplace")


def expected_prompt_logprobs(ids: list[int], k: int) -> list[dict | None]:
    """vLLM's shape, from the scripted backend's rules: the prompt token's own entry (its rank among all), then
    the k most likely."""
    out: list[dict | None] = [None]
    for p, tid in enumerate(ids[1:], 1):
        lp = -1.0 - 0.01 * p
        alts = alternatives(tid, lp, p)
        rank = 1 + sum(1 for _, a in alts if a > lp)
        entry = {str(tid): {"logprob": pytest.approx(lp), "rank": rank, "decoded_token": _text(tid)}}
        for r, (aid, alp) in enumerate(alts[:k], 1):
            entry.setdefault(
                str(aid),
                {"logprob": pytest.approx(max(alp, -9999.0)), "rank": r, "decoded_token": _text(aid)},
            )
        out.append(entry)
    return out


@pytest.mark.parametrize("k", [0, 1, 5])
def test_chat_prompt_logprobs_have_vllms_shape(scripted_gateway, k) -> None:
    gw = scripted_gateway
    data = post(gw.http, CHAT, chat(gw, prompt_logprobs=k, logprobs=True, top_logprobs=2))
    assert data["prompt_logprobs"] == expected_prompt_logprobs(chat_prompt_ids(), k)
    ranks = [next(iter(e.values()))["rank"] for e in data["prompt_logprobs"][1:]]
    assert all(len(e) == k + (r > k) for e, r in zip(data["prompt_logprobs"][1:], ranks, strict=True))
    assert set(ranks) == {1, 3}  # the prompt token first; outside the top k it is an extra key
    entries = data["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)  # the request's top_logprobs, not the prompt's k
    opts = sent(gw).logprobs
    assert (
        opts.prompt_logprobs and opts.top_logprobs == 20
    )  # 20 alternatives: the prompt token's rank is exact


def test_chat_prompt_logprobs_without_logprobs(scripted_gateway) -> None:
    gw = scripted_gateway
    data = post(gw.http, CHAT, chat(gw, prompt_logprobs=1))
    assert data["prompt_logprobs"][0] is None and len(data["prompt_logprobs"]) == len(chat_prompt_ids())
    assert data["choices"][0]["logprobs"] is None


def test_a_rank_beyond_the_alternatives_is_null() -> None:
    token = pb.Token(token_id=7, logprob=-5.0)
    token.top_logprobs.extend(pb.TopLogprob(token_id=100 + i, logprob=-1.0 - 0.1 * i) for i in range(20))
    first = pb.Token(token_id=3)
    (none, entry) = prompt_logprobs([first, token], 2)
    assert none is None
    assert entry["7"].rank is None and entry["7"].logprob == -5.0
    assert [(key, e.rank) for key, e in entry.items()] == [("7", None), ("100", 1), ("101", 2)]


# ---- the SDK and bad input ------------------------------------------------------------------------------------------


def test_sdk_reads_the_extensions_as_extra_fields(scripted_gateway) -> None:
    gw = scripted_gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    out = client.chat.completions.create(
        model=gw.model, messages=[{"role": "user", "content": "Hi!"}],
        extra_body={"return_token_ids": True, "prompt_logprobs": 0},
    )  # fmt: skip
    assert out.prompt_token_ids == chat_prompt_ids() and out.choices[0].token_ids == REPLY_IDS
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(chat_prompt_ids())


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (CHAT, {"return_token_ids": "yes"}, "return_token_ids"),
        (COMPLETIONS, {"return_token_ids": 1}, "return_token_ids"),
        (CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": -1}, "prompt_logprobs"),
        (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),  # completions have echo for this
    ],
)
def test_bad_extension_values_are_400_naming_the_field(scripted_gateway, path, extra, param) -> None:
    gw = scripted_gateway
    req = chat(gw, **extra) if path == CHAT else {"model": gw.model, "prompt": "Hi", **extra}
    error(gw.http, path, req, 400, param)

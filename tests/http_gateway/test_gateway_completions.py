"""/v1/completions (legacy): each logprob rule of docs/http-api.md, non-streamed and streamed."""

from __future__ import annotations

import json

import pytest
from gateway_checks import post, stream
from scripted_backend import DEFAULT_REPLY, encode, logprob

COMPLETIONS = "/v1/completions"
LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def body(gw, prompt: object = "Hi", **kw) -> dict:
    return {"model": gw.model, "prompt": prompt, "max_tokens": 16, **kw}


def run(gw, req: dict, streamed: bool) -> tuple[list[dict], dict]:
    """Choices (sorted by index) as {text, logprobs, finish_reason} and usage, from either mode."""
    if not streamed:
        data = post(gw.http, COMPLETIONS, req)
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        return sorted(data["choices"], key=lambda c: c["index"]), data["usage"]
    chunks = stream(gw.http, COMPLETIONS, {**req, "stream_options": {"include_usage": True}})
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage is not None
    out: dict[int, dict] = {}
    for c in chunks[:-1]:
        assert c["object"] == "text_completion" and "usage" not in c
        (ch,) = c["choices"]
        acc = out.setdefault(
            ch["index"], {"index": ch["index"], "text": "", "logprobs": None, "finish_reason": None}
        )
        assert acc["finish_reason"] is None, "chunk after the choice's finish"
        acc["text"] += ch["text"]
        if ch["logprobs"] is not None:
            if acc["logprobs"] is None:
                acc["logprobs"] = {k: [] for k in LISTS}
            for k in LISTS:
                if ch["logprobs"][k] is None:
                    acc["logprobs"][k] = None
                else:
                    acc["logprobs"][k] += ch["logprobs"][k]
        acc["finish_reason"] = ch["finish_reason"]
    for acc in out.values():
        assert acc["finish_reason"] in ("stop", "length")
    return [out[i] for i in sorted(out)], usage


both = pytest.mark.parametrize("streamed", [False, True], ids=["json", "sse"])


def check_lists(lp: dict) -> None:
    assert set(lp) == set(LISTS)
    n = len(lp["tokens"])
    assert len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    if lp["top_logprobs"] is not None:
        assert len(lp["top_logprobs"]) == n
    assert lp["text_offset"] == sorted(lp["text_offset"])


# ---- logprobs: k ------------------------------------------------------------------------------------------


@both
@pytest.mark.parametrize("k", [1, 2, 5])
def test_logprobs_k_gives_top_k_plus_the_sampled_token(scripted_gateway, streamed, k) -> None:
    (c,), _ = run(scripted_gateway, body(scripted_gateway, logprobs=k), streamed)
    lp = c["logprobs"]
    check_lists(lp)
    assert lp["tokens"][:-1] == ["Hello", "!", " How", " can", " I", " assist", " you", " today", "?"]
    for j, (tok, tlp, top) in enumerate(
        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ):
        assert tlp == pytest.approx(logprob(j, 0))
        assert top[tok] == tlp
        assert len(top) <= k + 1
        if j % 4 == 3:  # two tokens rank above the sampled one: the top k, plus the sampled token
            assert list(top)[: min(k, 2)] == [" maybe", " perhaps"][:k]
            if k <= 2:
                assert len(top) == k + 1
        values = list(top.values())
        assert values == sorted(values, reverse=True)


@both
def test_logprobs_0_gives_tokens_and_logprobs_with_null_top_logprobs(scripted_gateway, streamed) -> None:
    (c,), _ = run(scripted_gateway, body(scripted_gateway, logprobs=0), streamed)
    lp = c["logprobs"]
    check_lists(lp)
    assert lp["top_logprobs"] is None and lp["tokens"] and None not in lp["token_logprobs"]


@both
def test_logprobs_absent_is_null(scripted_gateway, streamed) -> None:
    choices, _ = run(scripted_gateway, body(scripted_gateway), streamed)
    assert "logprobs" in choices[0] and choices[0]["logprobs"] is None


@both
def test_equal_token_strings_keep_the_higher_logprob(scripted_gateway, streamed) -> None:
    (c,), _ = run(scripted_gateway, body(scripted_gateway, "say: How", logprobs=3), streamed)
    top = c["logprobs"]["top_logprobs"]
    # token 0 is " How" (lp -0.1); the other " How" id is an alternative at -0.4: one key, the higher value
    assert top[0][" How"] == pytest.approx(-0.1)
    assert list(top[0]).count(" How") == 1
    # token 1 (EOS) has both " How" ids as alternatives (-0.5, -0.6): one key at -0.5
    assert c["logprobs"]["tokens"] == [" How", "<|im_end|>"]
    assert top[1][" How"] == pytest.approx(-0.5) and len(top[1]) == 2


@both
def test_minus_infinity_is_sent_as_minus_9999(scripted_gateway, streamed) -> None:
    (c,), _ = run(scripted_gateway, body(scripted_gateway, logprobs=20), streamed)
    for top in c["logprobs"]["top_logprobs"]:
        assert top[" world"] == -9999.0


# ---- text_offset ------------------------------------------------------------------------------------------


@both
def test_text_offset_without_echo_starts_at_the_prompt_length_in_characters(gateway, streamed) -> None:
    prompt = "Café ☕ menu:"
    (c,), _ = run(gateway, body(gateway, prompt, logprobs=1, max_tokens=2), streamed)
    assert len(prompt) != len(prompt.encode())
    assert c["logprobs"]["text_offset"][0] == len(prompt)


@both
def test_text_offset_of_tokens_continuing_a_split_character_is_that_characters_offset(
    scripted_gateway, streamed
) -> None:
    prompt = "say:a😀b"
    (c,), _ = run(scripted_gateway, body(scripted_gateway, prompt, logprobs=1), streamed)
    lp = c["logprobs"]
    assert c["text"] == "a😀b"
    assert lp["tokens"] == ["a", "\\xf0", "\\x9f", "\\x98", "\\x80", "b", "<|im_end|>"]
    base = len(prompt)
    assert lp["text_offset"] == [base, base + 1, base + 1, base + 1, base + 1, base + 2, base + 3]


@both
def test_echo_offsets_start_at_0_and_count_characters(scripted_gateway, streamed) -> None:
    prompt = "say:é!"
    (c,), usage = run(scripted_gateway, body(scripted_gateway, prompt, logprobs=1, echo=True), streamed)
    lp = c["logprobs"]
    assert c["text"] == prompt + "é!"
    n_prompt = len(encode(prompt, True))
    assert usage["prompt_tokens"] == n_prompt
    assert lp["text_offset"][0] == 0
    # s a y : é(2 byte tokens) ! | é(2) ! <|im_end|>
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 4, 5, 6, 6, 7, 8]


# ---- echo ---------------------------------------------------------------------------------------------------


@both
def test_echo_prepends_prompt_tokens_the_first_with_null_logprob_and_top(scripted_gateway, streamed) -> None:
    prompt = "say:Hi there"
    (c,), usage = run(scripted_gateway, body(scripted_gateway, prompt, logprobs=2, echo=True), streamed)
    lp = c["logprobs"]
    check_lists(lp)
    n_prompt = usage["prompt_tokens"]
    assert lp["tokens"][:n_prompt] == ["s", "a", "y", ":", "Hi", " there"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == pytest.approx(-1.01)
    assert lp["tokens"][n_prompt:] == ["Hi", " there", "<|im_end|>"]
    assert c["text"] == prompt + "Hi there"


@both
def test_echo_with_max_tokens_0_scores_the_prompt(scripted_gateway, streamed) -> None:
    prompt = "The cat sat"
    (c,), usage = run(
        scripted_gateway, body(scripted_gateway, prompt, logprobs=1, echo=True, max_tokens=0), streamed
    )
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0
    assert len(c["logprobs"]["tokens"]) == usage["prompt_tokens"] == len(encode(prompt, True))
    assert "".join(c["logprobs"]["tokens"]) == prompt


def test_echo_of_special_token_text_in_the_prompt(scripted_gateway) -> None:
    prompt = "<|im_start|>say:ok"
    (c,), _ = run(scripted_gateway, body(scripted_gateway, prompt, logprobs=1, echo=True), False)
    lp = c["logprobs"]
    assert lp["tokens"][0] == "<|im_start|>" and lp["text_offset"][:2] == [0, len("<|im_start|>")]
    assert c["text"] == prompt + "ok"


# ---- EOS is the last entry ------------------------------------------------------------------------------------


@both
def test_eos_that_ended_generation_is_the_last_entry_and_counted(scripted_gateway, streamed) -> None:
    (c,), usage = run(scripted_gateway, body(scripted_gateway, logprobs=1), streamed)
    lp = c["logprobs"]
    assert c["text"] == DEFAULT_REPLY and c["finish_reason"] == "stop"
    assert lp["tokens"][-1] == "<|im_end|>"
    assert lp["text_offset"][-1] == len("Hi") + len(DEFAULT_REPLY)
    assert usage["completion_tokens"] == len(lp["tokens"]) == 10


def test_lm_eval_scoring_drops_the_eos_not_a_prompt_token(scripted_gateway) -> None:
    # lm-evaluation-harness: echo, max_tokens 1, logprobs 1, temperature 0, then drop the last entry.
    prompt = "say:"  # the model's first token is the EOS
    (c,), usage = run(
        scripted_gateway,
        body(scripted_gateway, prompt, echo=True, max_tokens=1, logprobs=1, temperature=0),
        False,
    )
    lp = c["logprobs"]
    assert lp["tokens"][-1] == "<|im_end|>"
    assert lp["tokens"][:-1] == ["s", "a", "y", ":"] and len(lp["tokens"][:-1]) == usage["prompt_tokens"]


# ---- n, best_of, batched and token-id prompts, stop ----------------------------------------------------------


@both
def test_batched_prompts_index_choices_prompt_major(scripted_gateway, streamed) -> None:
    choices, usage = run(scripted_gateway, body(scripted_gateway, ["say:a", "say:bc"], n=2), streamed)
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["a", "a", "bc", "bc"]
    assert usage["prompt_tokens"] == len(encode("say:a", True)) + len(encode("say:bc", True))
    assert usage["completion_tokens"] == 2 * 2 + 2 * 3  # EOS counted


@both
def test_token_id_prompts(scripted_gateway, streamed) -> None:
    ids = encode("say:xy", True)
    choices, _ = run(scripted_gateway, body(scripted_gateway, ids, logprobs=1), streamed)
    assert choices[0]["text"] == "xy"
    assert choices[0]["logprobs"]["text_offset"][0] == len("say:xy")
    choices, _ = run(
        scripted_gateway, body(scripted_gateway, [ids, encode("say:z", True)], echo=True), streamed
    )
    assert [c["text"] for c in choices] == ["say:xyxy", "say:zz"]


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_best_of_keeps_the_highest_mean_logprob(scripted_gateway, with_logprobs) -> None:
    extra = {"logprobs": 1} if with_logprobs else {}
    data = post(
        scripted_gateway.http, COMPLETIONS, body(scripted_gateway, "say:Hi there", best_of=3, **extra)
    )
    sent = scripted_gateway.scripted.servicer.requests[-1]
    assert sent.n == 3 and sent.logprobs.enabled
    (c,) = data["choices"]
    assert c["index"] == 0 and c["text"] == "Hi there"
    if with_logprobs:  # sample 2 has the highest mean logprob in the script
        assert c["logprobs"]["token_logprobs"] == pytest.approx([logprob(j, 2) for j in range(3)])
    else:
        assert c["logprobs"] is None
    assert data["usage"]["completion_tokens"] == 9  # all three samples are generated


def test_best_of_with_n_returns_the_n_best_in_order(scripted_gateway) -> None:
    data = post(
        scripted_gateway.http, COMPLETIONS, body(scripted_gateway, "say:Hi", best_of=4, n=2, logprobs=0)
    )
    assert [c["index"] for c in data["choices"]] == [0, 1]
    firsts = [c["logprobs"]["token_logprobs"][0] for c in data["choices"]]
    assert firsts == pytest.approx([logprob(0, 3), logprob(0, 2)])


@both
def test_max_tokens_inside_a_character_keeps_complete_characters_and_the_cut_token(
    scripted_gateway, streamed
) -> None:
    prompt = "say:a中"
    (c,), usage = run(scripted_gateway, body(scripted_gateway, prompt, logprobs=1, max_tokens=2), streamed)
    assert c["text"] == "a" and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == ["a", "\\xe4"] and lp["text_offset"] == [len(prompt), len(prompt) + 1]
    assert usage["completion_tokens"] == 2


@both
def test_stop_string_ends_the_text_before_it(scripted_gateway, streamed) -> None:
    (c,), usage = run(
        scripted_gateway, body(scripted_gateway, "say:Hello world", stop=" wor", logprobs=1), streamed
    )
    assert c["text"] == "Hello" and c["finish_reason"] == "stop"
    assert c["logprobs"]["tokens"] == ["Hello"]  # " world" completed the stop and added no text
    assert usage["completion_tokens"] == 1


@both
def test_max_tokens_length_finish(scripted_gateway, streamed) -> None:
    choices, usage = run(
        scripted_gateway, body(scripted_gateway, "say:" + "a" * 40, max_tokens=3, logprobs=0), streamed
    )
    assert choices[0]["finish_reason"] == "length" and usage["completion_tokens"] == 3
    assert len(choices[0]["logprobs"]["tokens"]) == 3


def test_streamed_completion_matches_the_non_streamed_one(gateway) -> None:
    req = body(gateway, "say:Hi 😀 there", logprobs=2, echo=True, seed=3, temperature=0, max_tokens=8)
    full, usage = run(gateway, req, False)
    streamed, s_usage = run(gateway, req, True)
    for a, b in zip(full, streamed, strict=True):
        assert (
            a["text"] == b["text"]
            and a["logprobs"] == b["logprobs"]
            and a["finish_reason"] == b["finish_reason"]
        )
    cached, s_cached = (u.pop("prompt_tokens_details")["cached_tokens"] for u in (usage, s_usage))
    assert s_usage == usage
    assert s_cached >= cached  # a backend's prefix cache may have warmed up between the two requests


def test_streamed_chunks_carry_their_own_tokens(scripted_gateway) -> None:
    chunks = stream(scripted_gateway.http, COMPLETIONS, body(scripted_gateway, "say:a 😀!", logprobs=1))
    pieces = [(c["choices"][0]["text"], c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert pieces == [
        ("a", ["a"]),
        (" ", [" "]),
        ("😀", ["\\xf0", "\\x9f", "\\x98", "\\x80"]),
        ("!", ["!"]),
        ("", ["<|im_end|>"]),
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]


SEPARATORS = "a\u2028b\x85c\u2029d"  # line breaks to str.splitlines, not to SSE or JSON


@pytest.mark.parametrize(
    "path, req, text_of",
    [
        ("/v1/completions", {"prompt": f"say:{SEPARATORS}", "max_tokens": 16},
         lambda e: e["choices"][0]["text"] if e["choices"] else ""),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"say:{SEPARATORS}"}], "max_tokens": 16},
         lambda e: e["choices"][0]["delta"].get("content") or "" if e["choices"] else ""),
        ("/v1/responses", {"input": f"say:{SEPARATORS}", "max_output_tokens": 16},
         lambda e: e["delta"] if e["type"] == "response.output_text.delta" else ""),
    ],
)  # fmt: skip
def test_text_with_unicode_line_separators_streams_whole_events_to_a_splitlines_reader(
    scripted_gateway, path, req, text_of
):
    """U+2028, U+2029 and U+0085 in the generated text: JSON may carry them raw, but a client that reads the SSE
    text with `str.splitlines` semantics (httpx's `iter_lines`, which the bench used) would get events cut in
    two. The gateway escapes them, so every `data:` line that reader gets is one whole JSON event and the text
    comes back unchanged."""
    body = {"model": scripted_gateway.model, "stream": True, **req}
    with scripted_gateway.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    events = [json.loads(line[len("data: ") :]) for line in lines]
    assert "".join(text_of(e) for e in events) == SEPARATORS

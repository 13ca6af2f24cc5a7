"""A hypothesis fuzz of JSON bodies for both endpoints against a `tpuserve gateway` process (over the scripted
backend): never a 5xx, the OpenAI error shape for every non-200, and the gateway keeps serving. The hand-written
hostile corpus is test_hostile.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hostile_gateway import CHAT, COMPLETIONS, GatewayProcess, serve
from scripted_backend import MODEL_ID, VOCAB_SIZE
from test_faults import assert_openai_error

from tests.helpers import require_extra

require_extra("hypothesis")  # every test here is the fuzz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def gw(scripted) -> Iterator[GatewayProcess]:
    yield from serve(scripted.address)


# any code point, unpaired surrogates included (json.dumps writes them as \\udXXX escapes)
any_text = st.text(st.characters(exclude_categories=()), max_size=20)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | any_text
)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)


json_values = st.recursive(json_scalars, _containers, max_leaves=12)
text = st.text(max_size=12) | any_text  # prompts and content may hold unpaired surrogates
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer"]),
        "content": text
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1),
    }
)
plain = st.text(max_size=8)
FIELDS = {  # valid values (mostly() mixes in any JSON)
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": plain | st.lists(plain, max_size=4),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "user": plain,
    "logit_bias": st.just({}),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "max_tokens": st.integers(1, 8),
}
CHAT_FIELDS = {
    **FIELDS,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "max_completion_tokens": st.integers(1, 8),
    "response_format": st.just({"type": "text"}),
}
COMPLETION_FIELDS = {
    **FIELDS,
    "logprobs": st.integers(0, 20),
    "echo": st.booleans(),
    "best_of": st.integers(1, 4),
}


@st.composite
def body_strategy(draw: st.DrawFn, path: str) -> object:
    """A valid body, then (most of the time) one field replaced, removed or added with any JSON; or any JSON."""
    if draw(st.integers(0, 9)) == 9:
        return draw(json_values)
    fields = CHAT_FIELDS if path == CHAT else COMPLETION_FIELDS
    body: dict = {"model": MODEL_ID}
    if path == CHAT:
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    else:
        prompt = (
            text
            | st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=5)
            | st.lists(text, min_size=1, max_size=3)
        )
        body["prompt"] = draw(prompt)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    target = draw(st.sampled_from(["(none)", "(new)", *sorted(body), *sorted(fields)]))
    if target == "(new)":
        body[draw(st.text(max_size=8))] = draw(json_values)
    elif target != "(none)":
        if draw(st.booleans()):
            body[target] = draw(json_values)
        else:
            body.pop(target, None)
    return body


FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)
STATUSES: dict[str, list[int]] = {}


def check_fuzz_response(gw: GatewayProcess, path: str, body: object) -> None:
    data = json.dumps(body).encode()
    r = gw.http.post(path, content=data, headers={"content-type": "application/json"})
    STATUSES.setdefault(path, []).append(r.status_code)
    assert r.status_code < 500, (r.status_code, r.text[:300], data[:300])
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json")
        assert_openai_error(r.json())


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_fuzzed_bodies_are_never_a_5xx(gw: GatewayProcess, path: str) -> None:
    @FUZZ
    @given(body=body_strategy(path))
    def run(body: object) -> None:
        check_fuzz_response(gw, path, body)

    run()
    gw.check_serving()
    statuses = STATUSES.get(path, [])
    assert 200 in statuses and 400 in statuses, "the fuzz should reach both valid and rejected bodies"

"""Structured outputs on the real backend (real engine, embedded SmolLM2, real gRPC channel): the device-side
token mask makes every output parse and validate; logprobs stay the raw model's; a free request next to
constrained ones is bit-identical to its run alone; bad grammars are INVALID_ARGUMENT naming the field; no
program is compiled for any of it. Plus the host side (llguidance masks) and the masked step on its own."""

from __future__ import annotations

import json
import re
import threading

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.grpc_service.conftest import generate as _generate
from tests.grpc_service.test_real_engine import chat, samples
from tests.helpers import compiles, require_extra

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def generate(stub, timeout: float = 180.0, **fields) -> list[pb.GenerateResponse]:
    """A constrained sample decodes one step per engine call: slower than the suite's 30 s default allows on a
    loaded 2-core machine."""
    return _generate(stub, timeout=timeout, **fields)


def guided_request(text: str, guided: pb.GuidedDecoding, max_tokens: int = 48, **fields) -> dict:
    return dict(
        chat=chat(text),
        guided=guided,
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
        logprobs=pb.LogprobOptions(enabled=True, top_logprobs=5),
        **fields,
    )


def test_json_schema_outputs_parse_and_validate_greedy_and_sampled(real_backend):
    jsonschema = require_extra("jsonschema")
    guided = pb.GuidedDecoding(json_schema=json.dumps(PERSON))
    greedy = generate(real_backend.stub, sampling=pb.SamplingParams(temperature=0.0),
                      **guided_request("Describe a person.", guided))  # fmt: skip
    sampled = generate(real_backend.stub, sampling=pb.SamplingParams(temperature=1.0, seed=11), n=3,
                       **guided_request("Describe a person.", guided))  # fmt: skip
    outputs = list(samples(greedy).values()) + list(samples(sampled).values())
    assert len(outputs) == 4
    for tokens, text, last in outputs:
        assert last.finish_reason == pb.FINISH_REASON_EOS, (text, last)  # the grammar ends it, not max_tokens
        jsonschema.validate(json.loads(text), PERSON)
        assert tokens[-1].special_text == "<|im_end|>"
    assert len({text for _, text, _ in outputs[1:]}) > 1  # the seeds differ per sample


def test_json_object_regex_and_lark(real_backend):
    greedy = {"sampling": pb.SamplingParams(temperature=0.0)}
    _, text, _ = samples(generate(real_backend.stub, **greedy, **guided_request(
        "Return {\"status\": \"ok\"} as JSON.", pb.GuidedDecoding(json_object=True))))[0]  # fmt: skip
    assert isinstance(json.loads(text), dict)
    _, text, _ = samples(generate(real_backend.stub, **greedy, **guided_request(
        "What is the date?", pb.GuidedDecoding(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))))[0]  # fmt: skip
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text)
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    _, text, _ = samples(generate(real_backend.stub, **greedy, **guided_request(
        "Is the sky blue?", pb.GuidedDecoding(lark_grammar=lark))))[0]  # fmt: skip
    assert text in ("The answer is yes.", "The answer is no.")


def test_max_tokens_cuts_a_constrained_output(real_backend):
    _, text, last = samples(generate(real_backend.stub, sampling=pb.SamplingParams(temperature=0.0),
                                     **guided_request("Describe a person.", pb.GuidedDecoding(
                                         json_schema=json.dumps(PERSON)), max_tokens=4)))[0]  # fmt: skip
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.completion_tokens_count == 4
    assert text.startswith("{")


def test_logprobs_are_the_raw_models_under_constraints(real_backend):
    """A constrained greedy output's logprobs equal teacher-forced prompt logprobs of the same tokens (the raw
    distribution): the mask changes what is sampled, never what is reported."""
    request = guided_request("Describe a person.", pb.GuidedDecoding(json_schema=json.dumps(PERSON)))
    tokens, _, _ = samples(
        generate(real_backend.stub, sampling=pb.SamplingParams(temperature=0.0), **request)
    )[0]
    prompt = real_backend.stub.Tokenize(pb.TokenizeRequest(chat=request["chat"])).token_ids
    ids = list(prompt) + [t.token_id for t in tokens]
    scored = generate(real_backend.stub, token_ids=pb.TokenIds(ids=ids),
                      stopping=pb.StoppingCriteria(max_tokens=0),
                      logprobs=pb.LogprobOptions(enabled=True, top_logprobs=5, prompt_logprobs=True))  # fmt: skip
    forced = [t for r in scored for t in r.prompt_tokens][len(prompt) :]
    got = np.array([t.logprob for t in tokens])
    want = np.array([t.logprob for t in forced])
    assert np.abs(got - want).max() < 2e-4
    # somewhere the grammar overruled the model: the chosen token was not the raw top-1
    assert any(t.top_logprobs[0].token_id != t.token_id for t in tokens)
    for t, f in zip(tokens, forced, strict=True):
        assert [a.token_id for a in t.top_logprobs[:3]] == [a.token_id for a in f.top_logprobs[:3]]


def test_a_free_request_beside_constrained_ones_is_bit_identical(real_backend):
    """... and nothing is compiled for constrained requests (the mask is a fixed-shape input, the one-step call
    the same program with a traced step count)."""

    with compiles() as compiled:
        _free_beside_constrained(real_backend)
    assert compiled == []


def _free_beside_constrained(real_backend) -> None:
    free = {"chat": chat("Tell me about the sea."), "sampling": pb.SamplingParams(temperature=0.7, seed=5),
                "stopping": pb.StoppingCriteria(max_tokens=24), "logprobs": pb.LogprobOptions(enabled=True, top_logprobs=3)}  # fmt: skip
    alone = generate(real_backend.stub, **free)
    results: dict[str, list] = {}

    def run(name: str, fields: dict) -> None:
        results[name] = generate(real_backend.stub, timeout=120, **fields)

    threads = [threading.Thread(target=run, args=(f"g{i}", dict(
        sampling=pb.SamplingParams(temperature=0.9, seed=i),
        **guided_request("Describe a person.", pb.GuidedDecoding(json_schema=json.dumps(PERSON)))))) for i in range(3)]  # fmt: skip
    threads.append(threading.Thread(target=run, args=("free", free)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a_tokens, a_text, _), (b_tokens, b_text, _) = samples(alone)[0], samples(results["free"])[0]
    assert a_text == b_text
    assert [(t.token_id, t.logprob) for t in a_tokens] == [(t.token_id, t.logprob) for t in b_tokens]
    for i in range(3):
        json.loads(samples(results[f"g{i}"])[0][1])


def test_bad_grammars_are_invalid_argument_naming_the_field(real_backend):
    cases = {
        "guided.json_schema": pb.GuidedDecoding(json_schema="{not json"),
        "guided.json_schema ": pb.GuidedDecoding(
            json_schema='{"properties": {"a": {"$ref": "#/$defs/none"}}}'
        ),
        "guided.regex": pb.GuidedDecoding(regex="(unclosed"),
        "guided.lark_grammar": pb.GuidedDecoding(lark_grammar="start: undefined_rule"),
        "guided": pb.GuidedDecoding(),
    }
    for field, guided in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            generate(real_backend.stub, **guided_request("hi", guided))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field.strip()}:"), err.value.details()


def test_prompt_token_ids_on_each_samples_first_message(real_backend):
    request = {"chat": chat("Hi"), "n": 2, "sampling": pb.SamplingParams(temperature=1.0, seed=1),
                   "stopping": pb.StoppingCriteria(max_tokens=3), "return_prompt_token_ids": True}  # fmt: skip
    responses = generate(real_backend.stub, **request)
    ids = list(real_backend.stub.Tokenize(pb.TokenizeRequest(chat=request["chat"])).token_ids)
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert list(mine[0].prompt_token_ids) == ids
        assert all(not r.prompt_token_ids for r in mine[1:])
    without = generate(real_backend.stub, **{**request, "return_prompt_token_ids": False})
    assert all(not r.prompt_token_ids for r in without)


def test_masked_step_samples_only_allowed_tokens_and_reports_raw_or_processed():
    """step_outputs on hand-made logits: greedy and sampled rows pick allowed tokens only; raw logprobs by
    default, the masked distribution with processed_logprobs; a free row is untouched."""
    from tpuserve.sampler.programs import ProgramConfig, step_outputs
    from tpuserve.sampler.state import SlotSampling

    V = 64
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(3, V)).astype(np.float32))
    allowed = np.full((3, 2), -1, np.int32)
    allowed[0] = 0
    allowed[0, 0] = 1 << 5 | 1 << 9  # row 0: tokens 5 and 9
    allowed[1] = 0
    allowed[1, 1] = 1 << 3  # row 1: token 35 only
    s = SlotSampling(temperature=jnp.array([0.0, 1.0, 0.0]), top_p=jnp.ones(3), top_k=jnp.zeros(3, jnp.int32),
                     min_p=jnp.zeros(3), keys=jnp.zeros((3, 2), jnp.uint32), max_tokens=jnp.full(3, 9),
                     stop_ids=jnp.full((3, 8), -1))  # fmt: skip
    raw = jax_log_softmax(np.asarray(logits))
    for processed in (False, True):
        cfg = ProgramConfig(K=4, chunk=8, max_seq_len=16, processed_logprobs=processed)
        out = step_outputs(logits, s, jnp.zeros(3, jnp.int32), cfg, jnp.asarray(allowed))
        ids = np.asarray(out.ids)
        assert ids[0] == (5 if raw[0, 5] > raw[0, 9] else 9) and ids[1] == 35
        assert ids[2] == raw[2].argmax()
        if not processed:
            assert np.allclose(np.asarray(out.logprob), raw[np.arange(3), ids], atol=1e-6)
            assert (np.asarray(out.top_ids)[0] == np.argsort(-raw[0])[:4]).all()
        else:
            masked0 = raw[0, [5, 9]] - np.logaddexp(raw[0, 5], raw[0, 9])
            assert np.isclose(float(out.logprob[0]), masked0.max(), atol=1e-6)
            assert float(out.logprob[1]) == pytest.approx(0.0, abs=1e-6)  # the only allowed token
            assert np.isclose(float(out.logprob[2]), raw[2].max(), atol=1e-6)


def jax_log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def test_generic_tool_prompt_and_tool_turns(embedded):
    tok = embedded.tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    ]  # fmt: skip
    text, ids = tok.render_chat(messages, tools=tools)
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "get_weather"' in text and "Weather in a city" in text
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok.render_chat(messages, tools=tools)[1]
    # no tools: exactly the plain rendering
    plain = [{"role": "user", "content": "Hi"}]
    assert tok.render_chat(plain, tools=None) == tok.render_chat(plain)


def test_a_template_with_a_tools_section_renders_them_itself():
    from tpuserve.model.chat_template import ChatTemplate

    source = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
              "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}")  # fmt: skip
    template = ChatTemplate(source, {}, {0: "<|special|>"})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]  # fmt: skip
    text, _ = template.render(messages, True, tools)
    assert text.startswith('TOOLS:[{"type": "function"') and 'CALL f{"a": 1}' in text
    with pytest.raises(ValueError, match="tools"):
        template.render(messages, True, [{"type": "function", "function": {"name": "<|special|>"}}])

"""Gemma 3 text (gemma3_text / GGUF gemma3) against transformers: tiny random Gemma3ForCausalLM checkpoints whose
local (sliding-window) and global layers interleave, a prompt five windows long, random (1 + w) norms; written by
transformers as safetensors and as a GGUF file in llama.cpp's conventions; our logits and teacher-forced logprobs
vs PyTorch's eager attention in fp32, greedy continuations through the engine (one device and a 2x2 mesh), the
Orbax round trip, int8 weights, and a Gemma 3 chat template vs transformers' `apply_chat_template`."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import gguf
import jax
import numpy as np
import pytest
from tpuserve.model import checkpoint
from tpuserve.model.config import config_from_hf
from tpuserve.model.embedded import default_model_path
from tpuserve.model.loader import convert, load_model
from tpuserve.model.sharding import make_mesh
from tpuserve.model.tokenizer import load_tokenizer
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine

from tests.helpers import engine_config, require_extra, run_engine
from tests.model import fidelity
from tests.model.fidelity import BOUND, log_softmax, our_logits, reference_logits

torch = require_extra("torch")
transformers = require_extra("transformers")

# head_dim 32 != hidden 64 / 4 heads; 2 query heads per KV head; a window of 8 positions
BASE = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "sliding_window": 8}  # fmt: skip
VARIANTS = {
    # local and global layers alternating, each kind with a RoPE base of its own and the global one linearly
    # scaled, a query scale other than head_dim's, a strong final soft-cap; attn_logit_softcapping set, which
    # transformers' Gemma 3 does not apply (nor do we); untied, sharded
    "alternating": {
        "num_hidden_layers": 4, "tie_word_embeddings": False, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0}},
        "final_logit_softcapping": 0.5, "attn_logit_softcapping": 30.0,
    },
    # what llama.cpp's gemma3 GGUF can say: every sixth layer global (transformers' default pattern), query scale
    # 1/sqrt(head_dim), local base 10000; here also Gemma 3 4B's linear x8 global RoPE and a soft-cap; tied
    "pattern6": {
        "num_hidden_layers": 6, "tie_word_embeddings": True, "query_pre_attn_scalar": 32,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
        "final_logit_softcapping": 2.0,
    },
}  # fmt: skip
TP_BOUND = 5e-5  # a 2x2 mesh vs one device (tests/sampler/test_sharding.py, docs/engine.md)
IDS = [int(t) for t in np.random.default_rng(1).integers(0, BASE["vocab_size"], size=40)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma3(request, tmp_path_factory):
    """(variant, safetensors directory, the transformers model)."""
    cfg = transformers.Gemma3TextConfig(**BASE, **VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")  # the reference: no fused kernel's rounding
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():  # random norms (Gemma's start at w = 0, a unit scale): every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(f"gemma3-{request.param}")
    model.save_pretrained(out / "hf", max_shard_size="100KB" if request.param == "alternating" else "1GB")
    return request.param, out / "hf", model


def write_gguf(model, path: pathlib.Path) -> None:
    """The model as llama.cpp's converter writes a gemma3 GGUF, in F32: its metadata keys (the global layers' RoPE
    base and linear scaling, the window, the soft-cap), tensor names by the gguf package's own map, every norm
    weight stored as 1 + w, no output matrix (tied)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    full = c.rope_parameters["full_attention"]
    w.add_rope_freq_base(float(full["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(float(full["factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        arr = tensor.numpy().astype(np.float32)
        w.add_tensor(
            names.get_name(name, try_suffixes=(".weight",)), arr + 1 if name.endswith("norm.weight") else arr
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


assert_matches = functools.partial(fidelity.assert_matches, ids=IDS)


def altered(loaded, **changes):
    """The same weights under a config with `changes` (what the model would compute without a feature)."""
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, **changes))


def test_safetensors_and_orbax_match_transformers(gemma3, tmp_path, figure):
    name, hf_dir, model = gemma3
    ref = reference_logits(model, IDS)
    loaded = load_model(hf_dir, with_tokenizer=False)
    cfg = loaded.config
    local = tuple(t == "sliding_attention" for t in model.config.layer_types)
    assert (cfg.architecture, cfg.sliding_layers, cfg.sliding_window) == ("gemma3", local, 8)
    assert True in local and False in local and len(IDS) == 5 * cfg.sliding_window
    assert cfg.tie_word_embeddings == (name == "pattern6") and ("lm_head" in loaded.params) == (
        name != "pattern6"
    )
    assert (hf_dir / "model.safetensors.index.json").exists() == (name == "alternating")
    # both layer loops: unrolled over per-layer arrays and a scan over stacked ones (the layer kind by index)
    diffs = {"safetensors": max(assert_matches(loaded, ref, False), assert_matches(loaded, ref, True))}
    # each Gemma feature changes the result, so a model that dropped one would not pass unnoticed
    for change in ({"sliding_layers": (False,) * cfg.num_layers}, {"rope_local_theta": cfg.rope_theta},
                   {"rope_linear_factor": None}, {"final_logit_softcapping": None}):  # fmt: skip
        assert np.abs(our_logits(altered(loaded, **change), IDS) - ref).max() > 1e-3, change
    if name == "alternating":  # the query scale (pattern6's is head_dim's own)
        assert np.abs(our_logits(altered(loaded, query_pre_attn_scalar=None), IDS) - ref).max() > 1e-3

    convert(hf_dir, tmp_path / "ckpt", with_tokenizer=False)
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt", with_tokenizer=False)
    assert restored.config == cfg
    diffs["orbax"] = assert_matches(restored, ref)
    figure(f"gemma3 {name}: max |d logit|, |d logprob| vs transformers (fp32, 40 tokens): "
           + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))  # fmt: skip


@pytest.mark.parametrize("gemma3", ["pattern6"], indirect=True)  # what llama.cpp's gemma3 metadata can say
def test_gguf_in_llama_cpp_conventions_matches_transformers(gemma3, tmp_path, figure):
    _, hf_dir, model = gemma3
    write_gguf(model, tmp_path / "model.gguf")
    from_gguf = load_model(tmp_path / "model.gguf", with_tokenizer=False)
    # the same config, but for the epsilon that GGUF keeps as a float32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=1e-6) == config_from_hf(hf_dir)
    diff = assert_matches(from_gguf, reference_logits(model, IDS))
    figure(f"gemma3 pattern6 from GGUF: max |d logit|, |d logprob| vs transformers: {diff:.1e}")


def test_a_config_json_of_transformers_4_reads_the_same(gemma3, tmp_path):
    """Gemma 3's config.json as transformers 4 wrote it (as the published checkpoints hold it): rope_theta,
    rope_scaling (global layers), rope_local_base_freq, sliding_window_pattern instead of layer_types."""
    name, hf_dir, _ = gemma3
    raw = json.loads((hf_dir / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    full, local = rope["full_attention"], rope["sliding_attention"]
    raw.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=local["rope_theta"], rope_scaling=full)
    if name == "pattern6":  # alternating layers have no pattern of every n-th
        raw.pop("layer_types")
        raw.pop("_sliding_window_pattern")
        raw["sliding_window_pattern"] = 6
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert config_from_hf(tmp_path) == config_from_hf(hf_dir)


@pytest.mark.parametrize("gemma3", ["alternating"], indirect=True)  # both layer kinds every other layer
def test_greedy_continuations_through_the_engine_equal_transformers(gemma3, tmp_path, figure):
    """16 greedy tokens after each of two prompts (decoded side by side; the first ends past two windows), and
    each token's logprob, equal to transformers' greedy search and logprobs: from safetensors and after the Orbax
    round trip. int8 weights load and serve the same first tokens."""
    _, hf_dir, model = gemma3
    prompts = [IDS[:21], IDS[5:12]]
    want = []
    for prompt in prompts:
        ids, logprobs = list(prompt), []
        for _ in range(16):  # transformers' greedy search, one full forward per token
            lp = log_softmax(reference_logits(model, ids)[-1])
            ids.append(int(lp.argmax()))
            logprobs.append(lp[ids[-1]])
        want.append((ids[len(prompt) :], logprobs))
    convert(hf_dir, tmp_path / "ckpt", with_tokenizer=False)
    settings = engine_config(slots=2, max_seq_len=64, min_batch_bucket=2, kv_pages=16)
    for source in (hf_dir, tmp_path / "ckpt"):
        engine = JaxEngine(load_model(source, with_tokenizer=False), settings)
        got, _ = run_engine(
            engine, [(slot, p, SlotParams(max_tokens=16, temperature=0.0)) for slot, p in enumerate(prompts)]
        )
        for slot, (tokens, logprobs) in enumerate(want):
            assert got[slot][0] == tokens, (source, slot)
            assert np.abs(np.asarray(got[slot][1]) - logprobs).max() < BOUND, (source, slot)

    int8 = load_model(hf_dir, with_tokenizer=False, quantization="int8")
    assert int8.quantization == "int8"
    ours = our_logits(int8, IDS)
    ref = reference_logits(model, IDS)
    drift = np.abs(log_softmax(ours) - log_softmax(ref)).max()
    assert np.isfinite(ours).all() and drift < 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9
    figure(f"gemma3 int8: max |dlogprob| vs transformers' fp32 {drift:.2e} (40 tokens x 384 vocab)")


@pytest.mark.parametrize("gemma3", ["alternating"], indirect=True)
def test_a_2x2_mesh_serves_what_one_device_does(gemma3, figure):
    """Tensor parallel on 4 fake CPU devices (tests/conftest.py): the heads, KV heads and MLP split over the
    model axis; the same greedy tokens as one device, logprobs within the mesh's bound."""
    assert len(jax.devices()) >= 4, "tests/conftest.py sets --xla_force_host_platform_device_count=4"
    _, hf_dir, _ = gemma3
    settings = engine_config(slots=2, max_seq_len=64, min_batch_bucket=2, kv_pages=16)
    mesh = make_mesh(model_parallel=2, data_parallel=2)
    sharded = load_model(hf_dir, with_tokenizer=False, mesh=mesh)
    assert sharded.params["w_gate"].sharding.spec[1] == "model"
    params = SlotParams(max_tokens=8, temperature=0.0)
    one, _ = run_engine(
        JaxEngine(load_model(hf_dir, with_tokenizer=False), settings), [(0, IDS[:21], params)]
    )
    tp, _ = run_engine(JaxEngine(sharded, settings, mesh=mesh), [(0, IDS[:21], params)])
    assert tp[0][0] == one[0][0]
    diff = np.abs(np.asarray(tp[0][1]) - np.asarray(one[0][1])).max()
    assert diff < TP_BOUND
    figure(f"gemma3 on a 2x2 mesh: max |dlogprob| vs one device {diff:.1e} (8 greedy tokens)")


# ---- the chat template -----------------------------------------------------------------------------------------

# Gemma 3's chat template as google/gemma-3-*-it publish it: BOS first, a system message folded into the first
# user turn, "model" for the assistant's role, contents trimmed, text parts of list contents joined
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
CHATS = {
    "system-folded": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " 2+2? 😀\n"}],
    "multi-turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!\n\n"},
        {"role": "user", "content": "\tAnd now? "},
    ],
}


@pytest.fixture(scope="module")
def gemma3_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """The embedded model's vocabulary with Gemma's special tokens added (<bos>, <eos>, <start_of_turn>,
    <end_of_turn>, <start_of_image>), carrying Gemma 3's chat template."""
    tokenizers = require_extra("tokenizers")
    directory = tmp_path_factory.mktemp("gemma3-tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(directory)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]
    backend.add_special_tokens(specials)
    backend.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=GEMMA3_TEMPLATE, bos_token="<bos>", eos_token="<eos>", add_bos_token=False,
                  additional_special_tokens=[*config.get("additional_special_tokens", []), *specials])  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_renders_what_transformers_renders(gemma3_tokenizer_dir, chat):
    ours = load_tokenizer(gemma3_tokenizer_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(gemma3_tokenizer_dir))
    messages = CHATS[chat]
    text, ids = ours.render_chat(messages, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert ids == list(want if isinstance(want, list) else want["input_ids"])
    assert text.startswith("<bos><start_of_turn>user\n") and text.endswith(
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    if chat == "system-folded":
        assert text == "<bos><start_of_turn>user\nBe brief.\n\n2+2? 😀<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ValueError, match="must alternate"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])

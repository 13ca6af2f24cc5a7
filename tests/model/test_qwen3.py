"""Qwen3 dense against transformers: tiny random Qwen3ForCausalLM checkpoints (per-head RMSNorm on queries and keys
before RoPE, a head dim other than hidden / heads, tied and untied embeddings, with and without attention_bias)
written by transformers as safetensors and as a GGUF file named by the gguf package's own Qwen3 tensor map; our
logits and teacher-forced logprobs vs PyTorch's in fp32, greedy continuations through the engine, the Orbax round
trip, and Qwen3's chat template (its `enable_thinking` argument) vs transformers' `apply_chat_template`."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib

import gguf
import numpy as np
import pytest
from tpuserve.grpc_service.server import main as backend_main
from tpuserve.grpc_service.settings import ServerSettings
from tpuserve.model import checkpoint
from tpuserve.model.config import ModelLoadError
from tpuserve.model.embedded import default_model_path
from tpuserve.model.loader import convert, load_model
from tpuserve.model.tokenizer import load_tokenizer
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.config import EngineConfig
from tpuserve.sampler.engine import JaxEngine
from tpuserve.sampler.generate_cli import main as generate_main

from tests.helpers import engine_config, free_port, require_extra, run_engine
from tests.model import fidelity
from tests.model.fidelity import BOUND, log_softmax, our_logits, reference_logits

torch = require_extra("torch")
transformers = require_extra("transformers")

# head_dim 32 != hidden 64 / 4 heads (as Qwen3-8B+ and 0.6B differ from hidden / heads); 2 query heads per KV head
BASE = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6}  # fmt: skip
VARIANTS = {
    "untied": {"tie_word_embeddings": False},
    # attention_bias: transformers gives q, k, v and o their biases
    "tied-bias": {"tie_word_embeddings": True, "attention_bias": True},
}
IDS = [int(t) for t in np.random.default_rng(1).integers(0, BASE["vocab_size"], size=40)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def qwen3(request, tmp_path_factory):
    """(variant, safetensors directory, GGUF file, the transformers model)."""
    cfg = transformers.Qwen3Config(**BASE, **VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random (not unit / zero) norms and biases, so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    # the untied one sharded: several files and model.safetensors.index.json
    model.save_pretrained(out / "hf", max_shard_size="100KB" if request.param == "untied" else "1GB")
    write_gguf(model, out / "model.gguf")
    return request.param, out / "hf", out / "model.gguf", model


def write_gguf(model, path: pathlib.Path) -> None:
    """The model as a Qwen3 GGUF of F32 tensors: llama.cpp's metadata keys, its tensor names by the gguf package's
    own map from transformers' names (no row permutation: llama.cpp runs Qwen3 with NEOX RoPE)."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(
            names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.numpy().astype(np.float32)
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


assert_matches = functools.partial(fidelity.assert_matches, ids=IDS)


def test_safetensors_gguf_and_orbax_match_transformers(qwen3, tmp_path, figure):
    name, hf_dir, gguf_path, model = qwen3
    ref = reference_logits(model, IDS)
    loaded = load_model(hf_dir, with_tokenizer=False)
    cfg = loaded.config
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim) == ("qwen3", True, 32)
    assert cfg.tie_word_embeddings == (name == "tied-bias") and ("lm_head" in loaded.params) == (
        name == "untied"
    )
    assert cfg.attention_bias == cfg.output_bias == (name == "tied-bias")
    assert (hf_dir / "model.safetensors.index.json").exists() == (name == "untied")
    # both layer loops: unrolled over per-layer arrays and a scan over stacked ones
    diffs = {"safetensors": max(assert_matches(loaded, ref, False), assert_matches(loaded, ref, True))}
    # the Q/K norms change the result (a model that skipped them would not pass unnoticed)
    unnormed = dataclasses.replace(loaded, config=dataclasses.replace(cfg, qk_norm=False))
    unnormed.params = {n: a for n, a in loaded.params.items() if n not in ("q_norm", "k_norm")}
    assert np.abs(our_logits(unnormed, IDS, True) - ref).max() > 1e-2

    from_gguf = load_model(gguf_path, with_tokenizer=False)
    # the same config, but for the epsilon that GGUF keeps as a float32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=1e-6) == cfg
    assert from_gguf.config.rms_norm_eps == np.float32(1e-6)
    diffs["gguf"] = assert_matches(from_gguf, ref)

    convert(hf_dir, tmp_path / "ckpt", with_tokenizer=False)
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt", with_tokenizer=False)
    assert restored.config == cfg
    diffs["orbax"] = assert_matches(restored, ref)
    figure(f"qwen3 {name}: max |d logit|, |d logprob| vs transformers (fp32, 40 tokens): "
           + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))  # fmt: skip


@pytest.mark.parametrize("qwen3", ["untied"], indirect=True)  # Qwen3's own shape (no biases): the other's
def test_greedy_continuations_through_the_engine_equal_transformers(qwen3):  # logits are checked above
    """16 greedy tokens after each of two prompts (decoded side by side), and each token's logprob, equal to
    transformers' greedy search and logprobs."""
    _, hf_dir, _, model = qwen3
    loaded = load_model(hf_dir, with_tokenizer=False)
    engine = JaxEngine(loaded, engine_config(slots=2, max_seq_len=64, min_batch_bucket=2, kv_pages=16))
    prompts = [IDS[:21], IDS[5:12]]
    got, _ = run_engine(
        engine, [(slot, p, SlotParams(max_tokens=16, temperature=0.0)) for slot, p in enumerate(prompts)]
    )
    for slot, prompt in enumerate(prompts):
        ids, logprobs = list(prompt), []
        for _ in range(16):  # transformers' greedy search, one full forward per token
            lp = log_softmax(reference_logits(model, ids)[-1])
            ids.append(int(lp.argmax()))
            logprobs.append(lp[ids[-1]])
        assert got[slot][0] == ids[len(prompt) :], f"prompt {slot}"
        assert np.abs(np.asarray(got[slot][1]) - logprobs).max() < BOUND


def test_checkpoint_of_an_unsupported_architecture_fails_with_one_line(tmp_path, caplog, capsys):
    """A multimodal Gemma 3 directory (only gemma3_text is served): the loader's error names it and the supported
    list; the backend (what `tpuserve serve` runs) logs that one line and exits 2, `tpuserve generate` prints it:
    no traceback."""
    config = {"model_type": "gemma3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    line = (f"{tmp_path / 'config.json'}: unsupported architecture model_type='gemma3'; "
            "supported: llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe")  # fmt: skip
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path)
    assert str(e.value) == line
    settings = (
        ServerSettings(port=free_port()),
        EngineConfig(model=str(tmp_path), compilation_cache_dir="none"),
    )
    with caplog.at_level(logging.ERROR):
        assert backend_main(settings=settings) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [line]
    with pytest.raises(SystemExit) as exited:
        generate_main(["--model", str(tmp_path), "hello"])
    assert exited.value.code == 2 and capsys.readouterr().err == f"tpuserve generate: {line}\n"


# ---- the chat template -----------------------------------------------------------------------------------------

# Qwen/Qwen3-0.6B's tokenizer_config.json chat_template, as published
QWEN3_TEMPLATE = (pathlib.Path(__file__).parent / "qwen3_chat_template.jinja").read_text()
CHATS = {
    "first-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 😀"}],
    "after-a-thought": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
        {"role": "user", "content": "And now?"},
    ],
}


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A ChatML vocabulary (the embedded model's: <|im_start|>, <|im_end|>) carrying Qwen3's chat template."""
    directory = tmp_path_factory.mktemp("qwen3-tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["default", "no-thinking", "thinking"])  # fmt: skip
def test_chat_template_with_enable_thinking_renders_what_transformers_renders(
    qwen3_tokenizer_dir, chat, kwargs
):
    ours = load_tokenizer(qwen3_tokenizer_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    messages = CHATS[chat]
    text, ids = ours.render_chat(messages, add_generation_prompt=True, template_kwargs=kwargs)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    assert ids == list(want if isinstance(want, list) else want["input_ids"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") == (
        kwargs.get("enable_thinking") is False
    )
    with pytest.raises(ValueError, match="may not set messages"):
        ours.render_chat(messages, template_kwargs={"messages": []})


def test_chat_template_kwargs_reach_the_template_over_grpc_and_http(qwen3_tokenizer_dir):
    """`enable_thinking` as a gRPC chat's chat_template_kwargs_json and as vLLM's `chat_template_kwargs` over HTTP
    (the fake engine behind a real backend and gateway): the prompt ids are transformers' for the same arguments;
    arguments the template may not take, or that are not an object, are a 400."""
    import httpx
    from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

    from tests.grpc_service.conftest import ServerThread
    from tests.grpc_service.fake_engine import make_engine
    from tests.http_gateway.gateway_harness import GatewayServer

    ours = load_tokenizer(qwen3_tokenizer_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    messages = CHATS["first-turn"]
    server = ServerThread(make_engine(ours, slots=2, max_seq_len=256), ours, model_id="qwen3-chat")
    gateway = GatewayServer([server.address]).start()
    try:
        for thinking in (False, True):
            want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                           enable_thinking=thinking)  # fmt: skip
            want = list(want if isinstance(want, list) else want["input_ids"])
            chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages],
                                   chat_template_kwargs_json=json.dumps({"enable_thinking": thinking}))  # fmt: skip
            assert list(server.stub.RenderChat(pb.RenderChatRequest(chat=chat)).token_ids) == want
            body = {"model": "qwen3-chat", "messages": messages, "max_tokens": 1, "return_token_ids": True,
                    "chat_template_kwargs": {"enable_thinking": thinking}}  # fmt: skip
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["prompt_token_ids"] == want
        for bad in ({"messages": []}, ["enable_thinking"]):
            body = {"model": "qwen3-chat", "messages": messages, "max_tokens": 1, "chat_template_kwargs": bad}
            r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    finally:
        gateway.stop()
        server.close()

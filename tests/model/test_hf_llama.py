"""Tiny random Llama-family checkpoints written by transformers: our logits vs PyTorch, from safetensors and
after a round trip through Orbax."""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np
import pytest

from tests.helpers import require_extra

torch = require_extra("torch")
transformers = require_extra("transformers")

import jax
import jax.numpy as jnp
from tpuserve.model import checkpoint
from tpuserve.model.config import ModelLoadError
from tpuserve.model.llama import init_cache
from tpuserve.model.loader import convert, load_model

BASE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip

VARIANTS = {
    "llama-tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama-untied-llama3rope": (
        transformers.LlamaConfig,
        {"tie_word_embeddings": False, "rope_scaling": LLAMA3_ROPE},
    ),
    "qwen2-bias": (transformers.Qwen2Config, {"tie_word_embeddings": False}),
    "mistral": (transformers.MistralConfig, {"tie_word_embeddings": False, "sliding_window": None}),
    # a window shorter than the 40-token test sequence: later queries must not see the first keys
    "mistral-window8": (transformers.MistralConfig, {"tie_word_embeddings": False, "sliding_window": 8}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_model_dir(request, tmp_path_factory):
    config_cls, extra = VARIANTS[request.param]
    cfg = config_cls(**BASE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random (not zero) biases and norms, so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    # a small shard size forces the sharded layout with model.safetensors.index.json
    model.save_pretrained(out, max_shard_size="40KB" if request.param == "qwen2-bias" else "1GB")
    return request.param, out, model


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def our_logits(loaded, ids: list[int], scan_layers: bool = False) -> np.ndarray:
    m = loaded.module(scan_layers=scan_layers)
    T = len(ids)
    hidden, _ = m(jnp.asarray([ids]), jnp.arange(T)[None], init_cache(loaded.config, 1, T), T)
    return np.asarray(m.logits(hidden[0]))


def test_logits_match_transformers_from_safetensors_and_orbax(hf_model_dir, tmp_path, caplog):
    name, path, model = hf_model_dir
    ids = list(np.random.default_rng(1).integers(0, BASE["vocab_size"], size=40))
    ref = reference_logits(model, ids)
    with caplog.at_level(logging.INFO, logger="tpuserve.model.loader"):
        loaded = load_model(path, with_tokenizer=False)
    # not a terminal: the load's progress is a log line (a bar on a terminal)
    assert re.search(rf"loading {path.name}: \d+ tensors in [\d.]+ s", caplog.text), caplog.text
    assert loaded.config.architecture == name.split("-")[0]
    if name == "qwen2-bias":
        assert (path / "model.safetensors.index.json").exists() and loaded.config.attention_bias
    assert np.abs(our_logits(loaded, ids) - ref).max() < 1e-4
    # both layer loops: unrolled over per-layer arrays (CPU default) and a scan over stacked ones (TPU/GPU)
    assert np.abs(our_logits(loaded, ids, scan_layers=True) - ref).max() < 1e-4
    if name == "mistral-window8":
        assert loaded.config.sliding_window == 8
        # the window changes the result (the test would not notice a model that ignores it)
        unwindowed = dataclasses.replace(
            loaded, config=dataclasses.replace(loaded.config, sliding_window=None)
        )
        assert np.abs(our_logits(unwindowed, ids) - ref).max() > 1e-2

    convert(path, tmp_path / "ckpt", with_tokenizer=False)
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt", with_tokenizer=False)
    assert restored.config == loaded.config
    assert np.abs(our_logits(restored, ids) - ref).max() < 1e-4


def test_int8_at_load_and_from_convert(hf_model_dir, tmp_path, figure):
    """int8 weight-only per channel on a safetensors model: quantized at load, or written to Orbax by `convert
    --quantization int8` (the same weights); its drift from the unquantized model is measured (docs/engine.md). `keep`
    has no blocks to keep here and is refused, naming the mode and the tensors' type."""
    name, path, _ = hf_model_dir
    ids = list(np.random.default_rng(1).integers(0, BASE["vocab_size"], size=40))
    dense = load_model(path, with_tokenizer=False)
    at_load = load_model(path, with_tokenizer=False, quantization="int8")
    convert(path, tmp_path / "int8", with_tokenizer=False, quantization="int8")
    restored = load_model(tmp_path / "int8", with_tokenizer=False)
    assert restored.quantization == "int8" and at_load.quantization == "int8"
    assert (
        restored.weight_bytes == at_load.weight_bytes < 0.45 * dense.weight_bytes
    )  # norms, biases stay fp32
    got = our_logits(at_load, ids)
    np.testing.assert_array_equal(our_logits(restored, ids), got)
    np.testing.assert_array_equal(our_logits(restored, ids, scan_layers=True), our_logits(at_load, ids, True))
    convert(path, tmp_path / "fp32", with_tokenizer=False)  # an fp32 checkpoint served as int8
    from_fp32 = load_model(tmp_path / "fp32", with_tokenizer=False, quantization="int8")
    np.testing.assert_array_equal(our_logits(from_fp32, ids), got)
    ref = np.asarray(jax.nn.log_softmax(our_logits(dense, ids), -1))
    drift = np.abs(np.asarray(jax.nn.log_softmax(got, -1)) - ref).max()
    figure(f"int8 {name}: max |dlogprob| vs unquantized {drift:.2e} (40 tokens x {BASE['vocab_size']} vocab)")
    assert 0 < drift < 0.05
    with pytest.raises(
        ModelLoadError, match=r"quantization 'keep' serves a GGUF file's quantized blocks; .*F32"
    ):
        load_model(path, with_tokenizer=False, quantization="keep")
    with pytest.raises(ModelLoadError, match=r"quantization 'keep' .* an Orbax checkpoint of int8 weights"):
        load_model(tmp_path / "int8", with_tokenizer=False, quantization="keep")

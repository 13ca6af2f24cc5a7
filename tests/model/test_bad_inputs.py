"""Wrong or corrupt model files give a clear error naming the file and what is wrong."""

from __future__ import annotations

import json

import pytest
from tpuserve.model.config import ModelLoadError
from tpuserve.model.embedded import default_model_path
from tpuserve.model.loader import load_model


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf: no such file"):
        load_model(missing)


def test_truncated_gguf(tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as f:
        bad.write_bytes(f.read(200_000))
    with pytest.raises(ModelLoadError, match=r"truncated.gguf: not a readable GGUF file"):
        load_model(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "text.gguf"
    bad.write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match=r"text.gguf: not a readable GGUF file"):
        load_model(bad)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture model_type='gpt_neox'"):
        load_model(tmp_path)


# A valid Llama config.json for a directory whose weights are missing or broken.
TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 8,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights found"):
        load_model(tmp_path, with_tokenizer=False)


def test_corrupt_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(tmp_path, with_tokenizer=False)

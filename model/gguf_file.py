"""GGUF files: metadata, config and dequantized weights via the `gguf` package."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tpuserve.model.config import ModelConfig, ModelLoadError, config_from_gguf_fields
from tpuserve.model.progress import LoadProgress
from tpuserve.model.weights_stack import LayerStacker

_LAYER_MAP = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
_TOP_MAP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 frequencies: recomputed from the metadata


def open_gguf(path: pathlib.Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError, numpy errors, struct errors, ...
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from None


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    """GGUF key/value metadata as Python values (strings decoded, arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def gguf_config(reader: GGUFReader, fields: dict[str, Any], path: pathlib.Path) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    return config_from_gguf_fields(
        fields, str(path), has_output_weight="output.weight" in names, has_qkv_bias="blk.0.attn_q.bias" in names
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the q/k row permutation that llama.cpp's converter applies for its interleaved RoPE.

    w: [out, ...] with out = n_heads * head_dim, rows per head ordered (pairs) -> back to (halves)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_array(tensor: Any, path: pathlib.Path) -> np.ndarray:
    """Dequantize one tensor to float32 in PyTorch layout ([out, in] for matrices)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        arr = dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} uses quantization {qtype.name}, unsupported: {e}") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    if arr.size != int(np.prod(shape)):
        raise ModelLoadError(f"{path}: tensor {tensor.name} holds {arr.size} values, expected shape {shape}")
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def load_gguf_weights(
    reader: GGUFReader, cfg: ModelConfig, path: pathlib.Path, cast: Callable[[str, np.ndarray], object]
) -> dict[str, object]:
    stacker = LayerStacker(cfg, cast)
    with LoadProgress(f"loading {path.name}", total=len(reader.tensors)) as bar:
        for tensor in reader.tensors:
            if tensor.name not in _SKIPPED:
                _add_tensor(stacker, tensor, cfg, path)
            bar.update()
    return stacker.finish(str(path))


def _add_tensor(stacker: LayerStacker, tensor: Any, cfg: ModelConfig, path: pathlib.Path) -> None:
    name = tensor.name
    arr = tensor_array(tensor, path)
    permute = cfg.architecture in ("llama", "mistral")  # llama.cpp permutes q/k only for these
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        ours = _LAYER_MAP.get(rest)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {name}")
        if permute and ours in ("wq", "bq"):
            arr = unpermute_qk(arr, cfg.num_heads)
        elif permute and ours in ("wk", "bk"):
            arr = unpermute_qk(arr, cfg.num_kv_heads)
        stacker.add_layer(int(idx), ours, arr)  # [out, in], as llama.Llama keeps it
    elif name in _TOP_MAP:
        stacker.add_top(_TOP_MAP[name], arr)
    else:
        raise ModelLoadError(f"{path}: unexpected tensor {name}")

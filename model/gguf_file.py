"""GGUF files: metadata, config and weights via the `gguf` package: dequantized to float at load (the default
for non-GGUF sources, `quantization: none`), or kept in their blocks (`keep`, see tpuserve.model.quant)."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize
from tpuserve.model.config import ModelConfig, ModelLoadError, config_from_gguf_fields
from tpuserve.model.progress import LoadProgress
from tpuserve.model.quant import QuantizedMatrix, map_fields, pack4
from tpuserve.model.weights_stack import LayerStacker

_LAYER_MAP = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "wo",
    "attn_output.bias": "bo",
    "ffn_norm.weight": "mlp_norm",
    "post_attention_norm.weight": "attn_post_norm",  # gemma3: the attention output's norm
    "post_ffw_norm.weight": "mlp_post_norm",  # gemma3: the MLP output's norm
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    # qwen3moe: the router [E, H] and each layer's experts stacked ([E, Ie, H], [E, H, Ie] as numpy reads them)
    "ffn_gate_inp.weight": "w_router",
    "ffn_gate_exps.weight": "we_gate",
    "ffn_up_exps.weight": "we_up",
    "ffn_down_exps.weight": "we_down",
}
_TOP_MAP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 frequencies: recomputed from the metadata


def open_gguf(path: pathlib.Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (the gguf package raises ValueError, numpy errors, struct errors, ...)
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from None


def read_fields(reader: GGUFReader) -> dict[str, Any]:
    """GGUF key/value metadata as Python values (strings decoded, arrays as lists)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def gguf_config(reader: GGUFReader, fields: dict[str, Any], path: pathlib.Path) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    return config_from_gguf_fields(
        fields,
        str(path),
        has_output_weight="output.weight" in names,
        has_qkv_bias="blk.0.attn_q.bias" in names,
        has_output_bias="blk.0.attn_output.bias" in names,
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
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses quantization {qtype.name}, unsupported: {e}"
        ) from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    if arr.size != int(np.prod(shape)):
        raise ModelLoadError(f"{path}: tensor {tensor.name} holds {arr.size} values, expected shape {shape}")
    return np.asarray(arr, dtype=np.float32).reshape(shape)


_T = GGMLQuantizationType
KEEP_TYPES = (_T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q6_K)  # matrices `keep` serves from their blocks
_FLOAT_TYPES = (_T.F32, _T.F16, _T.BF16)  # read as float arrays in every mode


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """A float16 field at byte `start` of each block -> float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _unit_values(blocks: np.ndarray, qtype: GGMLQuantizationType, patch: dict[int, bytes]) -> np.ndarray:
    """The blocks' integer values, read by the gguf package's own dequantizer over a copy of the blocks whose
    scale fields (`patch`: byte offset -> bytes) make every scale one and every minimum zero."""
    unit = blocks.copy()
    for start, raw in patch.items():
        unit[:, start : start + len(raw)] = np.frombuffer(raw, np.uint8)
    return dequantize(unit, qtype)


_ONE, _ZERO = np.float16(1).tobytes(), np.float16(0).tobytes()


def tensor_quantized(tensor: Any, path: pathlib.Path) -> QuantizedMatrix:
    """One Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrix as a QuantizedMatrix whose dequantized weights equal
    `tensor_array`'s bit for bit (tests/model/test_quant.py)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    *lead, rows, cols = (int(d) for d in reversed(tensor.shape))  # lead: a MoE layer's experts
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(tensor.data).reshape(-1, type_size)
    if blocks.shape[0] * block_size != int(np.prod(lead, dtype=np.int64)) * rows * cols:
        raise ModelLoadError(f"{path}: tensor {tensor.name} holds {blocks.shape[0]} {qtype.name} blocks, "
                             f"expected shape {(*lead, rows, cols)}")  # fmt: skip
    offset = None
    if qtype == _T.Q8_0:
        q, scale, group, bits = blocks[:, 2:].copy().view(np.int8), _f16(blocks, 0), 32, 8
    elif qtype == _T.Q4_0:  # d * (q - 8) = d * q + (-8 d), every term exact
        q = _unit_values(blocks, qtype, {0: _ONE}) + 8
        scale, group, bits = _f16(blocks, 0), 32, 4
        offset = -8 * scale
    elif qtype == _T.Q4_1:  # d * q + m
        q = _unit_values(blocks, qtype, {0: _ONE, 2: _ZERO})
        scale, offset, group, bits = _f16(blocks, 0), _f16(blocks, 2), 32, 4
    elif qtype == _T.Q4_K:  # per 32: (d * sc) * q - dmin * m
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        unit_scales = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # every sc 1, every m 0
        q = _unit_values(blocks, qtype, {0: _ONE, 2: _ZERO, 4: unit_scales})
        scale = _f16(blocks, 0) * sc.astype(np.float32)
        offset = -(_f16(blocks, 2) * mn.astype(np.float32))
        group, bits = 32, 4
    elif qtype == _T.Q6_K:  # per 16: (d * sc) * (q - 32)
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        q = _unit_values(blocks, qtype, {192: bytes([1] * 16), 208: _ONE})
        scale, group, bits = _f16(blocks, 208) * sc, 16, 8
    else:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {qtype.name} blocks cannot be kept")
    q = np.asarray(q).reshape(*lead, rows, cols)
    q = pack4(q) if bits == 4 else q.astype(np.int8)
    per_row = cols // group
    scale = scale.astype(np.float32).reshape(*lead, rows, per_row)
    if offset is not None:
        offset = offset.astype(np.float32).reshape(*lead, rows, per_row)
    return QuantizedMatrix(q=q, scale=scale, offset=offset, bits=bits, group=group, kind=qtype.name)


def check_keep(reader: GGUFReader, path: pathlib.Path) -> None:
    """`keep` serves matrices from Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks (and float tensors as floats): any other type
    is refused before anything is loaded, naming the tensor and its type."""
    for tensor in reader.tensors:
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype in _FLOAT_TYPES or tensor.name in _SKIPPED:
            continue
        if qtype not in KEEP_TYPES or len(tensor.shape) not in (2, 3):  # 3: stacked experts [E, out, in]
            kept = ", ".join(t.name for t in KEEP_TYPES + _FLOAT_TYPES)
            raise ModelLoadError(
                f"{path}: quantization 'keep' cannot serve tensor {tensor.name} of type {qtype.name} "
                f"(it keeps {kept}); use quantization 'none' to dequantize it at load"
            )


def load_gguf_weights(
    reader: GGUFReader,
    cfg: ModelConfig,
    path: pathlib.Path,
    cast: Callable[[str, Any], object],
    keep: bool = False,
) -> dict[str, object]:
    """Every tensor, stacked and cast: dequantized to float32 first, or (`keep`) its quantized blocks as a
    QuantizedMatrix."""
    if keep:
        check_keep(reader, path)
    stacker = LayerStacker(cfg, cast)
    with LoadProgress(f"loading {path.name}", total=len(reader.tensors)) as bar:
        for tensor in reader.tensors:
            if tensor.name not in _SKIPPED:
                _add_tensor(stacker, tensor, cfg, path, keep)
            bar.update()
    return stacker.finish(str(path))


def _add_tensor(stacker: LayerStacker, tensor: Any, cfg: ModelConfig, path: pathlib.Path, keep: bool) -> None:
    name = tensor.name
    quantized = keep and GGMLQuantizationType(tensor.tensor_type) in KEEP_TYPES
    arr = tensor_quantized(tensor, path) if quantized else tensor_array(tensor, path)
    if cfg.norm_unit_offset and name.endswith("norm.weight"):
        # llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm scales by the weight), and the
        # model applies (1 + w) as transformers does. In fp32, (1 + w) - 1 is exact for 1 + w in [0.5, 2].
        arr = arr - np.float32(1.0)
    permute = cfg.architecture in ("llama", "mistral")  # llama.cpp permutes q/k only for these
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        ours = _LAYER_MAP.get(rest)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor {name}")
        if permute and ours in ("wq", "bq"):
            arr = map_fields(arr, lambda a: unpermute_qk(a, cfg.num_heads))
        elif permute and ours in ("wk", "bk"):
            arr = map_fields(arr, lambda a: unpermute_qk(a, cfg.num_kv_heads))
        stacker.add_layer(int(idx), ours, arr)  # [out, in], as llama.Llama keeps it
    elif name in _TOP_MAP:
        stacker.add_top(_TOP_MAP[name], arr)
    else:
        raise ModelLoadError(f"{path}: unexpected tensor {name}")

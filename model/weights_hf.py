"""Hugging Face safetensors directories (single file or sharded with model.safetensors.index.json)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

import numpy as np
from safetensors import SafetensorError, safe_open
from tpuserve.model.config import ModelConfig, ModelLoadError
from tpuserve.model.progress import LoadProgress
from tpuserve.model.weights_stack import LayerStacker

# transformers name (after "model.layers.{i}.") -> our name; layouts are the same ([out, in] matrices)
_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "wo",
    "self_attn.o_proj.bias": "bo",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "mlp.gate.weight": "w_router",  # Qwen3-MoE
    "mlp.experts.down_proj": "we_down",  # experts stored fused ([E, H, Ie]), as transformers >= 5 holds them
}
# one expert's matrix, "mlp.experts.{e}.{name}" (as Qwen3-MoE checkpoints store them): stacked over the experts
_EXPERT_MAP = {"gate_proj.weight": "we_gate", "up_proj.weight": "we_up", "down_proj.weight": "we_down"}
# Gemma 3: post_attention_layernorm is the attention output's norm; the MLP has a norm before and one after
_GEMMA3_LAYER_MAP = {
    **_LAYER_MAP,
    "post_attention_layernorm.weight": "attn_post_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "mlp_post_norm",
}
_TOP_MAP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}


def safetensors_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: listed in the safetensors index but missing")
    return files


def load_hf_weights(
    directory: pathlib.Path, cfg: ModelConfig, cast: Callable[[str, np.ndarray], object]
) -> dict[str, object]:
    """Read every tensor, map it to our names/layouts, stack the blocks, cast (and place) each parameter."""
    stacker = LayerStacker(cfg, cast)
    files = safetensors_files(directory)
    with LoadProgress(f"loading {directory.name}") as bar:
        for f in files:
            try:
                with safe_open(str(f), framework="numpy") as st:
                    for key in st.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                        _add(stacker, key, st.get_tensor(key), f)
                        bar.update()
            except SafetensorError as e:
                raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    if cfg.tie_word_embeddings:
        stacker.top.pop("lm_head", None)
    return stacker.finish(str(directory))


def _add(stacker: LayerStacker, key: str, tensor: np.ndarray, file: pathlib.Path) -> None:
    if key.startswith("model.layers."):
        _, _, idx, rest = key.split(".", 3)
        if rest.startswith("mlp.experts."):
            parts = rest.split(".", 3)
            if len(parts) == 4 and parts[2].isdigit() and parts[3] in _EXPERT_MAP:
                stacker.add_expert(int(idx), int(parts[2]), _EXPERT_MAP[parts[3]], tensor)
                return
            if rest == "mlp.experts.gate_up_proj":  # fused [E, 2 * Ie, H]: gate rows, then up rows
                half = tensor.shape[1] // 2
                stacker.add_layer(int(idx), "we_gate", tensor[:, :half])
                stacker.add_layer(int(idx), "we_up", tensor[:, half:])
                return
        layer_map = _GEMMA3_LAYER_MAP if stacker.cfg.sandwich_norms else _LAYER_MAP
        if rest not in layer_map:
            if rest.endswith("rotary_emb.inv_freq"):
                return
            raise ModelLoadError(f"{file}: unexpected tensor {key}")
        stacker.add_layer(int(idx), layer_map[rest], tensor)
    elif key in _TOP_MAP:
        stacker.add_top(_TOP_MAP[key], tensor)
    else:
        raise ModelLoadError(f"{file}: unexpected tensor {key}")

"""Model configuration: one frozen dataclass, built from a Hugging Face `config.json` or from GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe")
# GGUF `general.architecture` -> ours, where llama.cpp names it otherwise
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe"}


def hf_model_types() -> dict[str, str]:
    """Hugging Face `model_type` -> our architecture: the same name but for Gemma 3, whose text-only model is
    `gemma3_text` (`gemma3` there is the multimodal one, not served)."""
    return {("gemma3_text" if a == "gemma3" else a): a for a in SUPPORTED_ARCHITECTURES}


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on the Q/K/V products
    output_bias: bool = False  # a bias on the attention output product (Llama, Qwen3 with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's queries and keys (weights [D]) before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral: a query sees only the last `sliding_window` positions
    # Gemma 3. Per layer, whether it is a local one: it alone sees only `sliding_window` positions and rotates by
    # `rope_local_theta` (the others by `rope_theta`, with `rope_linear_factor`). Empty: every layer alike.
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None  # linear RoPE scaling: frequencies divided by it
    query_pre_attn_scalar: float | None = None  # attention scale: its **-0.5 (else head_dim**-0.5)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_activation: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh" (Gemma)
    norm_unit_offset: bool = False  # Gemma: every RMSNorm scales by (1 + w), in fp32
    sandwich_norms: bool = False  # Gemma: RMSNorm of the attention's and the MLP's outputs (pre-residual)
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the activations' dtype

    # Mixture of experts (Qwen3-MoE, model/moe.py): every layer's MLP is `num_experts` experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token, their router weights renormalized to sum
    # to one when `norm_topk_prob`. 0 experts: a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["sliding_layers"] = tuple(d.get("sliding_layers") or ())
        return cls(**d)


def _as_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _hf_rope(raw: dict[str, Any], file: pathlib.Path) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from a config.json. transformers >= 5 writes `rope_parameters`; older versions
    `rope_theta` + `rope_scaling`."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if rope_type not in ("default", None):
        raise ModelLoadError(f"{file}: unsupported rope_type {rope_type!r} (supported: default, llama3)")
    return theta, None


def _gemma3_hf(raw: dict[str, Any], file: pathlib.Path) -> dict[str, Any]:
    """Gemma 3's own fields from a config.json (`rope_theta` too, popped by the caller), with transformers'
    defaults: which layers are local (`layer_types`, or every `sliding_window_pattern`-th layer global), each
    kind's RoPE (transformers >= 5: `rope_parameters` per layer kind; before: `rope_theta` and `rope_scaling` for
    the global layers, `rope_local_base_freq` for the local ones). `attn_logit_softcapping` is not read:
    transformers' Gemma3Attention does not apply it (nor does llama.cpp, whose converter refuses it)."""
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{file}: gemma3's use_bidirectional_attention (an encoder) is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{file}: unsupported hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
    n = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(kinds) != n or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{file}: layer_types must name sliding_attention or full_attention for each of {n} "
                             f"layers, got {kinds!r}")  # fmt: skip
    rope = raw.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    full_type = full.get("rope_type", full.get("type", "default"))
    local_type = local.get("rope_type", local.get("type", "default"))
    if full_type not in ("default", "linear") or local_type != "default":
        raise ModelLoadError(f"{file}: unsupported gemma3 rope_type {full_type!r} (global layers) / {local_type!r} "
                             "(local layers); supported: default or linear / default")  # fmt: skip
    window = raw.get("sliding_window", 4096)
    if "sliding_attention" in kinds and not window:
        raise ModelLoadError(f"{file}: gemma3 has sliding_attention layers but no sliding_window")
    cap = raw.get("final_logit_softcapping")
    return {
        "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
        "sliding_layers": tuple(k == "sliding_attention" for k in kinds),
        "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
        "rope_linear_factor": float(full["factor"]) if full_type == "linear" else None,
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": float(cap) if cap else None,
        "hidden_activation": act,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "scale_embeddings": True,
    }


def config_from_hf(path: str | pathlib.Path) -> ModelConfig:
    """From a Hugging Face model directory (or its config.json)."""
    path = pathlib.Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{file}: no config.json (not a Hugging Face model directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    arch = hf_model_types().get(model_type)
    if arch is None:
        raise ModelLoadError(
            f"{file}: unsupported architecture model_type={model_type!r}; supported: {', '.join(hf_model_types())}"
        )
    gemma = _gemma3_hf(raw, file) if arch == "gemma3" else {}
    theta, scaling = (gemma.pop("rope_theta"), None) if gemma else _hf_rope(raw, file)
    bias = bool(raw.get("attention_bias", arch == "qwen2"))
    window = raw.get("sliding_window") if arch in ("mistral", "gemma3") else None
    if arch in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window"):
        raise ModelLoadError(
            f"{file}: {arch}'s per-layer sliding window (use_sliding_window) is not supported"
        )
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=bias,
            output_bias=bias and arch != "qwen2",  # transformers: o_proj's bias too, but for Qwen2
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            sliding_window=int(window) if window else None,
            **(_hf_experts(raw, file) if arch == "qwen3_moe" else {}),
            **gemma,
        )
    except KeyError as e:
        raise ModelLoadError(f"{file}: missing required field {e.args[0]!r}") from None


def _hf_experts(raw: dict[str, Any], file: pathlib.Path) -> dict[str, Any]:
    """Qwen3-MoE's expert fields of a config.json. transformers >= 5 writes `num_local_experts` for
    `num_experts`. Only models whose every layer is a MoE layer are served: transformers gives a layer a dense MLP
    when it is in `mlp_only_layers` or (index + 1) is not a multiple of `decoder_sparse_step`."""
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = sorted(set(raw.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step})
    if dense:
        raise ModelLoadError(f"{file}: dense MLP layers {dense[:8]} in a qwen3_moe model (mlp_only_layers, "
                             "decoder_sparse_step) are not supported: every layer must be a MoE layer")  # fmt: skip
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    used = int(raw["num_experts_per_tok"])
    if not 0 < used <= experts:
        raise ModelLoadError(f"{file}: num_experts_per_tok {used} with {experts} experts")
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False))}  # fmt: skip


def config_from_gguf_fields(
    fields: dict[str, Any],
    file: str,
    has_output_weight: bool,
    has_qkv_bias: bool,
    has_output_bias: bool = False,
) -> ModelConfig:
    """From GGUF metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...), already read to Python values."""
    arch = fields.get("general.architecture")
    if GGUF_ARCHITECTURES.get(arch, arch) not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: unsupported architecture general.architecture={arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        v = fields.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"{file}: GGUF metadata lacks {arch}.{key}")
        return v

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(
        fields.get(f"{arch}.attention.key_length")
        or fields.get(f"{arch}.rope.dimension_count")
        or hidden // heads
    )
    scaling = None
    if fields.get(f"{arch}.rope.scaling.type") == "llama3" or fields.get("llama.rope.scaling.factor"):
        scaling = RopeScaling(
            factor=float(get("rope.scaling.factor")),
            low_freq_factor=float(fields.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(fields.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
        )
    eos = fields.get("tokenizer.ggml.eos_token_id")
    moe = arch == "qwen3moe"
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES.get(arch, arch),
        vocab_size=int(
            fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or ()) or 0
        ),
        hidden_size=hidden,
        # a MoE model's dense layers' (none served): llama.cpp's converter may leave it out
        intermediate_size=int(get("feed_forward_length", 0 if moe else None)),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(fields.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings=not has_output_weight,
        attention_bias=has_qkv_bias,
        output_bias=has_output_bias,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_ids(eos),
        sliding_window=int(fields.get(f"{arch}.attention.sliding_window") or 0) or None,
        **(_gguf_experts(fields, arch, file) if moe else {}),
        **(_gguf_gemma3(fields, hidden, heads, head_dim) if arch == "gemma3" else {}),
    )


def _gguf_gemma3(fields: dict[str, Any], hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's own fields as llama.cpp reads a gemma3 GGUF: with a sliding window, every layer but each sixth
    is local (its fixed pattern), local layers rotate by base 10000 (unless `rope.freq_base_swa` says) unscaled;
    linear RoPE scaling (`rope.scaling.type`) applies to the global layers; the query scale is 1/sqrt(head_dim),
    or 1/sqrt(hidden / heads) for the 62-layer (27B) model, as Gemma 3's query_pre_attn_scalar is; the final
    soft-cap where `final_logit_softcapping` is written. The norms' weights hold 1 + w (gguf_file undoes it)."""
    layers = int(fields["gemma3.block_count"])
    window = int(fields.get("gemma3.attention.sliding_window") or 0)
    linear = fields.get("gemma3.rope.scaling.type") == "linear"
    cap = fields.get("gemma3.final_logit_softcapping")
    return {
        "sliding_layers": tuple(bool(window) and i % 6 < 5 for i in range(layers)),
        "rope_local_theta": float(fields.get("gemma3.rope.freq_base_swa", 10_000.0)),
        "rope_linear_factor": float(fields["gemma3.rope.scaling.factor"]) if linear else None,
        "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
        "final_logit_softcapping": float(cap) if cap else None,
        "hidden_activation": "gelu_pytorch_tanh",
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "scale_embeddings": True,
    }


def _gguf_experts(fields: dict[str, Any], arch: str, file: str) -> dict[str, Any]:
    """The expert fields of a qwen3moe GGUF. llama.cpp always renormalizes qwen3moe's top-k router weights (its
    converter writes no flag for it); `{arch}.expert_weights_norm`, where present, says otherwise."""
    values = {}
    for ours, key in (("num_experts", "expert_count"), ("num_experts_per_tok", "expert_used_count"),
                      ("moe_intermediate_size", "expert_feed_forward_length")):  # fmt: skip
        if fields.get(f"{arch}.{key}") is None:
            raise ModelLoadError(f"{file}: GGUF metadata lacks {arch}.{key}")
        values[ours] = int(fields[f"{arch}.{key}"])
    if not 0 < values["num_experts_per_tok"] <= values["num_experts"]:
        raise ModelLoadError(f"{file}: {arch}.expert_used_count {values['num_experts_per_tok']} with "
                             f"{values['num_experts']} experts")  # fmt: skip
    values["norm_topk_prob"] = bool(fields.get(f"{arch}.expert_weights_norm", True))
    return values


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> list[float]:
    """Inverse frequencies [head_dim/2], with Llama 3 or linear scaling when configured (as transformers computes
    them); `local`: Gemma 3's local layers' (base `rope_local_theta`, unscaled)."""
    half = cfg.head_dim // 2
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = [1.0 / (theta ** (2 * i / cfg.head_dim)) for i in range(half)]
    if local:
        return inv
    if cfg.rope_linear_factor:
        inv = [f / cfg.rope_linear_factor for f in inv]
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:
            out.append(f / s.factor)
        elif wavelen < high_wavelen:
            out.append(f)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out

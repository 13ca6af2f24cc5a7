"""Model configuration: one frozen dataclass, built from a Hugging Face `config.json` or from GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: unsupported architecture model_type={arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    theta, scaling = _hf_rope(raw, file)
    bias = bool(raw.get("attention_bias", arch == "qwen2"))
    window = raw.get("sliding_window") if arch == "mistral" else None
    if arch in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
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
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bias,
            output_bias=bias and arch != "qwen2",  # transformers: o_proj's bias too, but for Qwen2
            qk_norm=arch == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
            sliding_window=int(window) if window else None,
        )
    except KeyError as e:
        raise ModelLoadError(f"{file}: missing required field {e.args[0]!r}") from None


def config_from_gguf_fields(
    fields: dict[str, Any],
    file: str,
    has_output_weight: bool,
    has_qkv_bias: bool,
    has_output_bias: bool = False,
) -> ModelConfig:
    """From GGUF metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...), already read to Python values."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
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
    return ModelConfig(
        architecture=arch,
        vocab_size=int(
            fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or ()) or 0
        ),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
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
        qk_norm=arch == "qwen3",
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_as_ids(eos),
        sliding_window=int(fields.get(f"{arch}.attention.sliding_window") or 0) or None,
    )


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse frequencies [head_dim/2], with Llama 3 scaling when configured (as transformers computes them)."""
    half = cfg.head_dim // 2
    inv = [1.0 / (cfg.rope_theta ** (2 * i / cfg.head_dim)) for i in range(half)]
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

"""Backend configuration: a frozen dataclass loaded from YAML in configs/; CLI flags override fields."""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None          # GGUF file, HF directory or Orbax checkpoint; None = embedded default
    dtype: str = "float32"            # float32 on CPU (bf16 runs ~10x slower on XLA:CPU); bfloat16 on TPU/GPU
    slots: int = 16                   # B: decode batch
    max_seq_len: int = 1024           # S: prompt + generated tokens per sample
    steps_per_call: int = 8           # N: fused decode steps per generate call
    min_prefill_bucket: int = 32
    prefill_chunk: int = 512
    min_attend_bucket: int = 128
    # null: decode always runs all slots (bit-exact batch invariance). A number (e.g. 8): decode runs on the
    # smallest power-of-two row bucket covering the live slots — lower latency at low load, but a request's
    # logprobs then vary in the last bits with the load (XLA sums matmuls differently for other row counts).
    min_batch_bucket: int | None = None
    processed_logprobs: bool = False  # raw logprobs (OpenAI's at temperature 0) unless set
    model_parallel: int = 1           # mesh "model" axis size (heads / MLP / KV heads)
    data_parallel: int = 1            # mesh "data" axis size (slots)
    max_queue: int = 256              # admission queue bound; beyond it RESOURCE_EXHAUSTED
    max_n: int = 16
    max_prompt_tokens: int | None = None  # prompts longer than this are INVALID_ARGUMENT; None = context length
    max_queue_wait: float | None = None   # seconds a request may wait for a slot, then RESOURCE_EXHAUSTED
    warm_up: bool = True


def load_config(path: str | pathlib.Path | None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """YAML file (keys = EngineConfig fields; unknown keys are an error) + overrides that are not None."""
    data: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(pathlib.Path(path).read_text()) or {}
        if isinstance(raw, dict):  # a file with `server:`/`gateway:` sections keeps the engine's under `engine:`
            raw = raw.get("engine", {} if {"server", "gateway"} & set(raw) else raw)
            raw = {} if raw is None else raw  # `engine:` with every key commented out
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of engine settings")
        data.update({k: v for k, v in raw.items() if v is not None})  # null: the default, as for flags
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{path or 'config'}: unknown setting(s) {', '.join(unknown)}")
    return EngineConfig(**data)

"""The engine's configuration: a frozen dataclass whose fields are the keys of the `engine:` section of a YAML
file in configs/ (or of a flat file of these keys). The command line (cli/settings.py) reads the file
and applies the flags on top; this layer reads no file."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (in the backend process); the YAML `engine:` keys are these fields."""

    model: str | None = None  # GGUF file, HF directory or Orbax checkpoint; None = embedded default
    dtype: str = "float32"  # float32 on CPU (bf16 runs ~10x slower on XLA:CPU); bfloat16 on TPU/GPU
    slots: int = 16  # B: decode batch
    max_seq_len: int = 1024  # S: prompt + generated tokens per sample
    steps_per_call: int = 8  # N: fused decode steps per generate call
    min_prefill_bucket: int = 32
    prefill_chunk: int = 512
    min_attend_bucket: int = 128
    # null: decode always runs all slots (bit-exact batch invariance). A number (e.g. 8): decode runs on the
    # smallest power-of-two row bucket covering the live slots — lower latency at low load, but a request's
    # logprobs then vary in the last bits with the load (XLA sums matmuls differently for other row counts).
    min_batch_bucket: int | None = None
    processed_logprobs: bool = False  # raw logprobs (OpenAI's at temperature 0) unless set
    model_parallel: int = 1  # mesh "model" axis size (heads / MLP / KV heads)
    data_parallel: int = 1  # mesh "data" axis size (slots)
    max_queue: int = 256  # admission queue bound; beyond it RESOURCE_EXHAUSTED
    max_n: int = 16
    max_prompt_tokens: int | None = None  # longer prompts are INVALID_ARGUMENT; None = the context length
    max_queue_wait: float | None = None  # seconds a request may wait for a slot, then RESOURCE_EXHAUSTED
    warm_up: bool = True

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
    # Weights in memory (tpuserve.model.quant): "none" (every weight in `dtype`), "keep" (a GGUF file's
    # Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices stay in their blocks, dequantized inside the programs: the same logprobs,
    # ~0.2x the bytes), "int8" (weight-only, per output channel) or "w8a8" (those int8 weights times int8
    # activations: integer products, the quantized computation's logprobs; never a default). null: the source's
    # default (model.loader: keep for a GGUF file, chosen by measurement; the checkpoint's own for Orbax; none for
    # safetensors).
    quantization: str | None = None
    slots: int = 64  # B: decode batch (64 users at once; one user decodes on the smallest batch bucket)
    max_seq_len: int | None = (
        None  # S: prompt + generated tokens per sample; null: the model's trained context
    )
    # The KV cache is one pool of pages shared by every slot: a sequence holds the pages its tokens fill, so
    # memory follows the tokens held, not slots x max_seq_len. Pages of 16 positions: the prefix cache shares
    # prompts page by page (a shared system prompt of 60 tokens shares 48), and a decode step's attention costs
    # the same with pages of 16, 32 or 64 (measured on XLA:CPU; docs/engine.md).
    kv_page_size: int = 16
    # The pool's size: kv_pages pages if set, else kv_cache_bytes, else a share of device memory (a sixteenth of
    # a CPU host's RAM; on an accelerator 80 % of what the weights leave), never more than every slot could fill
    # (and one prompt more).
    kv_pages: int | None = None
    kv_cache_bytes: int | None = None
    steps_per_call: int = 8  # N: fused decode steps per decode call on buckets of up to steps_per_call_rows
    # Buckets larger than steps_per_call_rows make fewer steps per call (rows x steps stays N x steps_per_call_rows;
    # 64 rows: 1 step), so a request arriving under load waits for a short call; this is the floor
    # (= steps_per_call: fixed N).
    min_steps_per_call: int = 1
    # The rows up to which a call makes N steps (an 8-row step costs little more than a 2-row one). null: the
    # smallest batch bucket.
    steps_per_call_rows: int | None = 8
    # a chunk is padded to a power of two >= this (the chunks of a prompt over 32 tokens, whose pages may be
    # shared, to >= 16 positions: sampler/buckets.py)
    min_prefill_bucket: int = 16
    # C: prompts are prefilled in chunks of at most C tokens; a running stream waits at most about one chunk of
    # someone else's prefill
    prefill_chunk: int = 128
    # prompt tokens (padded chunks) prefilled per engine turn while streams decode (null: one chunk): a running
    # stream waits for about this much of other requests' prefill between two decode calls
    prefill_budget: int | None = 256
    min_attend_bucket: int = 128
    # Decode runs on the smallest power-of-two row bucket (>= this, >= 2) covering the occupied slots; a
    # request's tokens and logprobs are bit-identical whatever the bucket (tests/sampler/test_batch_invariance.py).
    # One stream decodes faster on 2 rows than on 8. null: always all slots.
    min_batch_bucket: int | None = 2
    # The decoder's layer loop: a `lax.scan` over stacked weights (one compiled layer), or unrolled over per-layer
    # arrays. XLA:CPU copies a scanned weight slice, so unrolled decodes ~20 % faster there but compiles several
    # times longer; on an accelerator unrolled decodes up to ~2x faster (a Llama-3-8B-shaped model on one GPU) and
    # compiles ~2x longer. null: scanned on CPU, unrolled on GPU/TPU.
    scan_layers: bool | None = None
    # A decode step's attention: "pallas" reads the KV pool's pages in place with jax's Pallas TPU paged-attention
    # kernel (K and V rounded to bf16 inside it; off TPU it runs in jax's TPU interpreter: slow, for tests),
    # "gather" gathers each row's pages and attends in plain XLA. "auto": pallas on TPU, gather elsewhere.
    # Prompt chunks always gather (docs/engine.md).
    decode_attention: str = "auto"
    # Prefix cache: full prompt pages are named by their tokens (and cache_salt) and shared by reference; a prompt
    # that starts with pages an earlier one computed reads them instead of computing them. Pages nobody holds
    # stay cached until their room is needed (least recently let go first). Results are bit-identical with the
    # cache cold or warm (tests/sampler/test_prefix_cache.py).
    prefix_cache: bool = True
    processed_logprobs: bool = False  # raw logprobs (OpenAI's at temperature 0) unless set
    # Prompt positions attend as decode steps do, one position per row (model/llama.py `query_rows`), so a sampled
    # token's logprob and top-K equal bit for bit what a re-score (`echo`, prompt logprobs) or
    # tpuserve.model.scoring.score gives: what RL needs. Decode costs the same; a prefill chunk costs more, the more
    # the longer the attended length (XLA:CPU, embedded model: 1.2x for 16 positions over 128, 1.7x for 128 over
    # 256, 3.3x over 1024, 9.8x over 2048). Decode attention is then the gather on every backend.
    rescore_exact: bool = False
    model_parallel: int = 1  # mesh "model" axis size (heads / MLP / KV heads)
    data_parallel: int = 1  # mesh "data" axis size (slots)
    max_queue: int = 256  # admission queue bound; beyond it RESOURCE_EXHAUSTED
    max_n: int = 16
    max_prompt_tokens: int | None = None  # longer prompts are INVALID_ARGUMENT; None = the context length
    max_queue_wait: float | None = None  # seconds a request may wait for a slot, then RESOURCE_EXHAUSTED
    warm_up: bool = True
    # JAX's persistent compilation cache: null = $XDG_CACHE_HOME/tpuserve (~/.cache/tpuserve), "none" = off
    compilation_cache_dir: str | None = None

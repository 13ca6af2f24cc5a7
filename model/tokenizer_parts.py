"""What a tokenizer source says (a GGUF file's `tokenizer.ggml.*` metadata, a Hugging Face tokenizer directory),
before it becomes a `Tokenizer`. The readers (tokenizer_gguf.py, tokenizer_hf.py) return `TokenizerParts` and
tokenizer.py builds the `Tokenizer` from them, so the readers never import the class they feed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import processors


@dataclass(frozen=True)
class TokenizerParts:
    backend: tokenizers.Tokenizer
    token_bytes: list[bytes]  # every id's raw bytes, special tokens included
    eos_ids: Sequence[int]  # may repeat ids; the Tokenizer keeps each once, in order
    bos_id: int | None
    add_bos: bool  # whether `backend` prepends BOS when asked for special tokens
    chat_template: str | None
    template_tokens: Mapping[str, str | None]  # bos_token, eos_token, unk_token, pad_token
    source: str  # the file or directory, for error messages


def bos_eos_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor | None:
    """A post-processor that wraps encoded text in BOS and/or EOS ((text, id) pairs); None if neither."""
    if bos is None and eos is None:
        return None
    first = ([bos[0]] if bos else []) + ["$A:0"] + ([eos[0]] if eos else [])
    second = ([bos[0] + ":1"] if bos else []) + ["$B:1"] + ([eos[0] + ":1"] if eos else [])
    return processors.TemplateProcessing(
        single=" ".join(first), pair=" ".join(first + second), special_tokens=[t for t in (bos, eos) if t]
    )

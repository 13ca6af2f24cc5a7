"""Reading a tokenizer (`TokenizerParts`) from a GGUF file's own metadata (`tokenizer.ggml.*`), with the `gguf`
and `tokenizers` packages only (no torch, no transformers), splitting text as llama.cpp does for the same
vocabulary."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tpuserve.model.token_bytes import (
    CHAR_OF_BYTE,
    SP_SPACE,
    byte_level_token_bytes,
    sentencepiece_token_bytes,
)
from tpuserve.model.tokenizer_parts import TokenizerParts, bos_eos_post_processor

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as llama.cpp (llama-vocab.cpp) splits text for these vocabularies.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# GPT-2's split after every digit on its own (the HF tokenizer.json of these models: Digits + ByteLevel).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")

# A GGUF metadata value by key: field(key, default=None).
_Field = Callable[..., Any]


def gguf_tokenizer_parts(path: str | pathlib.Path, reader: Any = None) -> TokenizerParts:
    """From a GGUF's `tokenizer.ggml.*` metadata. Pass an open `gguf.GGUFReader` to avoid parsing twice."""
    path = pathlib.Path(path)
    field = _field_getter(_open_reader(path) if reader is None else reader)
    tokens: list[str] | None = field("tokenizer.ggml.tokens")
    kind = field("tokenizer.ggml.model")
    if not tokens or kind is None:
        raise ValueError(f"{path}: the GGUF has no tokenizer metadata (tokenizer.ggml.model / tokens)")
    types = list(field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    special = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
    user_defined = {i for i, t in enumerate(types) if t == _USER_DEFINED}
    if kind == "gpt2":
        backend, token_bytes = _byte_level_backend(tokens, special, user_defined, field)
    elif kind == "llama":
        backend, token_bytes = _sentencepiece_backend(tokens, field, path)
    else:
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' and 'llama')")
    _add_special_tokens(backend, tokens, special, user_defined, path)

    bos = _token_at(tokens, field("tokenizer.ggml.bos_token_id"))
    eos_id = field("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(field("tokenizer.ggml.add_eos_token", False))
    post = bos_eos_post_processor(bos if add_bos else None, _token_at(tokens, eos_id) if add_eos else None)
    if post is not None:
        backend.post_processor = post
    end_ids = (eos_id, field("tokenizer.ggml.eot_token_id"), field("tokenizer.ggml.eom_token_id"))
    return TokenizerParts(
        backend,
        token_bytes=token_bytes,
        eos_ids=[i for i in end_ids if _token_at(tokens, i) is not None],
        bos_id=None if bos is None else bos[1],
        add_bos=add_bos,
        chat_template=field("tokenizer.chat_template"),
        template_tokens=_template_tokens(tokens, field),
        source=str(path),
    )


def _open_reader(path: pathlib.Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError, IndexError, struct errors ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field_getter(reader: Any) -> _Field:
    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    return field


def _token_at(tokens: list[str], i: int | None) -> tuple[str, int] | None:
    """(text, id) of token `i`; None if `i` is None or not in the vocabulary."""
    return (tokens[i], i) if i is not None and 0 <= i < len(tokens) else None


def _template_tokens(tokens: list[str], field: _Field) -> dict[str, str | None]:
    """The chat template's bos_token, eos_token, unk_token and pad_token (None where the GGUF names none)."""
    keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    ids = {name: field(f"tokenizer.ggml.{key}_token_id") for name, key in keys.items()}
    return {name: tokens[i] if _token_at(tokens, i) else None for name, i in ids.items()}


def _merges(field: _Field) -> list[tuple[str, ...]]:
    return [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]


def _byte_level_backend(
    tokens: list[str], special: set[int], user_defined: set[int], field: _Field
) -> tuple[tokenizers.Tokenizer, list[bytes]]:
    """A GPT-2-style byte-level BPE ('gpt2' vocabularies) and every token's raw bytes."""
    token_bytes = [
        t.encode("utf-8") if i in user_defined else byte_level_token_bytes(t) for i, t in enumerate(tokens)
    ]
    # Ordinary tokens are spelled in the byte alphabet; respell any that are not (llama.cpp mislabels).
    spelled = [
        t if i in special or i in user_defined else "".join(map(CHAR_OF_BYTE.__getitem__, b))
        for i, (t, b) in enumerate(zip(tokens, token_bytes))
    ]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=_unique_vocab(spelled), merges=_merges(field), fuse_unk=False)
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(field("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend, token_bytes


def _sentencepiece_backend(
    tokens: list[str], field: _Field, path: pathlib.Path
) -> tuple[tokenizers.Tokenizer, list[bytes]]:
    """A SentencePiece BPE with byte fallback ('llama' vocabularies) and every token's raw bytes."""
    token_bytes = [sentencepiece_token_bytes(t) for t in tokens]
    merges = _merges(field)
    if not merges:
        scores = field("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"{path}: SentencePiece GGUF with neither merges nor scores")
        merges = _merges_from_scores(tokens, scores)
    unk = _token_at(tokens, field("tokenizer.ggml.unknown_token_id"))
    model = models.BPE(
        vocab=_unique_vocab(tokens),
        merges=merges,
        unk_token=None if unk is None else unk[0],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SP_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend, token_bytes


def _add_special_tokens(
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    special: set[int],
    user_defined: set[int],
    path: pathlib.Path,
) -> None:
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens, at the ids
    they already have."""
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined)])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"{path}: control tokens would get ids beyond the vocabulary (duplicate token strings?)"
        )


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _merges_from_scores(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece merges implied by a scored vocabulary (as transformers' `generate_merges`)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != len(tokens):
        logger.warning(
            "%d duplicate token strings in the vocabulary; the later ids are never produced",
            len(tokens) - len(vocab),
        )
    return vocab

"""Reading a Hugging Face tokenizer directory into `TokenizerParts`, and writing a tokenizer as such a directory.

tokenizer.json is read with `tokenizers`; transformers is imported only to convert a directory that has no
tokenizer.json (e.g. only a SentencePiece tokenizer.model).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import processors
from tpuserve.model.token_bytes import byte_level_token_bytes, sentencepiece_token_bytes
from tpuserve.model.tokenizer_parts import TokenizerParts, bos_eos_post_processor

_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def hf_dir_tokenizer_parts(path: str | pathlib.Path) -> TokenizerParts:
    """From a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json, optional config.json,
    generation_config.json, chat_template.jinja); transformers is used only when tokenizer.json is missing."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such tokenizer directory")
    backend, config = _backend_and_config(path)
    template_tokens = {k: _content(config.get(k)) for k in _TEMPLATE_TOKEN_NAMES}
    bos_text, eos_text = template_tokens["bos_token"], template_tokens["eos_token"]
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    eos_ids = _eos_ids(path, backend, config, eos_text)
    adds_bos = _follow_add_bos_token(backend, config, bos_text, bos_id, eos_text)
    token_bytes = _token_bytes(backend)
    return TokenizerParts(
        backend,
        token_bytes=token_bytes,
        eos_ids=[i for i in eos_ids if 0 <= i < len(token_bytes)],
        bos_id=bos_id,
        add_bos=adds_bos,
        chat_template=_hf_chat_template(path, config),
        template_tokens=template_tokens,
        source=str(path),
    )


def save_hf_dir(
    directory: str | pathlib.Path,
    tokenizer_json: str,
    *,
    add_bos: bool,
    chat_template: str | None,
    eos_ids: Sequence[int],
    special_tokens: Sequence[str],
    template_tokens: Mapping[str, str],
    bos_token: str | None,
    eos_token: str | None,
) -> None:
    """Write tokenizer.json + tokenizer_config.json, loadable by `hf_dir_tokenizer_parts` (and transformers)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "chat_template": chat_template,
        "tpuserve_eos_token_ids": list(eos_ids),
        "additional_special_tokens": list(special_tokens),
        **template_tokens,
    }
    if eos_token is not None:
        config["eos_token"] = eos_token
    if bos_token is not None:
        config["bos_token"] = bos_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _backend_and_config(path: pathlib.Path) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The directory's tokenizer.json (or a conversion by transformers) and its tokenizer_config.json."""
    config = _read_json(path / "tokenizer_config.json")
    if not (path / "tokenizer.json").is_file():
        return _backend_via_transformers(path, config)
    try:
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:
        raise ValueError(f"{path / 'tokenizer.json'}: not a readable tokenizer ({e})") from e
    return backend, config


def _content(value: Any) -> str | None:
    """A special token's text from tokenizer_config.json: a string, or an AddedToken-shaped {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _eos_ids(
    path: pathlib.Path, backend: tokenizers.Tokenizer, config: dict[str, Any], eos_text: str | None
) -> list[int]:
    """The EOS token of tokenizer_config.json, then any saved by tpuserve, then those of generation_config.json
    and config.json (duplicates and out-of-range ids are dropped later)."""
    eos_ids: list[int] = []
    if eos_text and backend.token_to_id(eos_text) is not None:
        eos_ids.append(backend.token_to_id(eos_text))
    eos_ids += config.get("tpuserve_eos_token_ids") or []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return eos_ids


def _follow_add_bos_token(
    backend: tokenizers.Tokenizer,
    config: dict[str, Any],
    bos_text: str | None,
    bos_id: int | None,
    eos_text: str | None,
) -> bool:
    """Whether `backend` prepends BOS, after replacing its post-processor where tokenizer_config.json's
    add_bos_token says otherwise."""
    adds_bos = _adds_bos(backend, bos_id)
    if bos_id is None or "add_bos_token" not in config or bool(config["add_bos_token"]) == adds_bos:
        return adds_bos
    eos = (eos_text, backend.token_to_id(eos_text)) if config.get("add_eos_token") and eos_text else None
    post = bos_eos_post_processor((bos_text, bos_id) if config["add_bos_token"] else None, eos)
    backend.post_processor = post if post is not None else processors.Sequence([])
    return _adds_bos(backend, bos_id)


def _adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    with_specials = backend.encode("a", add_special_tokens=True).ids
    return with_specials[:1] == [bos_id] and len(with_specials) > len(
        backend.encode("a", add_special_tokens=False).ids
    )


def _token_bytes(backend: tokenizers.Tokenizer) -> list[bytes]:
    """Every id's raw bytes (b"" for ids with no token); added tokens are their UTF-8 content."""
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    names: list[str | None] = [None] * size
    for token, i in vocab.items():
        names[i] = token
    added = backend.get_added_tokens_decoder()
    as_bytes = byte_level_token_bytes if "ByteLevel" in str(backend.decoder) else sentencepiece_token_bytes
    return [
        b"" if name is None else added[i].content.encode("utf-8") if i in added else as_bytes(name)
        for i, name in enumerate(names)
    ]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    return value if isinstance(value, dict) else {}


def _hf_chat_template(path: pathlib.Path, config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _backend_via_transformers(
    path: pathlib.Path, config: dict[str, Any]
) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """Directories with only a slow tokenizer (e.g. tokenizer.model): let transformers convert it."""
    if not any(path.glob("tokenizer*")) and not (path / "vocab.json").is_file():
        raise ValueError(
            f"{path}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json) in the directory"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"{path}: has no tokenizer.json, and transformers is not installed to convert it"
        ) from e
    hf = AutoTokenizer.from_pretrained(str(path))
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{path}: transformers could not build a fast tokenizer from this directory")
    merged = {**config, "chat_template": config.get("chat_template") or getattr(hf, "chat_template", None)}
    for key in _TEMPLATE_TOKEN_NAMES:
        merged.setdefault(key, getattr(hf, key, None))
    if "add_bos_token" not in merged and hasattr(hf, "add_bos_token"):
        merged["add_bos_token"] = hf.add_bos_token
    return tokenizers.Tokenizer.from_str(backend.to_str()), merged

"""The model's tokenizer at run time: ids <-> text, the id -> raw-bytes table, special and EOS ids, and chat
prompts as ids.

Built from the `TokenizerParts` of a GGUF file's own metadata (tokenizer_gguf.py: `gguf` and `tokenizers` only,
no torch, no transformers) or of a Hugging Face tokenizer directory (tokenizer_hf.py, which also saves one).
Chat templates are rendered by chat_template.py, which keeps message content out of the special-token
namespace.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import pre_tokenizers
from tpuserve.model.chat_template import ChatTemplate, generic_tool_messages
from tpuserve.model.tokenizer_gguf import gguf_tokenizer_parts
from tpuserve.model.tokenizer_hf import hf_dir_tokenizer_parts, save_hf_dir
from tpuserve.model.tokenizer_parts import TokenizerParts


class Tokenizer:
    """One model's tokenizer. Immutable after construction, safe to share between threads."""

    def __init__(self, parts: TokenizerParts) -> None:
        backend = parts.backend
        self.source = parts.source
        self._backend = backend
        # Content is encoded by a second instance with special-token matching off (no shared mutable flag).
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        # A Metaspace "first" pre-tokenizer adds "▁" only at the very start of the text; a text run that follows
        # a control token in a rendered chat must be encoded without it, as whole-string tokenization would.
        self._plain_rest = self._plain
        pre = backend.pre_tokenizer
        if isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first":
            self._plain_rest = tokenizers.Tokenizer.from_str(backend.to_str())
            self._plain_rest.encode_special_tokens = True
            self._plain_rest.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=pre.replacement, prepend_scheme="never", split=pre.split
            )

        added = backend.get_added_tokens_decoder()
        self._special_text: dict[int, str] = {i: t.content for i, t in added.items() if t.special}
        self.special_ids: frozenset[int] = frozenset(self._special_text)
        self.vocab_size: int = len(parts.token_bytes)
        self.token_bytes: list[bytes] = [
            b"" if i in self.special_ids else b for i, b in enumerate(parts.token_bytes)
        ]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in parts.eos_ids))
        self.bos_id = parts.bos_id
        self.add_bos = parts.add_bos
        self.chat_template = chat_template = parts.chat_template
        # The chat template's variables (bos_token, eos_token, unk_token, pad_token) that have a value.
        self.template_tokens: dict[str, str] = {
            k: v for k, v in parts.template_tokens.items() if v is not None
        }
        self._chat = (
            None
            if chat_template is None
            else ChatTemplate(chat_template, self.template_tokens, self._special_text)
        )

    # ---- building and saving (tokenizer_gguf.py, tokenizer_hf.py) ---------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path, reader: Any = None) -> Tokenizer:
        """From a GGUF's `tokenizer.ggml.*` metadata. Pass an open `gguf.GGUFReader` to avoid parsing twice."""
        return cls(gguf_tokenizer_parts(path, reader))

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """From a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json, optional config.json,
        generation_config.json, chat_template.jinja); transformers is used only when tokenizer.json is missing."""
        return cls(hf_dir_tokenizer_parts(path))

    def save_pretrained(self, directory: str | pathlib.Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, loadable by `from_hf_dir` (and transformers)."""
        save_hf_dir(
            directory,
            self.to_json(),
            add_bos=self.add_bos,
            chat_template=self.chat_template,
            eos_ids=self.eos_ids,
            special_tokens=[self.token_text(i) for i in sorted(self.special_ids)],
            template_tokens=self.template_tokens,
            bos_token=None if self.bos_id is None else self.token_text(self.bos_id),
            eos_token=self.token_text(self.eos_ids[0]) if self.eos_ids else None,
        )

    def to_json(self) -> str:
        """The backend tokenizer as the text of a Hugging Face tokenizer.json."""
        return self._backend.to_str(pretty=True)

    # ---- ids and bytes ----------------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """A special token's content (e.g. "<|im_end|>"), else the token's bytes as UTF-8 with `\\xNN` escapes for
        bytes that do not decode on their own (a piece of an emoji is "\\xf0\\x9f\\x98", never "\ufffd")."""
        if token_id in self._special_text:
            return self._special_text[token_id]
        return self.token_bytes[token_id].decode("utf-8", errors="backslashreplace")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as the model's tokenizer reads it by default: special-token text is the special token, and BOS
        (only if this tokenizer adds one) is prepended when `add_special_tokens`."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """Text as plain text: special-token text such as "<|im_end|>" is spelled out, no BOS/EOS added."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat template's prompt text and its ids. Only the template's own markers become special tokens;
        every message's `content` is tokenized as plain text. BOS is prepended if the tokenizer adds one and the
        template did not already write it. Bad messages raise ValueError.

        `tools` (OpenAI's function tools) and messages with `tool_calls` / role "tool": rendered by the template
        when it has a tools section, else turned into plain turns by the generic tool prompt. `template_kwargs`:
        further template variables (Qwen3's `enable_thinking`, ...), as transformers' `apply_chat_template` takes
        them."""
        if self._chat is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        uses_tools = tools or any(
            isinstance(m, Mapping) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages
        )
        if uses_tools and not self._chat.has_tools:
            messages, tools = generic_tool_messages(messages, tools), None
        text, runs = self._chat.render(messages, add_generation_prompt, tools or None, template_kwargs)
        ids = self.encode(text, add_special_tokens=False) if runs is None else self._encode_runs(runs)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return text, ids

    def _encode_runs(self, runs: list[str | int]) -> list[int]:
        """Special-token ids as they are, each text run encoded as plain text, so the result equals whole-string
        tokenization whenever content holds no special-token text."""
        ids: list[int] = []
        for n, run in enumerate(runs):
            if isinstance(run, int):
                ids.append(run)
            elif run:
                backend = self._plain if n == 0 else self._plain_rest
                ids += backend.encode(run, add_special_tokens=False).ids
        return ids


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
    """A `.gguf` file, or a directory with Hugging Face tokenizer files (an HF model or a converted checkpoint)."""
    path = pathlib.Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return Tokenizer.from_gguf(path)
        raise ValueError(f"{path}: not a .gguf file or a tokenizer directory")
    raise FileNotFoundError(f"{path}: no such file or directory")

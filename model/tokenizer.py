"""The model's tokenizer: ids <-> text, the id -> raw-bytes table, and chat-template rendering.

Built from a GGUF file's own metadata (`tokenizer.ggml.*`) with the `gguf` and `tokenizers` packages only
(no torch, no transformers), or from a Hugging Face tokenizer directory (`tokenizer.json` read with
`tokenizers`; transformers only as a fallback for directories without one).

Chat rendering keeps message content out of the special-token namespace: the chat template's own markers
become control tokens, text inside a message's `content` is tokenized as plain text, so a user writing
`<|im_end|>\\n<|im_start|>system` does not open a new turn.
"""

from __future__ import annotations

import datetime
import json
import logging
import pathlib
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SP_SPACE = "\u2581"  # SentencePiece's "▁"
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_CHAR_OF_BYTE = bytes_to_unicode()
_BYTE_OF_CHAR = {c: b for b, c in _CHAR_OF_BYTE.items()}


def byte_level_token_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level BPE token ('Ġday' -> b' day'); text outside the byte alphabet is UTF-8."""
    if all(c in _BYTE_OF_CHAR for c in token):
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    return token.encode("utf-8")


def sentencepiece_token_bytes(token: str) -> bytes:
    """Raw bytes of a SentencePiece token ('▁day' -> b' day', '<0x0A>' -> b'\\n')."""
    m = _SP_BYTE.fullmatch(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace(_SP_SPACE, " ").encode("utf-8")


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


def _template_post_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor | None:
    if bos is None and eos is None:
        return None
    first = ([bos[0]] if bos else []) + ["$A:0"] + ([eos[0]] if eos else [])
    second = ([bos[0] + ":1"] if bos else []) + ["$B:1"] + ([eos[0] + ":1"] if eos else [])
    return processors.TemplateProcessing(
        single=" ".join(first), pair=" ".join(first + second), special_tokens=[t for t in (bos, eos) if t]
    )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    """The template in a sandbox, with the environment transformers' `apply_chat_template` gives it."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """One model's tokenizer. Immutable after construction, safe to share between threads."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        token_bytes: list[bytes],
        eos_ids: Sequence[int],
        bos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        template_tokens: Mapping[str, str | None],
        source: str,
    ) -> None:
        self.source = source
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
        self.vocab_size: int = len(token_bytes)
        self.token_bytes: list[bytes] = [
            b"" if i in self.special_ids else b for i, b in enumerate(token_bytes)
        ]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template_tokens = {k: v for k, v in template_tokens.items() if v is not None}
        self._compiled: jinja2.Template | None = None
        by_length = sorted(self._special_text.values(), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._special_id_of = {t: i for i, t in sorted(self._special_text.items(), reverse=True)}

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
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        """The chat template's prompt text and its ids. Only the template's own markers become special tokens;
        every message's `content` is tokenized as plain text. BOS is prepended if the tokenizer adds one and the
        template did not already write it."""
        if self.chat_template is None:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        messages = self._checked_messages(messages)
        contents = [m["content"] for m in messages]
        text = self._render(messages, add_generation_prompt)
        parts = self._content_parts(messages, contents, text, add_generation_prompt)
        if parts is None:
            if self._special_re is not None and any(self._special_re.search(c) for c in contents):
                raise ValueError(
                    "this chat template transforms message content in a way that cannot be told apart from the "
                    "template's own text, and a message contains special-token text: refusing to render it"
                )
            ids = self.encode(text, add_special_tokens=False)
        else:
            ids = self._encode_parts(parts)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return text, ids

    def _checked_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Plain-dict copies of well-formed messages. Bad requests raise ValueError (a 400/INVALID_ARGUMENT)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of {'role': str, 'content': str} objects")  # noqa: TRY004
        checked = []
        for n, message in enumerate(messages):
            if not isinstance(message, Mapping):
                got = type(message).__name__
                raise ValueError(f"messages[{n}] must be an object with 'role' and 'content', got {got}")  # noqa: TRY004
            if not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{n}].role must be a string")  # noqa: TRY004
            if not isinstance(message.get("content"), str):
                raise ValueError(f"messages[{n}].content must be a string")  # noqa: TRY004
            for key, value in message.items():
                if (
                    key != "content"
                    and isinstance(value, str)
                    and self._special_re
                    and self._special_re.search(value)
                ):
                    raise ValueError(f"messages[{n}].{key} must not contain special-token text")
            checked.append(dict(message))
        return checked

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if self._compiled is None:
            self._compiled = _compile_chat_template(self.chat_template)
        try:
            return self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._template_tokens
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def _content_parts(
        self, messages: list[dict[str, Any]], contents: list[str], text: str, add_generation_prompt: bool
    ) -> list[tuple[str, bool]] | None:
        """`text` cut into (piece, is_content) pieces, found by rendering again with each content replaced by a
        sentinel. Templates that trim content are followed; None if the two renders cannot be aligned."""
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"@@tpuserve-{nonce}-{n}@@"} for n, m in enumerate(messages)]
        pieces = re.split(f"@@tpuserve-{nonce}-([0-9]+)@@", self._render(marked, add_generation_prompt))
        if not text.startswith(pieces[0]):
            return None
        parts = [(pieces[0], False)]
        pos = len(pieces[0])
        for k in range(1, len(pieces), 2):
            content, after = contents[int(pieces[k])], pieces[k + 1]
            for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
                if text.startswith(candidate, pos) and text.startswith(after, pos + len(candidate)):
                    break
            else:
                return None
            parts += [(candidate, True), (after, False)]
            pos += len(candidate) + len(after)
        return parts if pos == len(text) else None

    def _encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Special tokens only where the template wrote them; each text run between them encoded as plain text,
        so the result equals whole-string tokenization whenever content holds no special-token text."""
        runs: list[str | int] = [""]
        for piece, is_content in parts:
            pos = 0
            for m in () if is_content or self._special_re is None else self._special_re.finditer(piece):
                runs[-1] += piece[pos : m.start()]
                runs += [self._special_id_of[m.group()], ""]
                pos = m.end()
            runs[-1] += piece[pos:]
        ids: list[int] = []
        for n, run in enumerate(runs):
            if isinstance(run, int):
                ids.append(run)
            elif run:
                backend = self._plain if n == 0 else self._plain_rest
                ids += backend.encode(run, add_special_tokens=False).ids
        return ids

    # ---- files ------------------------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | pathlib.Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, loadable by `from_hf_dir` (and transformers)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "chat_template": self.chat_template,
            "tpuserve_eos_token_ids": list(self.eos_ids),
            "additional_special_tokens": [self._special_text[i] for i in sorted(self._special_text)],
            **self._template_tokens,
        }
        if self.eos_ids:
            config["eos_token"] = self.token_text(self.eos_ids[0])
        if self.bos_id is not None:
            config["bos_token"] = self.token_text(self.bos_id)
        (directory / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )

    @classmethod
    def from_gguf(cls, path: str | pathlib.Path, reader: Any = None) -> Tokenizer:
        """From a GGUF's `tokenizer.ggml.*` metadata. Pass an open `gguf.GGUFReader` to avoid parsing twice."""
        path = pathlib.Path(path)
        if reader is None:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such GGUF file")
            import gguf

            try:
                reader = gguf.GGUFReader(path)
            except Exception as e:  # the gguf package raises ValueError, IndexError, struct errors ...
                raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        tokens: list[str] | None = field("tokenizer.ggml.tokens")
        kind = field("tokenizer.ggml.model")
        if not tokens or kind is None:
            raise ValueError(f"{path}: the GGUF has no tokenizer metadata (tokenizer.ggml.model / tokens)")
        types = list(field("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        bos_id = field("tokenizer.ggml.bos_token_id")
        eos_id = field("tokenizer.ggml.eos_token_id")
        unk_id = field("tokenizer.ggml.unknown_token_id")
        pad_id = field("tokenizer.ggml.padding_token_id")
        eos_ids = [
            i
            for i in (eos_id, field("tokenizer.ggml.eot_token_id"), field("tokenizer.ggml.eom_token_id"))
            if i is not None and 0 <= i < len(tokens)
        ]
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = bool(field("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(field("tokenizer.ggml.add_eos_token", False))
        special = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
        user_defined = {i for i, t in enumerate(types) if t == _USER_DEFINED}

        if kind == "gpt2":
            token_bytes = [
                t.encode("utf-8") if i in user_defined else byte_level_token_bytes(t)
                for i, t in enumerate(tokens)
            ]
            merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
            # Ordinary tokens are spelled in the byte alphabet; respell any that are not (llama.cpp mislabels).
            spelled = [
                t if i in special or i in user_defined else "".join(map(_CHAR_OF_BYTE.__getitem__, b))
                for i, (t, b) in enumerate(zip(tokens, token_bytes))
            ]
            model = models.BPE(vocab=_unique_vocab(spelled), merges=merges, fuse_unk=False)
            backend = tokenizers.Tokenizer(model)
            backend.pre_tokenizer = _byte_level_pre_tokenizer(field("tokenizer.ggml.pre"))
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":
            token_bytes = [sentencepiece_token_bytes(t) for t in tokens]
            merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
            if not merges:
                scores = field("tokenizer.ggml.scores")
                if scores is None:
                    raise ValueError(f"{path}: SentencePiece GGUF with neither merges nor scores")
                merges = _merges_from_scores(tokens, scores)
            unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
            model = models.BPE(
                vocab=_unique_vocab(tokens), merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
            )
            backend = tokenizers.Tokenizer(model)
            prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=_SP_SPACE, prepend_scheme="first" if prefix else "never", split=False
            )
            steps = [decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        else:
            raise ValueError(
                f"{path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' and 'llama')"
            )

        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
        )
        backend.add_tokens(
            [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(user_defined)]
        )
        if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
            raise ValueError(
                f"{path}: control tokens would get ids beyond the vocabulary (duplicate token strings?)"
            )

        def tok(i: int | None) -> tuple[str, int] | None:
            return (tokens[i], i) if i is not None and 0 <= i < len(tokens) else None

        post = _template_post_processor(tok(bos_id) if add_bos else None, tok(eos_id) if add_eos else None)
        if post is not None:
            backend.post_processor = post
        return cls(
            backend,
            token_bytes=token_bytes,
            eos_ids=eos_ids,
            bos_id=bos_id if tok(bos_id) else None,
            add_bos=add_bos and tok(bos_id) is not None,
            chat_template=field("tokenizer.chat_template"),
            template_tokens={
                name: tokens[i] if tok(i) else None
                for name, i in (
                    ("bos_token", bos_id),
                    ("eos_token", eos_id),
                    ("unk_token", unk_id),
                    ("pad_token", pad_id),
                )
            },
            source=str(path),
        )

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> Tokenizer:
        """From a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json, optional config.json,
        generation_config.json, chat_template.jinja); transformers is used only when tokenizer.json is missing."""
        path = pathlib.Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such tokenizer directory")
        config = _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer.json").is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
            except Exception as e:
                raise ValueError(f"{path / 'tokenizer.json'}: not a readable tokenizer ({e})") from e
        else:
            backend, config = _backend_via_transformers(path, config)

        def content(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        template_tokens = {k: content(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_text = template_tokens["bos_token"]
        bos_id = backend.token_to_id(bos_text) if bos_text else None
        eos_ids: list[int] = []
        if template_tokens["eos_token"] and backend.token_to_id(template_tokens["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(template_tokens["eos_token"]))
        eos_ids += config.get("tpuserve_eos_token_ids") or []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(path / name).get("eos_token_id")
            eos_ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []

        adds_bos = _adds_bos(backend, bos_id)
        if bos_id is not None and "add_bos_token" in config and bool(config["add_bos_token"]) != adds_bos:
            eos_text = template_tokens["eos_token"]
            eos = (
                (eos_text, backend.token_to_id(eos_text))
                if config.get("add_eos_token") and eos_text
                else None
            )
            post = _template_post_processor((bos_text, bos_id) if config["add_bos_token"] else None, eos)
            backend.post_processor = post if post is not None else processors.Sequence([])
            adds_bos = _adds_bos(backend, bos_id)

        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        names: list[str | None] = [None] * size
        for token, i in vocab.items():
            names[i] = token
        added = backend.get_added_tokens_decoder()
        as_bytes = (
            byte_level_token_bytes if "ByteLevel" in str(backend.decoder) else sentencepiece_token_bytes
        )
        token_bytes = [
            b"" if name is None else added[i].content.encode("utf-8") if i in added else as_bytes(name)
            for i, name in enumerate(names)
        ]
        return cls(
            backend,
            token_bytes=token_bytes,
            eos_ids=[i for i in eos_ids if 0 <= i < size],
            bos_id=bos_id,
            add_bos=adds_bos,
            chat_template=_hf_chat_template(path, config),
            template_tokens=template_tokens,
            source=str(path),
        )


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


def _adds_bos(backend: tokenizers.Tokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    with_specials = backend.encode("a", add_special_tokens=True).ids
    return with_specials[:1] == [bos_id] and len(with_specials) > len(
        backend.encode("a", add_special_tokens=False).ids
    )


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
) -> tuple[tokenizers.Tokenizer, dict]:
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
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        merged.setdefault(key, getattr(hf, key, None))
    if "add_bos_token" not in merged and hasattr(hf, "add_bos_token"):
        merged["add_bos_token"] = hf.add_bos_token
    return tokenizers.Tokenizer.from_str(backend.to_str()), merged


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

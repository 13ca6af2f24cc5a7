"""Structured outputs: a request's `GuidedDecoding` -> an llguidance grammar -> per-sample token bitmasks.

llguidance (numpy token bitmasks) does the grammar work on the host; the engine applies each bitmask on the
device, inside the jitted step, to the logits it samples from (`Engine.constrain`). The host's part per token:
consume the sampled token, compute the next mask (well under a millisecond for JSON schemas here).

The tokenizer llguidance sees is the server's own byte table (`Tokenizer.token_bytes`): every token matches
exactly the bytes the detokenizer will emit; special tokens are named, never matched as text, and the model's
EOS ids are what a finished grammar allows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

# JSON is written compactly but readably ({"a": 1, "b": [2, 3]}): no free whitespace, so a small model cannot
# wander into endless newlines inside an object.
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GuidedError(ValueError):
    """A grammar the library cannot take; `field` names the request field (guided.json_schema, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: the byte table (special tokens as 0xFF + their text, the
    library's convention), EOS/BOS and a plain-text encoder."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        special_text: Callable[[int], str],
        special_ids: frozenset[int],
        eos_ids: Sequence[int],
        bos_id: int | None,
        encode_plain: Callable[[str], list[int]],
    ) -> None:
        self.tokens = [
            b"\xff" + special_text(i).encode() if i in special_ids else bytes(b)
            for i, b in enumerate(token_bytes)
        ]
        self.special_token_ids = sorted(special_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.eos_ids = list(eos_ids)
        self.bos_token_id = bos_id
        self._encode = encode_plain

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class Constraint:
    """One sample's grammar state: the mask for its next token, fed every token it makes."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, vocab_size: int) -> None:
        self._matcher = matcher
        self._mask = np.full((1, words), -1, np.int32)
        self._vocab = vocab_size

    def mask(self) -> np.ndarray:
        """int32[words]: bit t % 32 of word t // 32 set = token t allowed next."""
        llnp.fill_next_token_bitmask(self._matcher, self._mask, 0)
        return self._mask[0].copy()

    def consume(self, token_id: int) -> None:
        """Advance past a sampled token; a token the grammar refuses raises GuidedError (it was masked, so this
        means the library and the device disagree: the sample is failed, never left to run free)."""
        if not self._matcher.consume_token(token_id) or self._matcher.is_error():
            raise GuidedError("guided", f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete: only EOS is allowed from here (the sample ends on it, unless ignore_eos)."""
        return self._matcher.is_stopped()


class Grammars:
    """The server's llguidance tokenizer (built once, ~0.2 s) and the compiler of request grammars."""

    def __init__(self, vocabulary: _Vocabulary, vocab_size: int) -> None:
        """`vocab_size`: the model's (its logits' width; may exceed the tokenizer's table)."""
        eos = vocabulary.eos_ids or None  # every EOS id ends a finished grammar
        wrapper = llguidance.TokenizerWrapper(vocabulary)
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> Grammars:
        """From the server's `tpuserve.model.tokenizer.Tokenizer`."""
        vocabulary = _Vocabulary(tokenizer.token_bytes, tokenizer.token_text, tokenizer.special_ids,
                                 tokenizer.eos_ids, tokenizer.bos_id, tokenizer.encode_plain)  # fmt: skip
        return cls(vocabulary, vocab_size)

    def compile(self, guided: pb.GuidedDecoding) -> str:
        """The request's grammar (llguidance's serialized form), checked; GuidedError names the field."""
        kind = guided.WhichOneof("kind")
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(guided.json_schema)
                except ValueError as e:
                    raise GuidedError("guided.json_schema", f"not valid JSON: {e}") from None
                if not isinstance(schema, dict | bool):
                    raise GuidedError("guided.json_schema", "a JSON Schema is an object (or true/false)")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            elif kind == "json_object":
                if not guided.json_object:
                    raise GuidedError("guided.json_object", "must be true when set")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=JSON_OPTIONS
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(guided.regex)
            elif kind == "lark_grammar":
                grammar = llguidance.LLMatcher.grammar_from_lark(guided.lark_grammar)
            else:
                raise GuidedError("guided", "set one of json_schema, json_object, regex, lark_grammar")
        except GuidedError:
            raise
        except (ValueError, TypeError) as e:
            raise GuidedError(f"guided.{kind}", str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GuidedError(f"guided.{kind}", error.strip())
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():  # compile() checked it: only a resource limit could get here
            raise GuidedError("guided", matcher.get_error())
        return Constraint(matcher, self.words, self.vocab_size)

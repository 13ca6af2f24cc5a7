"""Backend tokens (raw bytes + logprobs) -> OpenAI logprob JSON, chat and legacy completions.

Token strings come from the raw bytes: a token that is not valid UTF-8 on its own is written with `\\xNN`
escapes for the bytes that do not decode (as OpenAI does); a special token is its display text. `bytes` are the
raw bytes, never re-encoded from text; a special token's `bytes` are null. -inf becomes -9999.0 and nothing non-finite reaches JSON.
"""

from __future__ import annotations

import math

from tpuserve.http_gateway.completion_objects import (
    ChoiceLogprobs,
    CompletionLogprobsOut,
    TokenLogprob,
    TopLogprob,
)
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

NEG_INF_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    """-inf (and anything non-finite, which should never come) as -9999.0."""
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


def token_text(token: pb.Token | pb.TopLogprob) -> str:
    if token.special and token.special_text:
        return token.special_text
    return token.token_bytes.decode("utf-8", errors="backslashreplace")


def token_bytes(token: pb.Token | pb.TopLogprob) -> list[int] | None:
    """The raw bytes; None for a special token (e.g. <|im_end|>), which has no bytes representation (the spec's
    null: an empty list would say "this token is the empty string")."""
    return None if token.special else list(token.token_bytes)


def token_logprob(token: pb.Token) -> float | None:
    return finite(token.logprob) if token.HasField("logprob") else None


def _descending(t: pb.TopLogprob) -> float:
    return -finite(t.logprob)


def _sorted_top(token: pb.Token, k: int) -> list[pb.TopLogprob]:
    """The k most likely alternatives, highest first (the backend sends them in this order; sorting an ordered
    list is one pass)."""
    return sorted(token.top_logprobs, key=_descending)[:k]


# ---- chat -----------------------------------------------------------------------------------------------


def chat_entry(token: pb.Token, top_k: int) -> TokenLogprob:
    """One `ChatCompletionTokenLogprob`: top_logprobs holds the k most likely alternatives ([] for k = 0)."""
    return TokenLogprob(
        token=token_text(token),
        bytes=token_bytes(token),
        logprob=finite(token.logprob),
        top_logprobs=[
            TopLogprob(token=token_text(t), bytes=token_bytes(t), logprob=finite(t.logprob))
            for t in _sorted_top(token, top_k)
        ],
    )


def chat_logprobs(tokens: list[pb.Token], top_k: int) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[chat_entry(t, top_k) for t in tokens], refusal=None)


# ---- legacy completions -----------------------------------------------------------------------------------


def _is_continuation(byte: int) -> bool:
    return 0x80 <= byte <= 0xBF


class CompletionLogprobs:
    """Accumulates the legacy `{tokens, token_logprobs, top_logprobs, text_offset}` of one choice.

    `text_offset` counts characters of the returned text. It advances by the characters that each token's
    bytes begin (UTF-8 lead bytes); a token whose first byte continues a character split across tokens gets
    that character's offset. Call `prompt` before adding the generated tokens: it sets where they start.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.chars = 0
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] | None = [] if k > 0 else None
        self.text_offset: list[int] = []

    def prompt(self, text: str, echoed: list[pb.Token] | None, raw: str | None) -> None:
        """The prompt's part: with `echo`, its `echoed` tokens take offsets from 0 (`raw`: the prompt as the
        request gave it as text, None for token ids; see `prompt_text_bytes`). Echoed or not, the generated
        tokens start at len(text), the prompt's characters (without echo, OpenAI's observed behaviour)."""
        if echoed is not None:
            for token, data in zip(echoed, prompt_text_bytes(echoed, raw), strict=True):
                self.add(token, data)
        self.chars = len(text)

    def add(self, token: pb.Token, text_bytes: bytes | None = None) -> None:
        """Append one token; `text_bytes` are the bytes it adds to the text (default: its raw bytes)."""
        data = token.token_bytes if text_bytes is None else text_bytes
        offset = self.chars - 1 if data and _is_continuation(data[0]) and self.chars > 0 else self.chars
        self.chars += sum(1 for b in data if not _is_continuation(b))
        text = token_text(token)
        logprob = token_logprob(token)
        top = self._top_dict(token, text, logprob)
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def _top_dict(self, token: pb.Token, text: str, logprob: float | None) -> dict[str, float] | None:
        """Top k alternatives plus the sampled token; equal token strings keep the higher logprob."""
        if self.k <= 0 or logprob is None:
            return None
        best: dict[str, float] = {}
        for t in _sorted_top(token, self.k):  # descending: the first of equal strings has the higher logprob
            best.setdefault(token_text(t), finite(t.logprob))
        if best.get(text, -math.inf) < logprob:
            best[text] = logprob
            return dict(sorted(best.items(), key=lambda kv: -kv[1]))
        return best  # already in descending order

    def out(self, start: int = 0) -> CompletionLogprobsOut:
        """The entries from token `start` on (a streamed chunk takes only its new tokens)."""
        return CompletionLogprobsOut(
            tokens=self.tokens[start:],
            token_logprobs=self.token_logprobs[start:],
            top_logprobs=None if self.top_logprobs is None else self.top_logprobs[start:],
            text_offset=self.text_offset[start:],
        )


def prompt_text_bytes(prompt_tokens: list[pb.Token], prompt: str | None) -> list[bytes]:
    """The bytes each prompt token adds to the echoed prompt text.

    Ordinary tokens add their raw bytes. A special token adds its display text where the request's prompt text
    has it at that point (`<|im_end|>` typed in the prompt), else nothing (a BOS the tokenizer added).
    For token-id prompts (`prompt` None) a special token adds its display text.
    """
    out: list[bytes] = []
    raw = prompt.encode() if prompt is not None else None
    pos = 0
    for t in prompt_tokens:
        if t.special:
            special = t.special_text.encode()
            if raw is None or raw.startswith(special, pos):
                out.append(special)
            else:
                out.append(b"")
        else:
            out.append(t.token_bytes)
        pos += len(out[-1])
    return out

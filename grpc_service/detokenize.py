"""Incremental detokenization of one sample: raw token bytes -> text deltas, with stop strings.

Text is released at token boundaries only, so that the bytes of the tokens released together decode to exactly
the text released with them (the gateway's streamed logprob entries then carry exactly their chunk's text):
- a token that ends inside a multi-byte character waits for the token that completes the character;
- text that could still grow into a stop string is held back, with its tokens.

A stop string ends the text before it (or after it with `include_stop_str`). The tokens kept are those that
began before the stop string (before its end with `include_stop_str`); a token that only completed the stop
string contributed no text and is dropped. Text that ends inside a multi-byte character (e.g. `max_tokens` cut
it) keeps its complete characters only, while the cut token is still released.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Delta(Generic[T]):
    """What one `add`/`flush` releases: tokens (the caller's items, in order) and their text."""

    items: list[T] = field(default_factory=list)
    text: str = ""
    stop: str | None = None  # the matched stop string: the sample is finished

    def __bool__(self) -> bool:
        return bool(self.items or self.text or self.stop is not None)


@dataclass
class _Pending(Generic[T]):
    item: T
    start: int  # absolute character offset where the token's first byte belongs
    end: int  # absolute characters decoded once the token was fed
    complete: bool  # no partial character pending after this token


class IncrementalDetokenizer(Generic[T]):
    """Feed one sample's tokens with `add`; call `flush` when the sample ends for any other reason."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        special_ids: Iterable[int] = (),
        stop: Sequence[str] = (),
        include_stop_str: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._special = frozenset(special_ids)
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""  # decoded characters not yet released
        self._base = 0  # absolute offset of self._text[0]
        self._pending: list[_Pending[T]] = []
        self.released_tokens = 0
        self.stopped: str | None = None

    def add(self, token_id: int, item: T, with_text: bool = True) -> Delta[T]:
        """Feed one generated token. `with_text=False` (a stop token id) releases the token without its text."""
        if self.stopped is not None:
            raise RuntimeError("the sample already ended at a stop string")
        start = self._base + len(self._text)
        if with_text and token_id not in self._special and 0 <= token_id < len(self._token_bytes):
            new = self._decoder.decode(self._token_bytes[token_id])
            self._text += new
        complete = not self._decoder.getstate()[0]
        self._pending.append(_Pending(item, start, self._base + len(self._text), complete))
        match = self._find_stop()
        if match is not None:
            return self._release_stop(*match)
        return self._release(self._safe_end())

    def flush(self) -> Delta[T]:
        """Release everything held: no stop string can match any more. A partial character is dropped."""
        if self.stopped is not None:
            return Delta()
        end = self._base + len(self._text)
        delta = Delta(items=[p.item for p in self._pending], text=self._text)
        self.released_tokens += len(self._pending)
        self._pending.clear()
        self._text = ""
        self._base = end
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        """Earliest stop string in the held text: (index in self._text, stop)."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = self._text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _safe_end(self) -> int:
        """Index in self._text before which no stop string can begin."""
        longest = max((len(s) for s in self._stops), default=0)
        for i in range(max(0, len(self._text) - longest + 1), len(self._text)):
            tail = self._text[i:]
            if any(s.startswith(tail) for s in self._stops):
                return i
        return len(self._text)

    def _release(self, safe: int) -> Delta[T]:
        """Release the longest run of held tokens that ends on a complete character at or before `safe`."""
        limit = self._base + safe
        count = 0
        for i, p in enumerate(self._pending):
            if p.end > limit:
                break
            if p.complete:
                count = i + 1
        if count == 0:
            return Delta()
        end = self._pending[count - 1].end
        cut = end - self._base
        delta = Delta(items=[p.item for p in self._pending[:count]], text=self._text[:cut])
        self.released_tokens += count
        del self._pending[:count]
        self._text = self._text[cut:]
        self._base = end
        return delta

    def _release_stop(self, index: int, stop: str) -> Delta[T]:
        cut = index + len(stop) if self._include_stop else index
        limit = self._base + cut
        kept = [p.item for p in self._pending if p.start < limit]
        self.released_tokens += len(kept)
        self.stopped = stop
        delta = Delta(items=kept, text=self._text[:cut], stop=stop)
        self._pending.clear()
        self._text = ""
        return delta

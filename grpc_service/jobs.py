"""What flows between the servicer and the engine thread: a validated job in, per-sample events out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from tpuserve.sampler.api import PromptLogprobs, SlotParams, TokenOut


class Finish(enum.Enum):
    EOS = "eos"
    STOP = "stop"  # a stop string or a stop token id
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class GenerationJob:
    """A validated request: one prefill of `prompt_ids`, then one slot per entry of `samples`."""

    request_id: str
    prompt_ids: tuple[int, ...]
    samples: tuple[SlotParams, ...]  # n entries; seeds differ (seed + i)
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # the request's own stop ids (finish STOP)
    eos_ids: frozenset[int] = frozenset()  # the tokenizer's EOS ids, empty with ignore_eos (finish EOS)
    prompt_logprobs: bool = False
    cache_salt: str | None = None  # the prefix cache's namespace (None: the shared default one)
    grammar: str | None = None  # structured outputs: a checked llguidance grammar every sample must follow
    return_prompt_token_ids: bool = False  # send prompt_ids on each sample's first message

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def max_tokens(self) -> int:
        return self.samples[0].max_tokens if self.samples else 0


@dataclass
class PromptEvent:
    """Sent once, right after the prefill, when prompt logprobs were asked."""

    logprobs: PromptLogprobs | None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class FirstTokenTiming(NamedTuple):
    """time.monotonic() stamps of a sample's first token: request submitted, admitted (its prefill starts),
    first token read back on the engine thread. The servicer adds the delivery time."""

    submitted: float
    admitted: float
    ready: float


@dataclass
class SampleEvent:
    """New tokens and text of one sample; `finish` is set on the sample's last event."""

    index: int
    tokens: list[TokenOut] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    stop_reason: str = ""
    stop_token_id: int | None = None
    completion_tokens: int = 0  # tokens released so far (all of them on the last event)
    cached_tokens: int = 0  # on the last event: prompt tokens whose KV came from the prefix cache
    error: str = ""
    timing: FirstTokenTiming | None = None  # on the event that carries the sample's first token

    def extend(self, later: SampleEvent) -> None:
        """Append a later event of the same sample: its tokens and text follow; its end, if any, is this one's."""
        self.tokens = self.tokens + later.tokens
        self.text += later.text
        self.finish, self.stop_reason = later.finish, later.stop_reason
        self.stop_token_id, self.error = later.stop_token_id, later.error
        self.completion_tokens, self.cached_tokens = later.completion_tokens, later.cached_tokens
        self.timing = self.timing or later.timing


@dataclass
class ErrorEvent:
    """The request failed as a whole (engine error, shutdown, dropped from the queue); no further events follow.

    `code`: the gRPC status name to end the call with."""

    message: str
    code: str = "INTERNAL"


Event = PromptEvent | SampleEvent | ErrorEvent


def merge_events(events: list[Event]) -> list[Event]:
    """One event per sample per delivery: a sample's consecutive events become one (its tokens in order), so
    one decode call of N steps costs one gRPC message per sample, not N. Order between samples is kept."""
    out: list[Event] = []
    open_: dict[int, SampleEvent] = {}  # sample index -> its merged event in `out`
    for event in events:
        if isinstance(event, SampleEvent):
            merged = open_.get(event.index)
            if merged is not None and merged.finish is None:
                merged.extend(event)
                continue
            open_[event.index] = event
        else:
            open_.clear()  # never merge across a prompt or error event
        out.append(event)
    return out

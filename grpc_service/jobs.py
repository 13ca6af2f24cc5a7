"""What flows between the servicer and the engine thread: a validated job in, per-sample events out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
    error: str = ""


@dataclass
class ErrorEvent:
    """The request failed as a whole (engine error, shutdown, dropped from the queue); no further events follow.

    `code`: the gRPC status name to end the call with."""

    message: str
    code: str = "INTERNAL"


Event = PromptEvent | SampleEvent | ErrorEvent

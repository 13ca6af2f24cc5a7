"""Backend `GenerateResponse` messages -> per-sample results; shared by the chat, completions and Responses API
renderers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tpuserve.http_gateway.backends import GenerateStream
from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.observability import on_message
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

_FINISH = {
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_UNSPECIFIED: "stop",
}


def finish_reason(msg: pb.GenerateResponse) -> str:
    return _FINISH.get(msg.finish_reason, "stop")


def check_message(msg: pb.GenerateResponse) -> pb.GenerateResponse:
    """A sample that finished with ERROR fails the request; one the backend CANCELLED (its shutdown drain
    ran out) is a 503, so that clients retry elsewhere instead of taking a cut text as complete."""
    if msg.finished and msg.finish_reason == pb.FINISH_REASON_CANCELLED:
        raise APIError(
            503,
            "The backend shut down before the request finished.",
            "server_error",
            None,
            "service_unavailable",
        )
    if msg.finished and msg.finish_reason == pb.FINISH_REASON_ERROR:
        raise APIError(
            500,
            msg.error_message or "The backend failed while generating.",
            "server_error",
            None,
            "backend_error",
        )
    return msg


@dataclass
class Sample:
    """Everything one sample produced."""

    index: int
    texts: list[str] = field(default_factory=list)
    tokens: list[pb.Token] = field(default_factory=list)
    final: pb.GenerateResponse | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass
class Generation:
    """All samples of one `Generate` call, plus the prompt's tokens when prompt logprobs were asked."""

    samples: dict[int, Sample]
    prompt_tokens: list[pb.Token]
    prompt_tokens_count: int
    cached_prompt_tokens_count: int = 0  # of those, the tokens the backend's prefix cache had


async def messages(stream: GenerateStream) -> AsyncIterator[pb.GenerateResponse]:
    async for msg in stream.messages():
        on_message(msg)  # token timing and counts for metrics and the request's log line
        yield check_message(msg)


async def collect(stream: GenerateStream, n: int) -> Generation:
    samples = {i: Sample(i) for i in range(n)}
    prompt_tokens: list[pb.Token] = []
    count = cached = 0
    async for msg in messages(stream):
        if msg.prompt_tokens:
            prompt_tokens = list(msg.prompt_tokens)
        sample = samples.setdefault(msg.index, Sample(msg.index))
        if msg.text:
            sample.texts.append(msg.text)
        sample.tokens.extend(msg.tokens)
        if msg.finished:
            sample.final = msg
            count = max(count, msg.prompt_tokens_count)
            cached = max(cached, msg.cached_prompt_tokens_count)
    missing = [s.index for s in samples.values() if s.final is None]
    if missing:
        raise APIError(
            502,
            f"The backend ended the stream before samples {missing} finished.",
            "server_error",
            None,
            "backend_error",
        )
    return Generation(samples, prompt_tokens, count, cached)

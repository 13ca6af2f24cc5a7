"""Request fields shared by the endpoints -> proto `SamplingParams` / `StoppingCriteria` / `cache_salt`, and
`PromptIdsTap`, which keeps the prompt's token ids (return_token_ids) from a backend stream as it is read."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tpuserve.http_gateway.backends import GenerateStream
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
UINT64_RANGE = 2**64  # the proto's `uint64 seed`


def proto_seed(seed: int) -> int:
    """The spec's int64 seed as the proto's uint64: two's complement, a bijection of -2**63..2**63-1 onto
    0..2**64-1 (-1 -> 2**64-1). The one place a request's seed is folded; the backend uses all 64 bits."""
    return seed % UINT64_RANGE


def sampling(temperature: float | None, top_p: float | None, seed: int | None) -> pb.SamplingParams:
    params = pb.SamplingParams(temperature=DEFAULT_TEMPERATURE if temperature is None else temperature)
    if top_p is not None:
        params.top_p = top_p
    if seed is not None:
        params.seed = proto_seed(seed)
    return params


def cache_salt(msg: pb.GenerateRequest, salt: str | None) -> pb.GenerateRequest:
    """Sets the request's prefix-cache namespace when one was given (absent: the default one)."""
    if salt is not None:
        msg.cache_salt = salt
    return msg


def stopping(max_tokens: int | None, stop: list[str]) -> pb.StoppingCriteria:
    criteria = pb.StoppingCriteria(stop=[s for s in stop if s])
    if max_tokens is not None:
        criteria.max_tokens = max_tokens
    return criteria


class PromptIdsTap:
    """A `GenerateStream` that notes `prompt_token_ids` (on each sample's first message when
    `return_prompt_token_ids` was asked) while its messages are read, for the renderers that collect a whole
    generation first."""

    def __init__(self, stream: GenerateStream) -> None:
        self._stream = stream
        self.ids: list[int] = []

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        inner = self._stream.messages()
        try:
            async for msg in inner:
                if msg.prompt_token_ids and not self.ids:
                    self.ids = list(msg.prompt_token_ids)
                yield msg
        finally:
            await inner.aclose()  # a consumer that stops early cancels the call, as the stream itself does

    def cancel(self) -> None:
        self._stream.cancel()

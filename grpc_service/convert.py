"""Engine outputs -> proto messages: tokens with raw bytes, logprobs and top-k trimmed to the request's k."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from tpuserve.grpc_service.jobs import Finish, SampleEvent
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.sampler.api import PromptLogprobs, TokenOut

if TYPE_CHECKING:
    from tpuserve.model.tokenizer import Tokenizer

FINISH_REASONS = {
    Finish.EOS: pb.FINISH_REASON_EOS,
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
    Finish.CANCELLED: pb.FINISH_REASON_CANCELLED,
    Finish.ERROR: pb.FINISH_REASON_ERROR,
}


class TokenConverter:
    """Builds `Token` messages for one request: logprobs when enabled, `top` alternatives per token."""

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, top: int) -> None:
        self._bytes = tokenizer.token_bytes
        self._special = tokenizer.special_ids
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._top = top

    def token(self, index: int, token_id: int) -> pb.Token:
        special = token_id in self._special
        return pb.Token(
            index=index,
            token_id=token_id,
            token_bytes=self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b"",
            special=special,
            special_text=self._tokenizer.token_text(token_id) if special else "",
        )

    def _alternatives(self, dest: Any, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """ids, logprobs: [K], sorted by logprob descending (the engine's contract: `TokenOut`, `PromptLogprobs`)
        -> the first `self._top`, added to `dest` (a token's top_logprobs). Host work per token under load (20
        alternatives each), so no re-sort, no numpy scalars and no message copies (`add` builds in place)."""
        vocab = len(self._bytes)
        for token_id, logprob in zip(ids[: self._top].tolist(), logprobs[: self._top].tolist(), strict=True):
            if not 0 <= token_id < vocab:
                continue
            if token_id in self._special:
                dest.add(token_id=token_id, token_bytes=self._bytes[token_id], logprob=logprob, special=True,
                         special_text=self._tokenizer.token_text(token_id))  # fmt: skip
            else:
                dest.add(token_id=token_id, token_bytes=self._bytes[token_id], logprob=logprob)

    def generated(self, index: int, out: TokenOut) -> pb.Token:
        token = self.token(index, out.token_id)
        if self._logprobs:
            token.logprob = out.logprob
            if self._top:
                self._alternatives(token.top_logprobs, out.top_ids, out.top_logprobs)
        return token

    def prompt(self, ids: tuple[int, ...], logprobs: PromptLogprobs | None) -> list[pb.Token]:
        """Prompt tokens; token 0 has no logprob, token j >= 1 takes entry j - 1."""
        tokens = [self.token(j, t) for j, t in enumerate(ids)]
        if logprobs is not None:
            for j, token in enumerate(tokens[1:], start=1):
                token.logprob = float(logprobs.logprobs[j - 1])
                if self._top:
                    self._alternatives(
                        token.top_logprobs, logprobs.top_ids[j - 1], logprobs.top_logprobs[j - 1]
                    )
        return tokens

    def response(
        self, request_id: str, event: SampleEvent, first_index: int, prompt_len: int
    ) -> pb.GenerateResponse:
        """One sample's event; `first_index` is the position of its first token in the sample."""
        response = pb.GenerateResponse(
            request_id=request_id,
            index=event.index,
            tokens=[self.generated(first_index + k, t) for k, t in enumerate(event.tokens)],
            text=event.text,
        )
        if event.finish is not None:
            response.finished = True
            response.finish_reason = FINISH_REASONS[event.finish]
            response.stop_reason = event.stop_reason
            if event.stop_token_id is not None:
                response.stop_token_id = event.stop_token_id
            response.prompt_tokens_count = prompt_len
            response.cached_prompt_tokens_count = event.cached_tokens
            response.completion_tokens_count = event.completion_tokens
            response.error_message = event.error
        return response

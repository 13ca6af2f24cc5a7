"""One sample's host-side bookkeeping: its tokens -> SampleEvents, and when the sample has finished."""

from __future__ import annotations

from collections.abc import Sequence

from tpuserve.grpc_service.detokenize import IncrementalDetokenizer
from tpuserve.grpc_service.jobs import Finish, GenerationJob, SampleEvent
from tpuserve.sampler.api import TokenOut


class SampleTracker:
    """Feeds one sample's generated tokens to its detokenizer and decides its finish reason.

    Finish, first match wins: a stop string in the text (STOP, stop_reason); an EOS id (EOS; the EOS token is
    released as the sample's last token); a stop token id (STOP, stop_token_id; released, its text is not);
    `max_tokens` reached or the engine marked the token done (LENGTH).
    """

    def __init__(
        self, job: GenerationJob, index: int, token_bytes: Sequence[bytes], special_ids: frozenset[int]
    ) -> None:
        self.job = job
        self.index = index
        self.max_tokens = job.samples[index].max_tokens
        self.generated = 0
        self.finished = False
        self.cached_tokens = 0  # set at insert: the prefix cache's share of the prompt, reported at the end
        self._detok: IncrementalDetokenizer[TokenOut] = IncrementalDetokenizer(
            token_bytes, special_ids, job.stop, job.include_stop_str
        )

    def add(self, token: TokenOut) -> SampleEvent | None:
        """One generated token; returns the event to send (None when nothing is released yet)."""
        if self.finished:
            return None
        self.generated += 1
        tid = token.token_id
        is_eos = tid in self.job.eos_ids
        is_stop_id = not is_eos and tid in self.job.stop_token_ids
        with_text = not (is_eos or is_stop_id) or self.job.include_stop_str
        delta = self._detok.add(tid, token, with_text=with_text)
        event = SampleEvent(self.index, tokens=delta.items, text=delta.text)
        if delta.stop is not None:
            event.finish, event.stop_reason = Finish.STOP, delta.stop
        elif is_eos:
            event.finish = Finish.EOS
        elif is_stop_id:
            event.finish, event.stop_token_id = Finish.STOP, tid
        elif token.done or self.generated >= self.max_tokens:
            event.finish = Finish.LENGTH
        if event.finish is not None:
            self._finish(event)
        elif not (event.tokens or event.text):
            return None
        event.completion_tokens = self._detok.released_tokens
        return event

    def end(self, finish: Finish, error: str = "") -> SampleEvent:
        """End the sample from outside (cancelled, engine error): release what is held."""
        event = SampleEvent(self.index, finish=finish, error=error)
        if finish is not Finish.ERROR:
            delta = self._detok.flush()
            event.tokens, event.text = delta.items, delta.text
        self.finished = True
        event.completion_tokens = self._detok.released_tokens
        event.cached_tokens = self.cached_tokens
        return event

    def _finish(self, event: SampleEvent) -> None:
        rest = self._detok.flush()
        event.tokens = event.tokens + rest.items
        event.text += rest.text
        event.cached_tokens = self.cached_tokens
        self.finished = True

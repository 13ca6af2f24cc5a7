"""Prompts of one context that arrive together compute the context once: the scheduler starts a prompt whose next
uncached pages a prefill in progress is computing after that prefill (`Engine.awaits_prefill`), so it reads them
from the prefix cache instead of computing them beside it. As an eval harness scores a question's choices: the
context and four continuations, echo-scored (prompt logprobs, no completion) and sampled, at once. The real engine
behind the real orchestrator; each request's results are bit-identical to the same request alone."""

from __future__ import annotations

import asyncio

import numpy as np
from tpuserve.grpc_service.jobs import GenerationJob, PromptEvent, SampleEvent
from tpuserve.grpc_service.orchestrator import Orchestrator
from tpuserve.sampler.api import SlotParams

CONTEXT = (
    "Question: A farmer has 17 sheep. All but 9 run away through a hole in the fence, and the farmer spends the "
    "afternoon mending it with wire from the barn, while the dog watches from the porch and the rain starts to "
    "fall on the tin roof of the shed. How many sheep does the farmer have left at the end of the day?\nAnswer:"
)
CHOICES = (" 9", " 8", " 17", " none of them")


def job(ids: list[int], salt: str, scored: bool) -> GenerationJob:
    """Echo-scored (prompt logprobs, no completion) or two greedy tokens after the prompt."""
    samples = (SlotParams(max_tokens=0 if scored else 2, temperature=0.0),)
    return GenerationJob("r", tuple(ids), samples, prompt_logprobs=scored, cache_salt=salt)


def run_together(engine, tokenizer, jobs: list[GenerationJob]) -> list[list]:
    """The jobs queued before the engine thread starts: its first turn finds them all waiting."""
    orch = Orchestrator(engine, tokenizer.token_bytes, tokenizer.special_ids)

    async def main() -> list[list]:
        streams = [orch.submit(j) for j in jobs]
        orch.start()

        async def events(stream) -> list:
            return [e async for e in stream.events()]

        return await asyncio.gather(*(events(s) for s in streams))

    try:
        return asyncio.run(main())
    finally:
        orch.close()


def outcome(events: list) -> tuple[int, tuple]:
    """(cached prompt tokens, the prompt logprobs or the sampled tokens with their logprobs)."""
    for e in events:
        if isinstance(e, PromptEvent):
            lp = e.logprobs
            return e.cached_tokens, (lp.logprobs.tobytes(), lp.top_ids.tobytes(), lp.top_logprobs.tobytes())
    (last,) = [e for e in events if isinstance(e, SampleEvent) and e.finish is not None]
    tokens = [t for e in events if isinstance(e, SampleEvent) for t in e.tokens]
    return last.cached_tokens, tuple((t.token_id, np.float32(t.logprob).tobytes()) for t in tokens)


def test_prompts_of_one_context_arriving_together_compute_it_once(engine, embedded):
    tok = embedded.tokenizer
    context = tok.encode(CONTEXT)
    prompts = [context + tok.encode(c) for c in CHOICES]
    page = engine.page
    shared = len(context) // page * page  # the context's full pages: the continuations differ after them
    assert len(context) > 64 and all(p[: len(context)] == context for p in prompts)

    for scored in (True, False):
        alone = [outcome(run_together(engine, tok, [job(p, f"alone-{scored}-{i}", scored)])[0])
                 for i, p in enumerate(prompts)]  # fmt: skip
        assert [cached for cached, _ in alone] == [0] * len(prompts)

        together = run_together(engine, tok, [job(p, f"together-{scored}", scored) for p in prompts])
        got = [outcome(events) for events in together]
        # the first computes the context; the others wait for it and read its pages
        assert [cached for cached, _ in got] == [0] + [shared] * (len(prompts) - 1)
        assert [result for _, result in got] == [result for _, result in alone]

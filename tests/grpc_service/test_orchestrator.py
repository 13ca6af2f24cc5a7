"""The engine thread, driven by the fake engine over a hand-made byte table (no gRPC)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tpuserve.grpc_service.admission import QueueFullError
from tpuserve.grpc_service.jobs import ErrorEvent, Finish, GenerationJob, PromptEvent, SampleEvent
from tpuserve.grpc_service.orchestrator import Orchestrator
from tpuserve.sampler.api import SlotParams

from tests.grpc_service.fake_engine import FakeEngine, token_logprob

EOS = 0
TABLE = [b"", b"a", b"b", b"c", b" ", b"\xe4\xb8", b"\x96", b"\n"]
VOCAB = len(TABLE)


def make(engine: FakeEngine, **kw) -> Orchestrator:
    kw.setdefault("prefill_budget", None)  # one chunk a turn while streams decode
    orch = Orchestrator(engine, TABLE, frozenset({EOS}), **kw)
    orch.start()
    return orch


def job(
    prompt=(1, 2), n=1, max_tokens=5, seed=0, stop=(), stop_ids=(), eos=True, plp=False, **kw
) -> GenerationJob:
    eos_ids = frozenset({EOS}) if eos else frozenset()
    stop_all = tuple(sorted(eos_ids | set(stop_ids)))
    samples = tuple(SlotParams(max_tokens=max_tokens, seed=seed + i, stop_ids=stop_all) for i in range(n))
    return GenerationJob(
        "r",
        tuple(prompt),
        samples,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        eos_ids=eos_ids,
        prompt_logprobs=plp,
        **kw,
    )


async def collect(orch: Orchestrator, j: GenerationJob) -> list:
    return [e async for e in orch.submit(j).events()]


def samples(events) -> dict[int, list[SampleEvent]]:
    out: dict[int, list[SampleEvent]] = {}
    for e in events:
        if isinstance(e, SampleEvent):
            out.setdefault(e.index, []).append(e)
    return out


def test_tokens_text_and_length_finish():
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3])
    orch = make(engine)
    try:
        events = asyncio.run(collect(orch, job(max_tokens=5)))
    finally:
        orch.close()
    s = samples(events)[0]
    tokens = [t for e in s for t in e.tokens]
    assert [t.token_id for t in tokens] == [1, 2, 3, 1, 2]
    assert [t.logprob for t in tokens] == [token_logprob(j) for j in range(5)]
    assert "".join(e.text for e in s) == "abcab"
    assert s[-1].finish is Finish.LENGTH and s[-1].completion_tokens == 5
    assert engine.releases == [0] and orch.free_slots == engine.slots


def test_n_samples_get_consecutive_seeds():
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3])
    orch = make(engine)
    try:
        events = asyncio.run(collect(orch, job(n=3, seed=7, max_tokens=3)))
    finally:
        orch.close()
    assert len(engine.prefills) == 1
    assert sorted(p.seed for _, p in engine.inserts) == [7, 8, 9]
    texts = {i: "".join(e.text for e in evs) for i, evs in samples(events).items()}
    assert texts == {0: "bca", 1: "cab", 2: "abc"}  # pool[(seed + j) % 3]
    assert sorted(engine.releases) == [0, 1, 2]


def test_eos_is_the_last_token_and_counted():
    engine = FakeEngine(VOCAB, EOS, script=lambda p, s: [1, 5, 6])
    orch = make(engine)
    try:
        s = samples(asyncio.run(collect(orch, job(max_tokens=50))))[0]
    finally:
        orch.close()
    assert [t.token_id for e in s for t in e.tokens] == [1, 5, 6, EOS]
    assert "".join(e.text for e in s) == "a\u4e16"
    assert s[-1].finish is Finish.EOS and s[-1].completion_tokens == 4


def test_ignore_eos_runs_to_length():
    engine = FakeEngine(VOCAB, EOS, script=lambda p, s: [1])
    orch = make(engine)
    try:
        s = samples(asyncio.run(collect(orch, job(max_tokens=4, eos=False))))[0]
    finally:
        orch.close()
    assert [t.token_id for e in s for t in e.tokens] == [1, EOS, EOS, EOS]
    assert s[-1].finish is Finish.LENGTH


def test_stop_string_and_stop_token_id():
    engine = FakeEngine(VOCAB, EOS, script=lambda p, s: [1, 2, 7, 3, 3, 3])
    orch = make(engine)
    try:
        by_string = samples(asyncio.run(collect(orch, job(max_tokens=50, stop=["b\nc"]))))[0]
        by_id = samples(asyncio.run(collect(orch, job(max_tokens=50, stop_ids=[7]))))[0]
    finally:
        orch.close()
    assert "".join(e.text for e in by_string) == "a"
    assert [t.token_id for e in by_string for t in e.tokens] == [1]
    assert by_string[-1].finish is Finish.STOP and by_string[-1].stop_reason == "b\nc"
    assert by_string[-1].completion_tokens == 1
    assert "".join(e.text for e in by_id) == "ab"  # the stop token's text is not part of the text
    assert [t.token_id for e in by_id for t in e.tokens] == [1, 2, 7]
    assert by_id[-1].finish is Finish.STOP and by_id[-1].stop_token_id == 7
    assert engine.active_slots == [] and orch.free_slots == engine.slots


def test_max_tokens_zero_scores_the_prompt_without_a_slot():
    engine = FakeEngine(VOCAB, EOS)
    orch = make(engine)
    try:
        events = asyncio.run(collect(orch, job(prompt=(1, 2, 3), max_tokens=0, plp=True)))
    finally:
        orch.close()
    assert isinstance(events[0], PromptEvent)
    assert events[0].logprobs.logprobs.tolist() == [-0.125, -0.25]
    assert events[0].logprobs.top_ids[:, 0].tolist() == [2, 3]
    (last,) = samples(events)[0]
    assert last.finish is Finish.LENGTH and last.tokens == [] and last.completion_tokens == 0
    assert engine.inserts == []


def test_requests_wait_for_free_slots():
    engine = FakeEngine(VOCAB, EOS, slots=2)
    orch = make(engine)

    async def main():
        return await asyncio.gather(
            *(collect(orch, job(n=2 if i % 2 else 1, max_tokens=9)) for i in range(5))
        )

    try:
        results = asyncio.run(main())
    finally:
        orch.close()
    for events in results:
        for evs in samples(events).values():
            assert evs[-1].finish is Finish.LENGTH and evs[-1].completion_tokens == 9
    assert len(engine.inserts) == 7 and sorted(set(engine.releases)) == [0, 1]


def test_cancel_releases_slots_before_the_next_generate():
    engine = FakeEngine(VOCAB, EOS, slots=4, delay_s=0.002)
    orch = make(engine)

    async def main():
        streams = [orch.submit(job(n=2, max_tokens=400)) for _ in range(2)]
        firsts = [await s.events().__anext__() for s in streams]
        for s in streams:
            orch.cancel(s)
        while len(engine.releases) < 4:  # the cancelled samples' slots are released
            await asyncio.sleep(0.005)
        return firsts, await collect(orch, job(max_tokens=3))

    try:
        firsts, after = asyncio.run(main())
    finally:
        orch.close()
    assert all(isinstance(e, SampleEvent) and e.finish is None for e in firsts)
    assert sorted(engine.releases[:4]) == [0, 1, 2, 3]
    assert samples(after)[0][-1].finish is Finish.LENGTH
    assert engine.active_slots == [] and orch.free_slots == 4


def test_queue_full():
    engine = FakeEngine(VOCAB, EOS, slots=1)
    engine.gate = threading.Event()
    orch = make(engine, max_queue=2)

    async def main():
        running = orch.submit(job(max_tokens=3))
        while orch.free_slots:  # the first request has taken the only slot
            await asyncio.sleep(0.01)
        queued = [orch.submit(job(max_tokens=3)) for _ in range(2)]
        with pytest.raises(QueueFullError, match="capacity"):
            orch.submit(job(max_tokens=3))
        engine.gate.set()
        return [[e async for e in s.events()] for s in [running, *queued]]

    try:
        results = asyncio.run(main())
    finally:
        orch.close()
    assert all(samples(r)[0][-1].finish is Finish.LENGTH for r in results)


def test_queued_requests_past_their_deadline_or_max_queue_wait_are_dropped_before_a_slot():
    """The engine thread ends waiting requests whose deadline passed (DEADLINE_EXCEEDED) or that waited longer
    than max_queue_wait (RESOURCE_EXHAUSTED), gives them no slot, and takes them out of the queue."""
    engine = FakeEngine(VOCAB, EOS, slots=1, delay_s=0.01)  # 4 tokens per 10 ms call
    drops: list[str] = []
    orch = make(engine, max_queue_wait_s=0.3)
    orch.on_drop = drops.append

    async def main():
        holder = orch.submit(job(max_tokens=400))  # ~1 s in the only slot
        first = await holder.events().__anext__()
        late = orch.submit(job(max_tokens=3), deadline=time.monotonic() + 0.1)
        patient = orch.submit(job(max_tokens=3))  # no deadline: max_queue_wait ends it
        dropped = [await s.events().__anext__() for s in (late, patient)]
        depth = orch.queued
        rest = [e async for e in holder.events()]
        after = await collect(orch, job(max_tokens=3))  # a free slot: served at once
        return first, dropped, depth, rest, after

    try:
        first, dropped, depth, rest, after = asyncio.run(main())
    finally:
        orch.close()
    assert isinstance(first, SampleEvent)
    assert [(type(e), e.code) for e in dropped] == [
        (ErrorEvent, "DEADLINE_EXCEEDED"),
        (ErrorEvent, "RESOURCE_EXHAUSTED"),
    ]
    assert "max_queue_wait = 0.3 s" in dropped[1].message
    assert drops == ["DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"]
    assert depth == 0  # both left the queue
    assert rest[-1].finish is Finish.LENGTH and samples(after)[0][-1].finish is Finish.LENGTH
    assert len(engine.inserts) == 2  # the holder and the last request only


def test_max_queue_wait_never_turns_away_a_request_that_finds_a_free_slot():
    """Slots free, but the engine busy in a call longer than max_queue_wait: the newcomer is admitted after it."""
    engine = FakeEngine(VOCAB, EOS, slots=4, delay_s=0.3)
    orch = make(engine, max_queue_wait_s=0.1)

    async def main():
        running = orch.submit(job(max_tokens=40))
        await running.events().__anext__()
        await asyncio.sleep(0.05)  # inside a 0.3 s decode call
        return await collect(orch, job(max_tokens=3))

    try:
        events = asyncio.run(main())
    finally:
        orch.close()
    assert not any(isinstance(e, ErrorEvent) for e in events), events
    assert samples(events)[0][-1].finish is Finish.LENGTH


def test_max_queue_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_queue_wait"):
        Orchestrator(FakeEngine(VOCAB, EOS), TABLE, frozenset({EOS}), max_queue_wait_s=0)


def test_engine_errors_fail_requests_and_serving_continues():
    engine = FakeEngine(VOCAB, EOS)
    engine.fail_prefill = lambda tokens: tokens[0] == 3
    orch = make(engine)
    try:
        bad = asyncio.run(collect(orch, job(prompt=(3,))))
        assert isinstance(bad[-1], ErrorEvent) and "prefill" in bad[-1].message
        engine.fail_decode = True
        failed = asyncio.run(collect(orch, job(n=2, max_tokens=20)))
        assert isinstance(failed[-1], ErrorEvent) and "decode" in failed[-1].message
        assert orch.free_slots == engine.slots
        engine.fail_decode = False
        ok = asyncio.run(collect(orch, job(max_tokens=2)))
    finally:
        orch.close()
    assert samples(ok)[0][-1].finish is Finish.LENGTH


def test_first_token_is_sent_before_the_first_decode_call_finishes():
    """The first token is sampled at insert and sent at once, not after a full N-step decode call."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3])
    engine.gate = threading.Event()  # holds every decode call's read-back
    orch = make(engine)

    async def main():
        stream = orch.submit(job(max_tokens=9))
        events = stream.events()
        first = await asyncio.wait_for(events.__anext__(), 5)
        calls_then = engine.decode_calls
        engine.gate.set()
        return first, calls_then, [e async for e in events]

    try:
        first, calls_then, _ = asyncio.run(main())
    finally:
        engine.gate.set()
        orch.close()
    assert [t.token_id for t in first.tokens] == [1] and first.timing is not None
    assert calls_then == 0  # no decode call had finished when the first token arrived
    assert first.timing.submitted <= first.timing.admitted <= first.timing.ready


def test_one_event_per_sample_per_decode_call():
    """A decode call of N steps gives each sample one event with its N tokens (one gRPC message), not N."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=4)
    orch = make(engine)
    try:
        events = asyncio.run(collect(orch, job(n=2, max_tokens=9)))
    finally:
        orch.close()
    for evs in samples(events).values():
        assert [len(e.tokens) for e in evs] == [1, 4, 4]  # insert, then two calls of 4 steps
        assert evs[-1].finish is Finish.LENGTH and evs[-1].completion_tokens == 9


def _spy_dispatches(engine: FakeEngine) -> list[int]:
    """Records, at each decode call's dispatch, how many calls had been read; logs "dispatch" in engine.log (the
    fake computes a call, logging "decode", when it is read)."""
    dispatched: list[int] = []
    start = engine.start_decode

    def spy(max_steps=None):
        dispatched.append(engine.decode_calls)
        engine.log.append("dispatch")
        return start(max_steps)

    engine.start_decode = spy
    return dispatched


def test_one_decode_call_stays_in_flight():
    """Call k+1 is dispatched before call k is read (host work overlaps the device)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2)
    dispatched = _spy_dispatches(engine)
    orch = make(engine)
    try:
        asyncio.run(collect(orch, job(max_tokens=11)))
    finally:
        orch.close()
    assert len(dispatched) >= 5
    assert dispatched[:3] == [0, 0, 1]  # the second call goes out before the first is read


def test_long_calls_are_read_in_their_turn_while_a_slot_is_free():
    """Calls longer than overlap_max_call_s, a slot free: after the first call is timed, each call is done before
    the next is dispatched; a request arriving during a call is prefilled right after it, with no call queued
    ahead of its prefill (XLA:CPU: a step or a call saved on the time to first token under load)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2, delay_s=0.03)
    dispatched = _spy_dispatches(engine)
    orch = make(engine, overlap_max_call_s=0.01)

    async def main():
        running = orch.submit(job(max_tokens=41))
        await running.events().__anext__()
        while engine.decode_calls < 3:  # a few calls, the first one timed
            await asyncio.sleep(0.005)
        late = await collect(orch, job(prompt=(3, 1), max_tokens=3))
        return late, await drain(running)

    try:
        late, rest = asyncio.run(main())
    finally:
        orch.close()
    assert samples(late)[0][-1].finish is Finish.LENGTH and rest[-1].finish is Finish.LENGTH
    assert dispatched[:2] == [0, 0]  # not timed yet: the second call goes out before the first is read
    assert dispatched[2:] == list(range(2, len(dispatched)))  # then each call is done before the next
    at = [i for i, what in enumerate(engine.log) if what == "prefill"][-1]  # the late request's prefill
    before = engine.log[:at]
    assert before.count("dispatch") == before.count("decode") > 2  # no call was waiting ahead of it


def test_calls_stay_in_flight_while_no_slot_is_free():
    """Long calls, but every slot taken: a newcomer could not start before the next call anyway, so the call
    stays in flight (host work overlaps the device)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], slots=1, steps_per_call=2, delay_s=0.02)
    dispatched = _spy_dispatches(engine)
    orch = make(engine, overlap_max_call_s=0.01)
    try:
        events = asyncio.run(collect(orch, job(max_tokens=11)))
    finally:
        orch.close()
    assert samples(events)[0][-1].completion_tokens == 11
    assert dispatched == [0, 0, 1, 2, 3]  # 1 + 5 calls of 2: each goes out before the one before is read
    assert engine.call_steps == [2] * 5  # the engine's own steps: nobody can arrive into a slot


def test_no_call_is_dispatched_after_a_sample_ends_on_its_stop_token():
    """One-step calls dispatched as soon as the one before is done, before its tokens are read: a sample whose
    call ended it on end-of-sequence gets no further call (a request arriving next would wait for it)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3, EOS], steps_per_call=1, step_delay_s=0.03)
    orch = make(engine, overlap_max_call_s=0.01)

    async def main():
        first = await collect(orch, job(max_tokens=40))  # times the calls (the first two overlap)
        calls = engine.decode_calls
        second = await collect(orch, job(max_tokens=40))
        return first, second, engine.decode_calls - calls

    try:
        first, second, calls = asyncio.run(main())
    finally:
        orch.close()
    for events in (first, second):
        assert samples(events)[0][-1].finish is Finish.EOS and samples(events)[0][-1].completion_tokens == 4
    assert calls == 3  # tokens 2, 3 and the end: none after it


def test_a_request_arriving_while_a_stream_decodes_waits_about_one_step_not_a_call():
    """Steps of 40 ms, 8 to a call: with a slot free, calls make one step once a call has been timed, so a request
    that arrives while a stream decodes is prefilled after the step on the device, not after 8 (320 ms)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=8, step_delay_s=0.04)
    orch = make(engine)

    async def main():
        running = orch.submit(job(max_tokens=400))
        await running.events().__anext__()
        while engine.decode_calls < 3:
            await asyncio.sleep(0.005)
        waits = []
        for i in range(4):
            await asyncio.sleep(0.013 * i)  # arriving at various points of a step
            sent = time.monotonic()
            stream = orch.submit(job(prompt=(3, 1), max_tokens=2))
            await stream.events().__anext__()  # the first token
            waits.append(time.monotonic() - sent)
            await drain(stream)
        orch.cancel(running)
        await drain(running)
        return waits

    try:
        waits = asyncio.run(main())
    finally:
        orch.close()
    assert engine.call_steps[:2] == [8, 8] and set(engine.call_steps[2:]) == {1}  # timed: one step a call
    assert max(waits) < 0.2, waits  # a step (40 ms) and the host's turn, never an 8-step call (320 ms)


def test_a_long_prompt_is_prefilled_between_decode_calls():
    """While a stream decodes, a prompt of 5 chunks is prefilled one chunk per decode call, not all at once."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2, prefill_chunk=4, delay_s=0.005)
    orch = make(engine)

    async def main():
        running = orch.submit(job(prompt=(1, 2), max_tokens=400))  # decodes for ~1 s, all through the test
        first = await running.events().__anext__()
        engine.log.clear()
        long = await collect(orch, job(prompt=tuple([1, 2, 3, 4] * 5), max_tokens=3))
        rest = [e async for e in running.events()]
        return first, long, rest

    try:
        _, long, _ = asyncio.run(main())
    finally:
        orch.close()
    steps = [i for i, what in enumerate(engine.log) if what == "prefill"]
    assert len(steps) == 5
    assert all(engine.log[i + 1] == "decode" for i in steps[:-1])  # a decode call after every chunk
    assert samples(long)[0][-1].finish is Finish.LENGTH


def test_a_short_prompt_overtakes_a_long_one_in_progress():
    """A one-chunk prompt that arrives while a prompt of 5 chunks is being prefilled (between decode calls) is
    prefilled before the long one's remaining chunks; both get their tokens."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2, prefill_chunk=4, delay_s=0.05)
    orch = make(engine)

    async def main():
        running = orch.submit(job(prompt=(1, 2), max_tokens=400))
        await running.events().__anext__()
        long = orch.submit(job(prompt=tuple([1, 2, 3, 4] * 5), max_tokens=3))
        while (
            engine.log.count("prefill") < 2
        ):  # the running stream's prefill, then the long one's first chunk
            await asyncio.sleep(0.005)
        short = orch.submit(job(prompt=(3, 3), max_tokens=3))
        results = [[e async for e in st.events()] for st in (long, short)]
        orch.cancel(running)
        return results

    try:
        long, short = asyncio.run(main())
    finally:
        orch.close()
    assert engine.prefills.index([3, 3]) < engine.prefills.index([1, 2, 3, 4] * 5)
    assert samples(long)[0][-1].finish is Finish.LENGTH and samples(short)[0][-1].finish is Finish.LENGTH


def test_short_prompts_waiting_together_are_prefilled_together():
    """Prompts taken in the same turn that are shorter than a chunk and want no prompt logprobs go to the engine
    in one `prefill_together` (in arrival order, with their salts); a prompt of a chunk or more, or one asking
    for prompt logprobs, is prefilled on its own and ends the group. Every request gets its tokens."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], slots=16, prefill_chunk=4, delay_s=0.3)
    orch = make(engine, prefill_budget=100)
    prompts = [(1, 2), (2, 3, 1), (1, 2, 3, 1), (3,), (1,), (2,), (3, 1)]  # (1, 2, 3, 1): a whole chunk
    jobs = [job(prompt=p, max_tokens=3, plp=(i == 4), cache_salt="s" if i == 1 else None)
            for i, p in enumerate(prompts)]  # fmt: skip

    async def main():
        running = orch.submit(job(prompt=(2, 2), max_tokens=400))
        await running.events().__anext__()  # decoding: each call takes 0.3 s; the others arrive during one
        streams = [orch.submit(j) for j in jobs]
        results = [[e async for e in st.events()] for st in streams]
        orch.cancel(running)
        return results

    try:
        results = asyncio.run(main())
    finally:
        orch.close()
    assert engine.together == [[[1, 2], [2, 3, 1]], [[2], [3, 1]]]
    assert engine.salts[engine.prefills.index([2, 3, 1])] == "s"
    assert sorted(map(tuple, engine.prefills)) == sorted([(2, 2), *prompts])  # each prompt prefilled once
    for events in results:
        last = samples(events)[0][-1]
        assert last.finish is Finish.LENGTH and last.completion_tokens == 3


def test_a_failed_prefill_together_fails_its_requests_only():
    """The engine raising in `prefill_together` fails the requests of that call, and serving goes on."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], slots=16, prefill_chunk=4, delay_s=0.3)
    engine.fail_prefill = lambda tokens: tokens == [3, 3]
    orch = make(engine, prefill_budget=100)

    async def main():
        running = orch.submit(job(prompt=(2, 2), max_tokens=400))
        await running.events().__anext__()
        streams = [orch.submit(job(prompt=p, max_tokens=3)) for p in ((1,), (3, 3), (2,))]
        results = [[e async for e in st.events()] for st in streams]
        later = await collect(orch, job(prompt=(1, 1), max_tokens=2))
        orch.cancel(running)
        return results, later

    try:
        results, later = asyncio.run(main())
    finally:
        orch.close()
    assert engine.together[0] == [[1], [3, 3], [2]]
    assert all(isinstance(events[-1], ErrorEvent) and "prefill" in events[-1].message for events in results)
    assert samples(later)[0][-1].finish is Finish.LENGTH
    assert orch.free_slots == engine.slots


def test_no_decode_call_nobody_needs():
    """When the call in flight already brings every sample to its max_tokens, no further call is dispatched (a
    request arriving next would otherwise wait for a call whose tokens nobody wants)."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=4)
    orch = make(engine)
    try:
        events = asyncio.run(collect(orch, job(max_tokens=9)))  # 1 at insert + 2 calls of 4
    finally:
        orch.close()
    assert samples(events)[0][-1].completion_tokens == 9
    assert engine.decode_calls == 2


# ---- prefix cache: the salt goes down, the cached count comes up, abandoned prefills are closed ----------------


def test_cache_salt_reaches_the_engine_and_cached_tokens_every_last_event():
    """The fake cache: the longest common prefix with an earlier prompt of the same salt, in blocks of 4, at most
    len - 1. Every sample's last event (and the prompt event) carries it; different salts never share."""
    engine = FakeEngine(VOCAB, EOS)
    orch = make(engine)
    prompt = (1, 2, 3, 4, 5, 6, 7, 1, 2, 3)  # 10 tokens: a warm repeat finds 2 blocks (8 <= 9)
    try:
        cold = asyncio.run(collect(orch, job(prompt=prompt, n=2, max_tokens=3, cache_salt="a")))
        warm = asyncio.run(collect(orch, job(prompt=prompt, n=2, max_tokens=3, cache_salt="a", plp=True)))
        partial = asyncio.run(collect(orch, job(prompt=(1, 2, 3, 4, 5, 7), max_tokens=3, cache_salt="a")))
        other_salt = asyncio.run(collect(orch, job(prompt=prompt, max_tokens=3, cache_salt="b")))
        no_salt = asyncio.run(collect(orch, job(prompt=prompt, max_tokens=3)))
        scored = asyncio.run(collect(orch, job(prompt=prompt, max_tokens=0, plp=True, cache_salt="b")))
    finally:
        orch.close()
    assert engine.salts == ["a", "a", "a", "b", None, "b"]

    def cached(events) -> dict[int, int]:
        return {i: evs[-1].cached_tokens for i, evs in samples(events).items()}

    assert cached(cold) == {0: 0, 1: 0}
    assert cached(warm) == {0: 8, 1: 8} and warm[0].cached_tokens == 8  # the PromptEvent too
    assert all(e.cached_tokens == 0 for evs in samples(warm).values() for e in evs[:-1])  # only the last
    assert cached(partial) == {0: 4}  # common prefix (1, 2, 3, 4, 5): one block
    assert cached(other_salt) == {0: 0} and cached(no_salt) == {0: 0}
    assert cached(scored) == {0: 8} and scored[0].cached_tokens == 8
    # the outputs are the same, cached or not
    assert [t.token_id for e in samples(cold)[0] for t in e.tokens] == [
        t.token_id for e in samples(warm)[0] for t in e.tokens
    ]
    assert engine.open_prefills == 0 and engine.abandoned == []  # every prefill iterator was closed


async def drain(stream, timeout: float = 10.0) -> list:
    """The rest of a stream's events; fails (instead of hanging) when it does not end in time."""

    async def rest() -> list:
        return [e async for e in stream.events()]

    return await asyncio.wait_for(rest(), timeout)


async def prefill_begun(engine: FakeEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.open_prefills == 0:
        assert time.monotonic() < deadline, "the prefill never began"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("max_tokens", [3, 0], ids=["sampling", "scoring"])
def test_cancel_mid_prefill_closes_the_prefill_iterator(max_tokens):
    """A request cancelled while its long prompt is prefilled chunk by chunk: its iterator is closed at once (the
    engine lets go of what it holds), its slot is free, and it never finishes the prefill."""
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2, prefill_chunk=4, delay_s=0.005)
    orch = make(engine)
    long_prompt = tuple([1, 2, 3, 4] * 100)  # 100 chunks, one per decode call while `running` decodes

    async def main():
        running = orch.submit(job(prompt=(1, 2), max_tokens=400))
        await running.events().__anext__()
        long = orch.submit(job(prompt=long_prompt, max_tokens=max_tokens, plp=max_tokens == 0))
        await prefill_begun(engine)
        orch.cancel(long)
        ended = await drain(long)
        closed_by_then = list(
            engine.abandoned
        )  # closed before its CANCELLED was delivered, not at collection
        orch.cancel(running)
        return ended, closed_by_then, await drain(running)

    try:
        ended, closed_by_then, _ = asyncio.run(main())
    finally:
        orch.close()
    assert closed_by_then == [list(long_prompt)]
    assert engine.abandoned == [list(long_prompt)] and engine.open_prefills == 0
    assert list(long_prompt) not in engine.prefills  # the prefill never finished
    assert samples(ended)[0][-1].finish is Finish.CANCELLED
    assert orch.free_slots == engine.slots and engine.active_slots == []


def test_an_engine_failure_closes_the_prefills_in_progress():
    engine = FakeEngine(VOCAB, EOS, pool=[1, 2, 3], steps_per_call=2, prefill_chunk=4, delay_s=0.005)
    orch = make(engine)
    long_prompt = tuple([1, 2, 3, 4] * 100)

    async def main():
        running = orch.submit(job(prompt=(1, 2), max_tokens=400))
        await running.events().__anext__()
        long = orch.submit(job(prompt=long_prompt, max_tokens=3))
        await prefill_begun(engine)
        engine.fail_decode = True  # the next decode call fails every request, the prefilling one too
        return await drain(long), await drain(running)

    try:
        long_events, running_events = asyncio.run(main())
    finally:
        orch.close()
    assert isinstance(long_events[-1], ErrorEvent) and isinstance(running_events[-1], ErrorEvent)
    assert engine.abandoned == [list(long_prompt)] and engine.open_prefills == 0
    assert orch.free_slots == engine.slots

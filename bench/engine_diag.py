"""DIAGNOSTIC rows: the engine driven in this process, without gRPC or HTTP, on the settings `tpuserve serve`
would use (the config's `engine:` section, or the defaults). Timed as the HTTP rows are: request in (prompt
text) -> last token out, tokenization, prefill and insert included. They locate a gap (engine vs serving
stack); they are never a headline, so they carry no target.

The engine's public interface only: `prefill`, `insert`, `decode` until every request is done, `release`.
Requests are sampled at temperature 1 with a seed each and no stop ids (they run to max_tokens, like HF's
min_new_tokens)."""

from __future__ import annotations

import time

from bench import workload
from bench.table import DIAGNOSTIC, Row


def _requests_s(engine, tokenizer, count: int, max_tokens: int) -> tuple[float, int]:
    """(seconds from the first prompt text in to the last token out, tokens made) for `count` requests
    inserted into slots 0..count-1, then decoded together."""
    from tpuserve.sampler.api import SlotParams

    start = time.perf_counter()
    done = [False] * count
    made = [0] * count
    for slot in range(count):
        ids = tokenizer.encode(workload.PROMPTS[slot % len(workload.PROMPTS)])
        params = SlotParams(max_tokens=max_tokens, temperature=1.0, seed=workload.SEED_BASE + slot)
        first = engine.insert(engine.prefill(ids), slot, params)
        made[slot], done[slot] = 1, first.done
    while not all(done):
        out = engine.decode()
        for slot in range(count):
            if done[slot]:
                continue
            made[slot] += int(out.valid[:, slot].sum())
            done[slot] = bool(out.done[:, slot].any())
    seconds = time.perf_counter() - start
    for slot in range(count):
        engine.release(slot)
    return seconds, sum(made)


def engine_rows(config: str | None, single_tokens: int, streams: int, many_tokens: int, hf_tok_s: float | None,
                reps: int) -> tuple[list[Row], dict]:  # fmt: skip
    """Load and warm the engine as the backend does, then 1 request x single_tokens and min(streams, slots)
    requests x many_tokens, `reps` times each (medians)."""
    import statistics

    from tpuserve.cli.backend import load_config
    from tpuserve.sampler.factory import load_engine

    engine, tokenizer, _ = load_engine(load_config(config))
    _requests_s(engine, tokenizer, 1, 2)  # the first call's host-side costs
    count = min(streams, engine.slots)
    one = [_requests_s(engine, tokenizer, 1, single_tokens) for _ in range(reps)]
    many = [_requests_s(engine, tokenizer, count, many_tokens) for _ in range(reps)]
    one_tok_s = statistics.median(t / s for s, t in one)
    many_tok_s = statistics.median(t / s for s, t in many)
    base = f"HF `generate` batch 1: {hf_tok_s:.1f} tok/s" if hf_tok_s else "—"
    ratio = (lambda x: x / hf_tok_s) if hf_tok_s else (lambda x: None)
    label = f"DIAGNOSTIC in-process engine (slots={engine.slots}, N={engine.steps_per_call})"
    rows = [
        Row("engine", f"{label}, 1 request × {single_tokens} tokens, request → last token",
            f"{one_tok_s:.1f} tok/s", base, ratio(one_tok_s), "", DIAGNOSTIC),
        Row("engine", f"{label}, {count} requests × {many_tokens} tokens, first request → last token",
            f"{many_tok_s:.1f} tok/s", base, ratio(many_tok_s), "", DIAGNOSTIC),
    ]  # fmt: skip
    raw = {"one": [{"s": s, "tokens": t} for s, t in one], "many": [{"s": s, "tokens": t} for s, t in many]}
    return rows, raw

"""The warm-up plan: every program the serving loop can call, compiled (or loaded from the compilation cache)
before the server says SERVING, so serving compiles nothing (tests/sampler/test_compile_cache.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np
from tpuserve.model.llama import pool_pages
from tpuserve.sampler import host_memory
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.programs import SWAP_PAGES

if TYPE_CHECKING:
    from tpuserve.sampler.engine import JaxEngine

Stage = tuple[str, Callable[[], None]]


def stages(engine: JaxEngine, prompt_logprobs: bool = True) -> list[Stage]:
    """What warm-up runs, stage by stage: the prefill programs per (chunk size, attended length) that a prompt can
    meet, with prompt logprobs; the programs that prefill short prompts together; a prompt twice (the prefix
    cache cold and warm) and its insert; moving pages to the host and back; decode per (attended-length, batch)
    bucket. Prefill and insert also run once, decode programs are only compiled."""
    e, p = engine, engine.programs
    params = SlotParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=5, seed=0)
    nowhere = e._place_replicated(
        np.zeros(e.max_pages, np.int32)
    )  # a table of null pages: nothing is written

    def chunk(size: int, attend: int) -> None:
        e.pool, hidden = p.chunk(e.params, e.pool, np.ones(size, np.int32), np.int32(0), nowhere, np.int32(0),
                                 attend_len=attend)  # fmt: skip
        p.last_logits(e.params, hidden, np.int32(0))
        if prompt_logprobs:
            p.chunk_logprobs(e.params, hidden, np.ones(size, np.int32))
        jax.block_until_ready(hidden)

    def together(rows: int, size: int) -> None:  # and an insert of such a prefix (its own cache shape)
        prefixes = e.prefill_together([[1] * size] * rows)  # size < C
        e.insert(prefixes[0], 0, params)
        e.release(0)

    def cache_and_insert() -> None:
        n = min(e.max_seq_len, 2 * e.prefill_chunk + 1)
        for want in (False, True) if prompt_logprobs else (False,):
            for _ in range(2):  # cold, then warm (when there is a cache)
                prefix = None  # let go of the last one's pages first (a small pool holds one prompt)
                prefix = e.prefill([1] * n, want_prompt_logprobs=want, cache_salt="\0warm-up")
                e.prompt_logprobs(prefix)
        e.insert(prefix, 0, params)
        e.release(0)
        e.pages.forget_cache()  # the warm-up's pages and counts

    def swap() -> None:  # pages to the host and back, and a page's copy: on the null page, changing nothing
        k, v = p.swap_out(e.pool, np.zeros(SWAP_PAGES, np.int32))
        e.pool = p.swap_in(
            e.pool, np.full(SWAP_PAGES, pool_pages(e.pool.k), np.int32), np.asarray(k), np.asarray(v)
        )
        e.pool = p.copy_page(e.pool, np.int32(0), np.int32(pool_pages(e.pool.k)))

    def decode(attend: int, batch: int) -> None:
        # compiled (or loaded from the cache), not run: a 64-row decode over 512 positions runs for seconds,
        # and the call later finds this executable (the same arguments' shapes and placement)
        steps = e.call_steps[batch]
        table = e._place_replicated(e.table.copy())
        paused = e._place_replicated(np.zeros(e.slots + 1, bool))
        rows = np.full(max(batch, e.invariant_rows), e.slots, np.int32)
        p.decode.lower(e.params, e.state, e.pool, table, paused, e._free_masks, rows, np.int32(steps),
                       attend_len=attend, batch=batch, steps=steps).compile()  # fmt: skip

    plan: list[Stage] = [
        (f"prefill chunk of {size} attending {attend}", functools.partial(chunk, size, attend))
        for size, attend in sorted(e.shapes.chunk_shapes())
    ]
    plan += [(f"prefill {rows} prompts of {size} together", functools.partial(together, rows, size))
             for rows, size in e.together_shapes()]  # fmt: skip
    # last of the prefill stages: it resets the prefix cache's counts
    plan.append(("prefix cache and insert", cache_and_insert))
    plan.append(("pages to the host and back", swap))
    plan += [(f"decode {a} positions x {b} rows x {e.call_steps[b]} steps", functools.partial(decode, a, b))
             for a in e.attend_buckets for b in e.batch_buckets]  # fmt: skip
    return plan


def run(
    engine: JaxEngine,
    prompt_logprobs: bool = True,
    progress: Callable[[int, int, str, float], None] | None = None,
) -> None:
    """Run every stage (`progress(k, n, stage, seconds)` after each); leaves all slots free."""
    plan = stages(engine, prompt_logprobs)
    for k, (name, stage) in enumerate(plan, start=1):
        start = time.perf_counter()
        stage()
        if progress is not None:
            progress(k, len(plan), name, time.perf_counter() - start)
    engine._forget_slots()
    host_memory.release_free_memory()  # what the compiles freed; serving buffers stay (host_memory)

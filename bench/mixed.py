"""Two row groups of `make bench` on requests that share a server, each against llama-server in the same
run, alternating (A, B, A, B, ...; medians), every prompt new to its server (a number of its own opens it):

  mixed          60 streams of short prompts (~20 tokens) and 4 of ~3,000-token prompts, all sent at once, 64
                 tokens each: requests refused or failed (target 0), and tok/s from the first request sent to
                 the last token vs llama-server (diagnostic). llama-server gives each of its 64 slots ctx / 64
                 tokens, too few for these prompts at the run's -c 64 x 384, so this row starts one of its own
                 with 4096 a slot (-c 262144: ~5.6 GiB of f16 KV for SmolLM2-135M, 23 KiB a token).
  shared_system  a fixed ~60-token system prompt and a new ~20-token user turn each request (streamed chat),
                 one at a time on an idle server, 2 warm-ups then 8 probes a round: median time to first text
                 vs llama-server (<= 1x), which reuses its slot's cache of the system prompt (`cache_prompt:
                 true`, its default, sent explicitly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import clients, servers, workload
from bench.prefix import _text
from bench.rows import CHAT, COMPLETIONS, Context, Side, _ok, _s, _short, _tok_s, alternate, log, median
from bench.table import DIAGNOSTIC, Row, Target, count_row, judged, not_run

MIXED_LLAMA = servers.LlamaSettings(ctx=64 * 4096)  # a slot: a ~3,000-token prompt + 64 tokens, and room
SYSTEM = (  # 64 tokens with the SmolLM2 tokenizer
    "You are Quill, the help desk assistant of the Northwind Public Library. Answer in plain English, politely "
    "and in at most three sentences. The library opens at nine and closes at six, Monday to Saturday. Never "
    "invent book titles or authors: when you are not sure, say so and suggest asking a librarian."
)


def _mixed_bodies(side: Side, p: workload.Plan, rep: int) -> list[dict[str, Any]]:
    """The long prompts first, so the short ones arrive behind their prefills (the hard case for a scheduler)."""
    long = [workload.completion(side.flavour, i, p.mixed_tokens, prompt=workload.unique(
            side.flavour.model, _text(f"mixed-{rep}-{i}", p.mixed_long_words) + "\nContinue the record:"))
            for i in range(p.mixed_long)]  # fmt: skip
    return long + workload.completions(side.flavour, p.mixed_short, p.mixed_tokens, first=rep * p.mixed_short)


def _mixed_llama(ctx: Context, pool: servers.Servers) -> Side | None:
    """llama-server with room for the long prompts: one of its own, or the one at --llama-url as it is."""
    if ctx.llama is None or not ctx.llama.server.argv:
        return ctx.llama
    argv = ctx.llama.server.argv  # the run's llama-server: its binary and GGUF
    server = servers.llama(ctx.llama.server.log_path.parent, argv[0], argv[argv.index("-m") + 1], MIXED_LLAMA)
    server.log_path = server.log_path.with_name("llama-mixed.log")
    log(f"llama-server with {MIXED_LLAMA.ctx // MIXED_LLAMA.slots} tokens a slot for the mixed load starting")
    pool.start(server).wait_ready(300)
    side = Side("llama-server", server, ctx.llama.flavour)
    warm = [(COMPLETIONS, workload.completion(side.flavour, 0, 2))]  # first-request costs, outside the rounds
    _ok(clients.run(lambda: clients.sequential(server.base_url, warm)), side)
    return side


def mixed(ctx: Context) -> list[Row]:
    p = ctx.plan
    n = p.mixed_short + p.mixed_long

    def step(side: Side) -> Callable[[int], clients.Batch]:
        def run(rep: int) -> clients.Batch:
            side.idle()
            bodies = _mixed_bodies(side, p, rep)
            return clients.run(lambda: clients.concurrent(side.server.base_url, COMPLETIONS, bodies))

        return run

    with servers.Servers() as pool:  # stops mixed's own llama-server
        llama = _mixed_llama(ctx, pool)
        sides = [ctx.tpu] + ([llama] if llama else [])
        log(f"mixed load, {n} streams x {p.mixed_tokens} tokens at once: {', '.join(s.name for s in sides)}")
        samples = alternate([step(s) for s in sides], p.reps)
    ctx.raw["mixed"] = {side.name: [{"tok_s": b.tok_s, "wall_s": b.wall, "tokens": b.tokens, "errors": b.errors}
                                    for b in s] for side, s in zip(sides, samples)}  # fmt: skip
    errors = [[e for b in s for e in b.errors] for s in samples]
    size = f"~{round(p.mixed_long_words * 1.13, -2):,.0f}-token"  # SmolLM2: 1.13 tokens a filler word
    name = f"mixed load: {p.mixed_short} short + {p.mixed_long} {size} prompts × {p.mixed_tokens} tokens"
    note = f"of {n * p.reps} requests over {p.reps} round(s)" + (
        f"; {errors[0][0][:200]}" if errors[0] else ""
    )
    base = f"llama-server: {len(errors[1])}" if llama else "no llama-server"
    rows = [count_row("mixed", f"{name}, requests refused or failed", len(errors[0]), base, note)]
    tok_s, wall = ([median([getattr(b, k) for b in s]) for s in samples] for k in ("tok_s", "wall"))
    measured, name = (
        f"{_tok_s(tok_s[0])} in {_s(wall[0])}",
        f"{name}, all at once → last token, vs llama-server",
    )
    if llama is None or any(errors):
        why = "no --llama-server" if llama is None else "not comparable: requests refused or failed (above)"
        return rows + [not_run("mixed", name, None, why, measured)]
    long_tokens = [r.prompt_tokens for r in samples[0][0].results[: p.mixed_long]]
    ttft = [_s(median([r.ttft or 0 for b in s for r in b.results[p.mixed_long :]])) for s in samples]
    note = f"long prompts {long_tokens} tokens; short streams' median TTFT {ttft[0]} (llama-server {ttft[1]})"
    early = max(sum(1 for r in b.results if r.tokens < p.mixed_tokens) for b in samples[0])
    if short := _short(min(b.tokens for b in samples[0]), n * p.mixed_tokens, early):
        note += f"; tpuserve: {short}"
    base = f"llama-server: {_tok_s(tok_s[1])} in {_s(wall[1])}"
    return rows + [Row("mixed", name, measured, base, tok_s[0] / tok_s[1], "", DIAGNOSTIC, note)]


def _system_chat(ctx: Context, side: Side, i: int) -> dict[str, Any]:
    body = workload.chat(side.flavour, i, ctx.plan.ttft_tokens)
    body["messages"].insert(0, {"role": "system", "content": SYSTEM})
    return body | ({"cache_prompt": True} if side is ctx.llama else {})


def shared_system(ctx: Context) -> list[Row]:
    p = ctx.plan
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])
    per_round = p.sys_warmups + p.sys_probes

    def step(side: Side) -> Callable[[int], list[clients.StreamResult]]:
        def run(rep: int) -> list[clients.StreamResult]:
            side.idle()
            reqs = [(CHAT, _system_chat(ctx, side, rep * per_round + i)) for i in range(per_round)]
            results = _ok(clients.run(lambda: clients.sequential(side.server.base_url, reqs)), side)
            if any(r.ttft is None for r in results):
                raise RuntimeError(f"{side.name}: a chat stream carried no text")
            return results[p.sys_warmups :]

        return run

    log(f"shared system prompt, {p.sys_warmups} warm-ups + {p.sys_probes} probes a round: "
        f"{', '.join(s.name for s in sides)}, {p.reps} rounds")  # fmt: skip
    samples = alternate([step(s) for s in sides], p.reps)
    ctx.raw["shared_system"] = {side.name: [[(r.ttft, r.prompt_tokens, r.cached_tokens) for r in rs]
                                            for rs in s] for side, s in zip(sides, samples)}  # fmt: skip
    ttft = [median([r.ttft for rs in s for r in rs]) for s in samples]
    last = [s[-1][-1] for s in samples]  # usage of each side's last probe
    cached = [f", {r.cached_tokens} cached" if r.cached_tokens is not None else "" for r in last]
    note = "; ".join(
        f"{side.name}: {r.prompt_tokens} prompt tokens{c}" for side, r, c in zip(sides, last, cached)
    )
    name = (
        "TTFT idle, streamed chat, a shared ~60-token system prompt + a new ~20-token turn, vs llama-server"
    )
    target = Target("<=", 1.0)
    if not ctx.llama:
        return [not_run("shared_system", name, target, "no --llama-server; " + note, _s(ttft[0]))]
    base = f"llama-server (slot cache): {_s(ttft[1])}"
    return [judged("shared_system", name, _s(ttft[0]), base, ttft[0] / ttft[1], target, note)]


GROUPS: dict[str, Callable[[Context], list[Row]]] = {"mixed": mixed, "shared_system": shared_system}

"""The row groups of `make bench` (`--only` takes their names). Each measures tpuserve over HTTP against a
baseline in the same run, alternating the two (A, B, A, B, ...: `plan.reps` pairs, medians), one server
loaded at a time: before each measurement the other has gone idle.

  single       one stream of 128 tokens: tok/s (tokens received / request sent -> last token) vs HF
               `generate` batch 1 (>= 3x) and vs llama-server (>= 0.5x)
  many         64 concurrent streams x 64 tokens, first request sent -> last token: tok/s vs llama-server (>= 1x)
  ttft         time to the first streamed text on an idle server, /v1/completions and /v1/chat/completions,
               vs llama-server (<= 3x)
  ttft_load    TTFT of a request sent while 63 streams of 256 tokens decode vs llama-server's (<= 1x)
  logprobs     32 streams with `logprobs: 20` vs without, on tpuserve: tok/s cost (<= 5 %)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench import clients, workload
from bench.servers import Server
from bench.table import Row, Target, judged, not_run
from bench.workload import Flavour, Plan

T = TypeVar("T")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Side:
    """A server under test and how to ask it."""

    name: str
    server: Server
    flavour: Flavour

    def idle(self) -> None:
        if not self.server.wait_idle():
            log(f"{self.name} still busy after 120 s; measuring anyway")


@dataclass
class Context:
    plan: Plan
    tpu: Side
    llama: Side | None  # None: the llama rows print "not run"
    hf: Any = None  # bench.hf.HFGenerate, loaded when `single` runs
    raw: dict[str, Any] = field(default_factory=dict)  # every sample, for --json
    hf_tok_s: float | None = None  # for the in-process diagnostics


def alternate(steps: list[Callable[[int], T]], reps: int) -> list[list[T]]:
    """Run steps[0](rep), steps[1](rep), ..., `reps` times over; samples per step."""
    out: list[list[T]] = [[] for _ in steps]
    for rep in range(reps):
        for step, samples in zip(steps, out):
            samples.append(step(rep))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def _ok(results: list[clients.StreamResult], side: Side) -> list[clients.StreamResult]:
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{side.name}: {len(errors)} of {len(results)} streams failed, e.g. {errors[0]}")
    return results


def _short(got: int, asked: int, streams: int) -> str:
    return (
        ""
        if got >= asked
        else f"{asked - got} of {asked} tokens not made: {streams} stream(s) ended early (EOS)"
    )


def _tok_s(x: float) -> str:
    return f"{x:.1f} tok/s"


def _s(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


# ---- single stream ------------------------------------------------------------------------------------------


def one_stream(side: Side, rep: int, n: int) -> tuple[float, int]:
    """One streamed completion of `n` tokens on an idle server, request sent -> last token: (tok/s, tokens short
    of n: an early EOS)."""
    side.idle()
    body = workload.completion(side.flavour, rep, n)
    (r,) = _ok(clients.run(lambda: clients.sequential(side.server.base_url, [(COMPLETIONS, body)])), side)
    if r.last_token is None:
        raise RuntimeError(f"{side.name}: the stream carried no token")
    return r.tokens / (r.last_token - r.sent), n - r.tokens


def single(ctx: Context) -> list[Row]:
    n, reps = ctx.plan.single_tokens, ctx.plan.reps
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])
    shorts: list[int] = []

    def http(side: Side) -> Callable[[int], float]:
        def step(rep: int) -> float:
            tok_s, short = one_stream(side, rep, n)
            if side is ctx.tpu:
                shorts.append(short)
            return tok_s

        return step

    def hf(rep: int) -> float:
        seconds, made = ctx.hf.generate(
            workload.unique("hf", workload.PROMPTS[rep % len(workload.PROMPTS)]), n, workload.SEED_BASE + rep
        )
        return made / seconds

    steps = [http(ctx.tpu)] + ([hf] if ctx.hf else []) + ([http(ctx.llama)] if ctx.llama else [])
    log(
        f"single stream x {n} tokens: {', '.join(s.name for s in sides)}{', HF' if ctx.hf else ''}, {reps} rounds"
    )
    samples = alternate(steps, reps)
    tpu = median(samples[0])
    hf_s = median(samples[1]) if ctx.hf else None
    llama = median(samples[-1]) if ctx.llama else None
    ctx.raw["single"] = {"tokens": n, "tpuserve_tok_s": samples[0], "tokens_short": shorts}
    ctx.raw["single"]["hf_tok_s"] = samples[1] if ctx.hf else None
    ctx.raw["single"]["llama_tok_s"] = samples[-1] if ctx.llama else None
    ctx.hf_tok_s = hf_s
    note = _short(n * reps - sum(shorts), n * reps, sum(1 for s in shorts if s))
    name = f"HTTP, 1 stream × {n} tokens, request → last token"
    rows = []
    t_hf = Target(">=", 3.0)
    if hf_s is None:
        rows.append(not_run("single", f"{name}, vs HF", t_hf, "--no-hf", _tok_s(tpu)))
    else:
        base = f"HF `generate` batch 1, torch {ctx.hf.threads} threads: {_tok_s(hf_s)}"
        rows.append(judged("single", f"{name}, vs HF", _tok_s(tpu), base, tpu / hf_s, t_hf, note))
    t_ll = Target(">=", 0.5)
    if llama is None:
        rows.append(not_run("single", f"{name}, vs llama-server", t_ll, "no --llama-server", _tok_s(tpu)))
    else:
        base = f"llama-server: {_tok_s(llama)}"
        rows.append(judged("single", f"{name}, vs llama-server", _tok_s(tpu), base, tpu / llama, t_ll, note))
    return rows


# ---- many concurrent streams -------------------------------------------------------------------------------


DECODE_SECONDS = "tpuserve_backend_generate_call_seconds_sum"


def _batch(side: Side, bodies: list[dict[str, Any]]) -> clients.Batch:
    side.idle()
    busy = side.server.metric(DECODE_SECONDS)  # None for llama-server (no such endpoint)
    batch = clients.run(lambda: clients.concurrent(side.server.base_url, COMPLETIONS, bodies))
    if busy is not None and (after := side.server.metric(DECODE_SECONDS)) is not None:
        batch.device_busy = (after - busy) / batch.wall  # decode calls' time over the wall time
    _ok(batch.results, side)
    return batch


def many(ctx: Context) -> list[Row]:
    p = ctx.plan
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])
    log(
        f"{p.many_streams} streams x {p.many_tokens} tokens: {', '.join(s.name for s in sides)}, {p.reps} rounds"
    )
    steps = [
        lambda rep, s=s: _batch(s, workload.completions(s.flavour, p.many_streams, p.many_tokens))
        for s in sides
    ]
    samples = alternate(steps, p.reps)
    tpu = median([b.tok_s for b in samples[0]])
    asked = p.many_streams * p.many_tokens
    got = min(b.tokens for b in samples[0])
    early = max(sum(1 for r in b.results if r.tokens < p.many_tokens) for b in samples[0])
    ctx.raw["many"] = {
        side.name: [{"tok_s": b.tok_s, "wall_s": b.wall, "tokens": b.tokens} for b in s]
        for side, s in zip(sides, samples)
    }
    name = f"HTTP, {p.many_streams} streams × {p.many_tokens} tokens, first request → last token, vs llama-server"
    target = Target(">=", 1.0, stretch=1.5)
    if not ctx.llama:
        return [not_run("many", name, target, "no --llama-server", _tok_s(tpu))]
    llama = median([b.tok_s for b in samples[1]])
    note = _short(got, asked, early)
    busy = [b.device_busy for b in samples[0] if b.device_busy is not None]
    if busy:
        note = (
            note + "; " if note else ""
        ) + f"tpuserve decode calls busy {100 * median(busy):.0f}% of the wall time"
    return [judged("many", name, _tok_s(tpu), f"llama-server: {_tok_s(llama)}", tpu / llama, target, note)]


# ---- time to first token -----------------------------------------------------------------------------------

TTFT_PARTS = ("queue_wait", "prefill", "delivery")


def _ttft_parts(side: Side) -> dict[str, float | None]:
    """The backend's cumulative TTFT histograms: the whole (gRPC received -> first token sent) and its parts."""
    names = {"total": "tpuserve_backend_time_to_first_token_seconds"}
    names |= {part: f"tpuserve_backend_ttft_{part}_seconds" for part in TTFT_PARTS}
    out: dict[str, float | None] = {}
    for key, metric in names.items():
        out[f"{key}_sum"] = side.server.metric(metric + "_sum")
        out[f"{key}_count"] = side.server.metric(metric + "_count")
    return out


def _ttft_breakdown(before: dict[str, float | None], after: dict[str, float | None]) -> Row | None:
    """Where an idle request's first token spends its time inside the backend (means over the idle probes);
    the rest of the HTTP TTFT is the gateway, gRPC and the client."""
    name = "TTFT idle inside the backend: queue wait + prefill/insert + delivery (diagnostic)"
    if any(v is None for v in (*before.values(), *after.values())):
        return None  # a server without the backend's metrics
    n = after["total_count"] - before["total_count"]
    mean = {k: (after[f"{k}_sum"] - before[f"{k}_sum"]) / max(n, 1) for k in ("total", *TTFT_PARTS)}
    parts = " + ".join(f"{1000 * mean[k]:.0f} ms {k.replace('_', ' ')}" for k in TTFT_PARTS)
    total = f"{1000 * mean['total']:.0f} ms"
    return Row("ttft", name, total, "—", None, "", "diagnostic", f"{n:.0f} requests: {parts}")


def ttft(ctx: Context) -> list[Row]:
    p = ctx.plan
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])

    def step(side: Side) -> Callable[[int], dict[str, list[float]]]:
        def run(rep: int) -> dict[str, list[float]]:
            side.idle()
            first = rep * p.ttft_probes
            reqs = []
            for i in range(first, first + p.ttft_probes):
                reqs += [(COMPLETIONS, workload.completion(side.flavour, i, p.ttft_tokens))]
                reqs += [(CHAT, workload.chat(side.flavour, i, p.ttft_tokens))]
            results = _ok(clients.run(lambda: clients.sequential(side.server.base_url, reqs)), side)
            out: dict[str, list[float]] = {COMPLETIONS: [], CHAT: []}
            for (path, _), r in zip(reqs, results):
                if r.ttft is None:
                    raise RuntimeError(f"{side.name}: a {path} stream carried no text")
                out[path].append(r.ttft)
            return out

        return run

    log(
        f"idle TTFT, {p.ttft_probes} x 2 endpoints per round: {', '.join(s.name for s in sides)}, {p.reps} rounds"
    )
    before = _ttft_parts(ctx.tpu)
    samples = alternate([step(s) for s in sides], p.reps)
    ctx.raw["ttft"] = {side.name: s for side, s in zip(sides, samples)}
    breakdown = _ttft_breakdown(before, _ttft_parts(ctx.tpu))
    rows = [breakdown] if breakdown is not None else []
    target = Target("<=", 3.0)
    for path, label in ((COMPLETIONS, "completions"), (CHAT, "chat")):
        values = [median([x for d in s for x in d[path]]) for s in samples]
        name = f"TTFT idle, streamed {path}, vs llama-server"
        if not ctx.llama:
            rows.append(not_run("ttft", name, target, "no --llama-server", _s(values[0])))
        else:
            base = f"llama-server: {_s(values[1])}"
            rows.append(judged("ttft", name, _s(values[0]), base, values[0] / values[1], target))
    return rows


def ttft_load(ctx: Context) -> list[Row]:
    p = ctx.plan
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])

    def step(side: Side) -> Callable[[int], tuple[float, int]]:
        def run(rep: int) -> tuple[float, int]:
            side.idle()
            load = workload.completions(side.flavour, p.load_streams, p.load_tokens)
            probe = workload.completion(side.flavour, p.load_streams + rep, p.ttft_tokens)
            coro = clients.under_load(
                side.server.base_url, COMPLETIONS, load, COMPLETIONS, [probe], p.load_settle_s
            )
            (r,), decoding = clients.run(lambda: coro)
            side.idle()  # the cancelled load streams leave
            if r.ttft is None:
                raise RuntimeError(f"{side.name}: the probe got no text ({r.error or r.finish_reason})")
            return r.ttft, decoding

        return run

    log(f"TTFT under {p.load_streams} streams x {p.load_tokens} tokens: {', '.join(s.name for s in sides)}")
    samples = alternate([step(s) for s in sides], p.reps)
    ctx.raw["ttft_load"] = {
        side.name: [{"ttft_s": t, "decoding": d} for t, d in s] for side, s in zip(sides, samples)
    }
    values = [median([t for t, _ in s]) for s in samples]
    decoding = [min(d for _, d in s) for s in samples]
    note = "; ".join(
        f"{side.name}: {d}/{p.load_streams} load streams had text when the probe was sent"
        for side, d in zip(sides, decoding)
    )
    name = f"TTFT of a request arriving while {p.load_streams} streams × {p.load_tokens} tokens decode, vs llama-server"
    target = Target("<=", 1.0)
    if not ctx.llama:
        return [not_run("ttft_load", name, target, "no --llama-server; " + note, _s(values[0]))]
    base = f"llama-server, same load: {_s(values[1])}"
    return [judged("ttft_load", name, _s(values[0]), base, values[0] / values[1], target, note)]


# ---- logprobs cost -----------------------------------------------------------------------------------------


def logprobs(ctx: Context) -> list[Row]:
    p = ctx.plan
    side = ctx.tpu

    def step(k: int | None) -> Callable[[int], clients.Batch]:
        extra = {} if k is None else {"logprobs": k}
        return lambda rep: _batch(
            side, workload.completions(side.flavour, p.lp_streams, p.lp_tokens, **extra)
        )

    log(
        f"logprobs {p.lp_k} vs off, {p.lp_streams} streams x {p.lp_tokens} tokens on tpuserve, {p.reps} rounds"
    )
    off_s, on_s = alternate([step(None), step(p.lp_k)], p.reps)
    missing = sum(r.tokens - r.logprob_entries for b in on_s for r in b.results)
    if missing:
        raise RuntimeError(f"logprobs on: {missing} tokens came without their logprob entry")
    off, on = median([b.tok_s for b in off_s]), median([b.tok_s for b in on_s])
    ctx.raw["logprobs"] = {"off_tok_s": [b.tok_s for b in off_s], "on_tok_s": [b.tok_s for b in on_s]}
    name = f"HTTP, {p.lp_streams} streams × {p.lp_tokens} tokens, `logprobs: {p.lp_k}` vs off: time cost"
    base = f"logprobs off: {_tok_s(off)}"
    return [judged("logprobs", name, f"{_tok_s(on)} with", base, off / on, Target("<=", 1.05))]


GROUPS: dict[str, Callable[[Context], list[Row]]] = {
    "single": single,
    "ttft": ttft,
    "many": many,
    "logprobs": logprobs,
    "ttft_load": ttft_load,
}

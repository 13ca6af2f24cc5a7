"""Row group `ttft_streams` of `make bench`: time to first token of a request that arrives while a few streams
decode (1, 4 and 16), against llama-server in the same run, alternating (A, B, A, B, ...; medians).

Each round starts the load streams (long completions), waits until every one has text, then sends probes one
after the other: each probe is a streamed completion of a new ~20-token prompt whose client reads the first
text and then closes the stream (as eval harnesses and impatient users do); the next probe follows at once, so
it also meets whatever the server still does for the one that left. The row's figure is the median probe TTFT
(request sent -> first text) over every round; target <= 2x llama-server's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bench import clients, workload
from bench.rows import COMPLETIONS, TTFT_PARTS, Context, Side, _s, _ttft_parts, alternate, log, median
from bench.table import Row, Target, judged, not_run


def ttft_streams(ctx: Context) -> list[Row]:
    p = ctx.plan
    sides = [ctx.tpu] + ([ctx.llama] if ctx.llama else [])
    out: list[Row] = []
    ctx.raw["ttft_streams"] = {}
    for streams in p.streams_counts:
        parts: dict[str, list] = {side.name: [] for side in sides}

        def step(
            side: Side, streams: int = streams, parts: dict = parts
        ) -> Callable[[int], tuple[list[float], int]]:
            def run(rep: int) -> tuple[list[float], int]:
                side.idle()
                first = 100 * (rep + 1)  # seeds of their own
                load = workload.completions(side.flavour, streams, p.streams_load_tokens, first=first)
                probes = workload.completions(side.flavour, p.streams_probes, p.ttft_tokens, first=first + 50)
                marks: list[dict[str, float | None]] = []

                async def settled() -> None:  # the backend's TTFT parts before the probes (tpuserve only)
                    if side.server.metrics_url:
                        marks.append(await asyncio.to_thread(_ttft_parts, side))

                results, decoding = clients.run(lambda: clients.under_load(
                    side.server.base_url, COMPLETIONS, load, COMPLETIONS, probes, p.load_settle_s, settled))  # fmt: skip
                if marks:
                    parts[side.name].append((marks[0], _ttft_parts(side)))
                side.idle()  # the closed load streams leave
                bad = [r for r in results if r.ttft is None]
                if bad:
                    raise RuntimeError(
                        f"{side.name}: a probe got no text ({bad[0].error or bad[0].finish_reason})"
                    )
                return [r.ttft for r in results], decoding

            return run

        log(f"TTFT while {streams} streams decode, {p.streams_probes} probes a round: "
            f"{', '.join(s.name for s in sides)}")  # fmt: skip
        samples = alternate([step(s) for s in sides], p.reps)
        ctx.raw["ttft_streams"][streams] = {
            side.name: [{"ttft_s": t, "decoding": d} for t, d in s] for side, s in zip(sides, samples)
        }
        values = [median([x for ts, _ in s for x in ts]) for s in samples]
        spread = [
            f"{side.name} {_s(min(x for ts, _ in s for x in ts))}-{_s(max(x for ts, _ in s for x in ts))}"
            for side, s in zip(sides, samples)
        ]
        decoding = [min(d for _, d in s) for s in samples]
        note = "; ".join(
            [
                f"{side.name}: {d}/{streams} streams had text at the first probe"
                for side, d in zip(sides, decoding)
            ]
            + ["range " + ", ".join(spread)]
            + [_inside(parts[ctx.tpu.name])]
        )
        name = f"TTFT of a request arriving while {streams} stream{'s' if streams > 1 else ''} decode, vs llama-server"
        target = Target("<=", 2.0)
        if not ctx.llama:
            out.append(not_run("ttft_streams", name, target, "no --llama-server; " + note, _s(values[0])))
            continue
        base = f"llama-server, same load: {_s(values[1])}"
        out.append(judged("ttft_streams", name, _s(values[0]), base, values[0] / values[1], target, note))
    return out


def _inside(marks: list[tuple[dict, dict]]) -> str:
    """The probes' mean time inside tpuserve's backend, by part (its TTFT histograms around the probes)."""
    sums = {k: 0.0 for k in ("total", *TTFT_PARTS)}
    n = 0.0
    for before, after in marks:
        if any(v is None for v in (*before.values(), *after.values())):
            return "tpuserve's backend metrics: not read"
        n += after["total_count"] - before["total_count"]
        for k in sums:
            sums[k] += after[f"{k}_sum"] - before[f"{k}_sum"]
    if not n:
        return "tpuserve's backend metrics: no probe counted"
    parts = " + ".join(f"{1000 * sums[k] / n:.0f} ms {k.replace('_', ' ')}" for k in TTFT_PARTS)
    return f"tpuserve inside the backend: {1000 * sums['total'] / n:.0f} ms = {parts}"


GROUPS = {"ttft_streams": ttft_streams}

"""The `quant` row group of `make bench`: two `tpuserve serve` processes on the same settings but for how the
embedded GGUF's weights are held, `quantization: keep` (its Q4_1/Q8_0 blocks, dequantized inside the programs)
and `none` (dequantized to fp32 at load), measured alternately (keep, none, keep, none, ...; medians). This is
the measurement that chooses the GGUF default (model/loader.py DEFAULT_GGUF_QUANTIZATION): keep becomes the
default if it is at least as fast at one stream or at 64 streams.

  quant_single  one stream, streamed /v1/completions, request in -> last token: tok/s keep over none (>= 1.0)
  quant_many    64 concurrent streams, wall time incl. prefill: tok/s keep over none (>= 1.0)
  quant_bytes   tpuserve_backend_weight_bytes, keep over none (<= 0.3)
The two servers' greedy logprobs must be identical (the GGUF is the model either way), else the rows fail.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from bench import clients, servers
from bench.rows import COMPLETIONS, alternate, log, median
from bench.table import FAILED, Row, Target, judged, not_run

MODES = ("keep", "none")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _bodies(model: str, streams: int, tokens: int, rep: int) -> list[dict[str, Any]]:
    return [{"model": model, "prompt": f"{PROMPT} (draft {rep}-{i})", "max_tokens": tokens, "temperature": 1.0,
             "seed": 1000 * rep + i} for i in range(streams)]  # fmt: skip


def _tok_s(base_url: str, bodies: list[dict[str, Any]]) -> float:
    batch = clients.run(lambda: clients.concurrent(base_url, COMPLETIONS, bodies))
    if batch.errors:
        raise RuntimeError(f"{len(batch.errors)} streams failed, e.g. {batch.errors[0]}")
    return batch.tok_s


def _greedy_logprobs(base_url: str, model: str) -> list[Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "logprobs": 5}

    async def go():
        async with clients.make_client(base_url, 1) as client:
            r = await client.post(COMPLETIONS, json=body)
            r.raise_for_status()
            return r.json()["choices"][0]["logprobs"]

    lp = clients.run(go)
    return [lp["tokens"], lp["token_logprobs"]]


def quant_rows(
    config: str | None, workdir: pathlib.Path, reps: int, quick: bool, raw: dict, external: bool
) -> list[Row]:
    names = ("quant_single", "quant_many", "quant_bytes")
    if external:
        return [
            not_run(n, n, Target(">=", 1.0), "needs servers this run starts (not --tpuserve-url)")
            for n in names
        ]
    single_tokens, streams, many_tokens = (16, 8, 8) if quick else (64, 64, 32)
    paths = servers.config_variants(workdir, config, "quantization", {m: {"quantization": m} for m in MODES})
    with servers.Servers() as pool:
        sides = {
            m: pool.start(servers.tpuserve(workdir, paths[m], name=f"tpuserve-quant-{m}")) for m in MODES
        }
        log(
            f"quantization keep/none servers starting (logs {sides['keep'].log_path}, {sides['none'].log_path})"
        )
        for server in sides.values():
            server.wait_ready(1200)
        _, text = clients.run(lambda: clients.get_text(sides["keep"].base_url, "/v1/models"))
        model = json.loads(text)["data"][0]["id"]
        same = _greedy_logprobs(sides["keep"].base_url, model) == _greedy_logprobs(
            sides["none"].base_url, model
        )

        def step(mode: str, count: int, tokens: int):
            def run(rep: int) -> float:
                sides[mode].wait_idle()
                log(f"quantization {mode}: {count} stream(s) x {tokens} tokens, repetition {rep + 1}")
                return _tok_s(sides[mode].base_url, _bodies(model, count, tokens, rep))

            return run

        def row(key: str, title: str, count: int, tokens: int) -> Row:
            samples = alternate([step(m, count, tokens) for m in MODES], reps)
            raw[key] = dict(zip(MODES, samples, strict=True))
            keep, none = (median(s) for s in samples)
            r = judged(key, title, f"keep: {keep:.1f} tok/s", f"none: {none:.1f} tok/s", keep / none,
                       Target(">=", 1.0))  # fmt: skip
            if not same:
                r = Row(key, title, r.measured, r.baseline, r.ratio, r.target, FAILED,
                        "greedy logprobs differ between keep and none")  # fmt: skip
            return r

        rows = [
            row("quant_single", f"GGUF blocks kept vs dequantized at load: 1 stream x {single_tokens} tokens, tok/s",
                1, single_tokens),
            row("quant_many", f"GGUF blocks kept vs dequantized at load: {streams} streams x {many_tokens} tokens, "
                "tok/s (wall, prefill incl.)", streams, many_tokens),
        ]  # fmt: skip
        kept, dense = (sides[m].metric("tpuserve_backend_weight_bytes") for m in MODES)
        if kept and dense:
            rows.append(judged("quant_bytes", "weight bytes in memory, keep vs none (tpuserve_backend_weight_bytes)",
                               f"{kept / 2**20:.1f} MiB", f"{dense / 2**20:.1f} MiB", kept / dense,
                               Target("<=", 0.3)))  # fmt: skip
        else:
            rows.append(not_run("quant_bytes", "weight bytes keep vs none", Target("<=", 0.3), "no metrics"))
    return rows

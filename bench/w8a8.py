"""The `w8a8` row group of `make bench`: `tpuserve serve --quantization w8a8` (int8 weights per output channel x
int8 activations per row, integer products: docs/engine.md "W8A8") against the exact default on the same model
(the embedded GGUF with its blocks kept, `quantization: keep`; `none` for a config whose model is not a GGUF)
and against llama.cpp's llama-server on the same GGUF. The three servers are started together and measured one
at a time, the others idle, alternating (w8a8, exact, llama-server, w8a8, ...; medians of `reps` rounds):

  one stream    streamed /v1/completions, request sent -> last token (prefill included), tok/s
  64 streams    64 concurrent streams x 64 tokens, first request sent -> last token (wall, prefill included)

Rows: w8a8 vs llama-server at one stream (>= 0.5x) and at 64 streams (>= 1.5x); w8a8 vs the exact default at
one stream and at 64 streams (>= 1x: the integer products are meant to be faster, not only smaller). Without
`--llama-server` (or `--llama-url`) the llama-server rows print "not run"; with `--tpuserve-url` every row does
(the group needs two tpuserve servers of its own). The requests are bench/workload.py's (a new prompt each,
temperature 1, seeded); tpuserve's streams may end early at EOS, which the notes report.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import yaml

from bench import clients, servers, workload
from bench.rows import (
    CHAT,
    COMPLETIONS,
    Side,
    _batch,
    _short,
    _tok_s,
    alternate,
    log,
    median,
    one_stream,
)
from bench.table import Row, Target, judged, not_run
from bench.workload import Plan

W8A8, EXACT, LLAMA = "w8a8", "exact", "llama-server"
T_SINGLE_LLAMA, T_MANY_LLAMA, T_EXACT = Target(">=", 0.5), Target(">=", 1.5), Target(">=", 1.0)


def row_names(plan: Plan) -> dict[str, str]:
    one = f"w8a8, HTTP, 1 stream × {plan.single_tokens} tokens, request → last token"
    many = f"w8a8, HTTP, {plan.many_streams} streams × {plan.many_tokens} tokens, first request → last token"
    return {
        "single_llama": f"{one}, vs llama-server",
        "many_llama": f"{many}, vs llama-server",
        "single_exact": f"{one}, vs the exact default",
        "many_exact": f"{many}, vs the exact default",
    }


TARGETS = {"single_llama": T_SINGLE_LLAMA, "many_llama": T_MANY_LLAMA, "single_exact": T_EXACT,
           "many_exact": T_EXACT}  # fmt: skip


def exact_mode(config: str | None) -> str:
    """The exact default for the config's model: `keep` for a GGUF (the embedded default included), else `none`."""
    model = None
    if config:
        doc = yaml.safe_load(pathlib.Path(config).read_text()) or {}
        model = (doc.get("engine") or doc).get("model")
    return "keep" if not model or str(model).endswith(".gguf") else "none"


def _warm(side: Side) -> None:
    """One short completion and one chat, outside the measurements (connections, first-request costs)."""
    reqs = [(COMPLETIONS, workload.completion(side.flavour, 0, 2)), (CHAT, workload.chat(side.flavour, 0, 2))]
    for r in clients.run(lambda: clients.sequential(side.server.base_url, reqs)):
        if r.error:
            raise RuntimeError(f"{side.name} warm-up request failed: {r.error}")


def measure(sides: dict[str, Side | None], plan: Plan, raw: dict[str, Any]) -> list[Row]:
    """The rows, measured on running servers: `sides` maps W8A8 and EXACT to tpuserve servers and LLAMA to a
    llama-server or None (its rows print "not run")."""
    order = [s for s in (sides[W8A8], sides[EXACT], sides.get(LLAMA)) if s is not None]
    names, n, reps = row_names(plan), plan.single_tokens, plan.reps
    shorts: dict[str, list[int]] = {s.name: [] for s in order}

    def one(side: Side) -> Callable[[int], float]:
        def step(rep: int) -> float:
            tok_s, short = one_stream(side, rep, n)
            shorts[side.name].append(short)
            return tok_s

        return step

    def many(side: Side) -> Callable[[int], clients.Batch]:
        return lambda rep: _batch(
            side, workload.completions(side.flavour, plan.many_streams, plan.many_tokens)
        )

    log(f"w8a8: 1 stream x {n} tokens, {', '.join(s.name for s in order)}, {reps} rounds")
    single = dict(zip((s.name for s in order), alternate([one(s) for s in order], reps)))
    log(f"w8a8: {plan.many_streams} streams x {plan.many_tokens} tokens, {', '.join(s.name for s in order)}, "
        f"{reps} rounds")  # fmt: skip
    batches = dict(zip((s.name for s in order), alternate([many(s) for s in order], reps)))
    raw["w8a8"] = {
        "single_tok_s": single,
        "single_tokens_short": shorts,
        "many": {k: [{"tok_s": b.tok_s, "wall_s": b.wall, "tokens": b.tokens} for b in v] for k, v in batches.items()},
    }  # fmt: skip
    one_s = {k: median(v) for k, v in single.items()}
    many_s = {k: median([b.tok_s for b in v]) for k, v in batches.items()}
    w, e = sides[W8A8].name, sides[EXACT].name

    def one_note(name: str) -> str:
        s = shorts[name]
        return _short(n * reps - sum(s), n * reps, sum(1 for x in s if x))

    def many_note(name: str) -> str:
        asked = plan.many_streams * plan.many_tokens
        got = min(b.tokens for b in batches[name])
        early = max(sum(1 for r in b.results if r.tokens < plan.many_tokens) for b in batches[name])
        return _short(got, asked, early)

    def notes(*parts: str) -> str:
        return "; ".join(p for p in parts if p)

    rows = []
    llama = sides.get(LLAMA)
    for key, values, note in (("single", one_s, one_note), ("many", many_s, many_note)):
        title, target = names[f"{key}_llama"], TARGETS[f"{key}_llama"]
        if llama is None:
            rows.append(not_run("w8a8", title, target, "no --llama-server", _tok_s(values[w])))
        else:
            ll = values[llama.name]
            rows.append(judged("w8a8", title, _tok_s(values[w]), f"llama-server: {_tok_s(ll)}", values[w] / ll,
                               target, notes(note(w), f"the exact default: {_tok_s(values[e])}, "
                                                      f"{values[e] / ll:.2f}× llama-server")))  # fmt: skip
    for key, values, note in (("single", one_s, one_note), ("many", many_s, many_note)):
        title, target = names[f"{key}_exact"], TARGETS[f"{key}_exact"]
        base = f"exact ({sides[EXACT].name.rsplit(' ', 1)[-1]}): {_tok_s(values[e])}"
        rows.append(judged("w8a8", title, _tok_s(values[w]), base, values[w] / values[e], target,
                           notes(note(w), note(e) and f"exact: {note(e)}")))  # fmt: skip
    return rows


def not_run_rows(plan: Plan, why: str) -> list[Row]:
    return [not_run("w8a8", title, TARGETS[key], why) for key, title in row_names(plan).items()]


def w8a8_rows(
    config: str | None,
    workdir: pathlib.Path,
    plan: Plan,
    raw: dict,
    external: bool,
    llama_binary: str | None = None,
    llama_url: str | None = None,
    gguf: str | None = None,
) -> list[Row]:
    """Start the w8a8 and exact tpuserve servers (and llama-server with `llama_binary`), measure, stop them."""
    if external:
        return not_run_rows(plan, "needs servers this run starts (not --tpuserve-url)")
    exact = exact_mode(config)
    modes = {W8A8: "w8a8", EXACT: exact}
    paths = servers.config_variants(
        workdir, config, "w8a8", {k: {"quantization": m} for k, m in modes.items()}
    )
    with servers.Servers() as pool:
        started = {k: pool.start(servers.tpuserve(workdir, paths[k], name=f"tpuserve-{k}")) for k in modes}
        ll_server = None
        if llama_url:
            ll_server = servers.Server(LLAMA, llama_url.rstrip("/"), [], workdir / "none.log")
        elif llama_binary:
            if not gguf:
                raise RuntimeError(
                    "--llama-server needs the GGUF (--gguf, or the config's or embedded model)"
                )
            ll_server = pool.start(servers.llama(workdir, llama_binary, gguf))
        log(
            f"w8a8 / exact ({exact}) servers starting (logs {started[W8A8].log_path}, {started[EXACT].log_path})"
        )
        for server in started.values():
            server.wait_ready(1200)
        if ll_server is not None:
            ll_server.wait_ready(300)
        _, text = clients.run(lambda: clients.get_text(started[W8A8].base_url, "/v1/models"))
        model = json.loads(text)["data"][0]["id"]
        sides: dict[str, Side | None] = {
            k: Side(f"tpuserve {modes[k]}", s, workload.Flavour(model)) for k, s in started.items()
        }
        sides[LLAMA] = None
        if ll_server is not None:
            flavour = workload.Flavour(pathlib.Path(gguf or "model").name, workload.LLAMA_EXTRA)
            sides[LLAMA] = Side(LLAMA, ll_server, flavour)
        raw["w8a8_servers"] = {k: {"argv": s.server.argv, "quantization": modes.get(k)} for k, s in sides.items()
                               if s is not None}  # fmt: skip
        for side in sides.values():
            if side is not None:
                _warm(side)
        return measure(sides, plan, raw)

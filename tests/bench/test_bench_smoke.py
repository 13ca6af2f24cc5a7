"""The benchmark's own machinery, quickly and without a model: the table and its verdicts, the Prometheus reader,
the SSE client, process clean-up, and `python -m bench.run --quick` end to end against two fake OpenAI servers
(a scripted "tpuserve" and a scripted "llama-server", streaming at known speeds), so every verdict is known
in advance."""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import socket
import sys
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import clients, run, servers
from bench.table import MISS, NOT_RUN, PASS, Target, count_row, judged, markdown

pytestmark = pytest.mark.timeout(60)


# ---- a scripted OpenAI streaming server ---------------------------------------------------------------------


class Fake:
    """Streams `max_tokens` one-token chunks (completions: " w<i>" and a raw U+2028): the first after `ttft_s`,
    then one per `token_s` (`lp_token_s` when `logprobs` is asked). A prompt containing "Dear diary" stops after
    3 tokens (EOS). Serves /health, /v1/models, a tpuserve-style /metrics (its compile counter moves once, on the
    first logprobs request) and a llama-style /slots. A prompt longer than `max_prompt_chars` is refused (400)."""

    def __init__(self, ttft_s: float, token_s: float, lp_token_s: float) -> None:
        self.ttft_s, self.token_s, self.lp_token_s = ttft_s, token_s, lp_token_s
        self.max_prompt_chars: int | None = None
        self.in_flight = 0
        self.compiles = 7
        self.bodies: list[dict] = []

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        async def health(request):
            return JSONResponse({"status": "ok"})

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        async def metrics(request):
            return PlainTextResponse(
                "# TYPE tpuserve_backend_xla_compiles_total counter\n"
                f"tpuserve_backend_xla_compiles_total {self.compiles}.0\n"
                f"tpuserve_backend_active_slots {self.in_flight}.0\n"
                "tpuserve_backend_queue_depth 0.0\n"
            )

        async def slots(request):
            return JSONResponse([{"id": 0, "is_processing": self.in_flight > 0}])

        async def generate(request):
            body = await request.json()
            self.bodies.append(body)
            if self.max_prompt_chars and len(json.dumps(body.get("prompt") or "")) > self.max_prompt_chars:
                return JSONResponse({"error": {"message": "the prompt is longer than the context"}}, 400)
            return StreamingResponse(self.events(body, request.url.path.endswith("chat/completions")),
                                     media_type="text/event-stream")  # fmt: skip

        return Starlette(routes=[
            Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
            Route("/slots", slots), Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/chat/completions", generate, methods=["POST"]),
        ])  # fmt: skip

    async def events(self, body: dict, chat: bool):
        self.in_flight += 1
        try:
            logprobs = body.get("logprobs") is not None
            if logprobs and self.compiles == 7:
                self.compiles += 1
            prompt = json.dumps(body.get("prompt") or body.get("messages"))
            n = 3 if "Dear diary" in prompt else body["max_tokens"]
            await asyncio.sleep(self.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.lp_token_s if logprobs else self.token_s)
                if chat:
                    choice = {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": f" w{i}\u2028", "finish_reason": None}
                    if logprobs:
                        choice["logprobs"] = {"tokens": [f" w{i}"], "token_logprobs": [-1.0]}
                # raw U+2028 in the JSON (as llama-server may send it): an SSE client must not split the line there
                yield f"data: {json.dumps({'choices': [choice]}, ensure_ascii=False)}\n\n"
            end = {"index": 0, "finish_reason": "stop" if n < body["max_tokens"] else "length"}
            end.update({"delta": {}} if chat else {"text": ""})
            yield f"data: {json.dumps({'choices': [end]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


class Served:
    """A Fake served by uvicorn on a free loopback port, in a background thread."""

    def __init__(self, fake: Fake) -> None:
        import uvicorn

        self.fake = fake
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def pair():
    # "tpuserve": slow to its first token, fast per token, much slower with logprobs; "llama": the opposite.
    tpu = Served(Fake(ttft_s=0.25, token_s=0.004, lp_token_s=0.04))
    llama = Served(Fake(ttft_s=0.02, token_s=0.08, lp_token_s=0.08))
    yield tpu, llama
    tpu.close()
    llama.close()


# ---- tests ------------------------------------------------------------------------------------------------------


def test_verdicts_and_table():
    at_least_3 = Target(">=", 3.0)
    assert judged("k", "a", "1", "b", 2.99, at_least_3).result == MISS
    assert judged("k", "a", "1", "b", 3.0, at_least_3).result == PASS
    assert judged("k", "a", "1", "b", None, at_least_3).result == NOT_RUN  # never PASS without a number
    assert judged("k", "a", "1", "b", float("nan"), at_least_3).result == NOT_RUN
    assert judged("k", "a", "1", "b", 0.9, Target("<=", 1.0)).result == PASS
    stretched = judged("k", "a", "1", "b", 1.2, Target(">=", 1.0, stretch=1.5))
    assert (stretched.result, stretched.note) == (PASS, "stretch missed")
    assert count_row("c", "compiles", 2, "x").result == MISS
    assert count_row("c", "compiles", 0, "x").result == PASS
    assert count_row("c", "compiles", None, "x").result == NOT_RUN
    rows = [judged("k", "a|b", "10 tok/s", "llama: 5 tok/s", 2.0, at_least_3, note="2 streams short")]
    lines = markdown(rows).splitlines()
    assert lines[0].startswith("| benchmark") and set(lines[1]) <= {"|", "-"}
    cells = [c.strip() for c in lines[2].strip("|").split(" | ")]
    assert cells == ["a\\|b [1]", "10 tok/s", "llama: 5 tok/s", "2.00×", "≥ 3×", "MISS"]
    assert lines[-1] == "[1] 2 streams short"
    assert len({len(x) for x in lines[:3]}) == 1  # padded columns


def test_prometheus_sum():
    text = (
        "# HELP x_total things\n# TYPE x_total counter\n"
        'x_total{code="OK"} 3.0\nx_total{code="BAD"} 2.0 1700000000000\nx_total_created 17.0\ny 4\n'
    )
    assert clients.prometheus_sum(text, "x_total") == 5.0
    assert clients.prometheus_sum(text, "y") == 4.0
    assert clients.prometheus_sum(text, "z") is None


def test_sse_client_counts_and_times(pair):
    tpu, _ = pair
    body = {"model": "m", "prompt": "hello", "max_tokens": 5}
    (r,) = asyncio.run(clients.sequential(tpu.url, [("/v1/completions", body)]))
    assert (r.error, r.tokens, r.text_chunks, r.finish_reason, r.done) == (None, 5, 5, "length", True)
    assert r.text == " w0\u2028 w1\u2028 w2\u2028 w3\u2028 w4\u2028"
    assert 0.25 <= r.ttft < r.last_token - r.sent
    assert tpu.fake.bodies[-1]["stream"] is True and tpu.fake.bodies[-1]["stream_options"] == {
        "include_usage": True
    }
    chat = {"model": "m", "messages": [{"role": "user", "content": "Dear diary"}], "max_tokens": 9}
    (c,) = asyncio.run(clients.sequential(tpu.url, [("/v1/chat/completions", chat)]))
    assert (c.tokens, c.finish_reason, c.text) == (3, "stop", " w0 w1 w2")
    (bad,) = asyncio.run(clients.sequential(tpu.url, [("/v1/nothing", body)]))
    assert bad.error.startswith("HTTP 404") or bad.error.startswith("HTTP 405")


def test_quick_run_against_fakes(pair, tmp_path, capsys):
    tpu, llama = pair
    out = tmp_path / "bench.json"
    rc = run.main(["--quick", "--no-hf", "--only", "single,ttft,many,logprobs,ttft_load,compiles",
                   "--tpuserve-url", tpu.url, "--tpuserve-metrics-url", tpu.url, "--llama-url", llama.url,
                   "--json", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    by_key: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        by_key.setdefault(r["key"], []).append(r)
    single = {r["name"].rsplit("vs ", 1)[-1]: r for r in by_key["single"]}
    assert single["HF"]["result"] == NOT_RUN and single["HF"]["ratio"] is None
    assert single["llama-server"]["result"] == PASS  # 16 tokens: 0.25 + 15 x 0.004 s vs 0.02 + 15 x 0.08 s
    (many,) = by_key["many"]
    assert many["result"] == PASS and many["ratio"] > 1.5
    assert "ended early" in many["note"]  # the "Dear diary" stream stopped after 3 of 8 tokens
    assert [r["result"] for r in by_key["ttft"]] == [MISS, MISS]  # 250 ms vs 20 ms
    assert all(r["ratio"] > 5 for r in by_key["ttft"])
    (load,) = by_key["ttft_load"]
    assert load["result"] == MISS
    (lp,) = by_key["logprobs"]
    assert lp["result"] == MISS and lp["ratio"] > 1.5  # 250 + 7 x 40 ms vs 250 + 7 x 4 ms
    (compiles,) = by_key["compiles"]
    assert (compiles["measured"], compiles["result"]) == ("1", MISS)
    assert doc["raw"]["compiles"] == {"before": 7.0, "after": 8.0}
    # llama-server was asked with its ignore_eos extension, tpuserve with plain OpenAI fields, both seeded
    assert all(b.get("ignore_eos") is True and "seed" in b for b in llama.fake.bodies)
    assert all("ignore_eos" not in b and "seed" in b for b in tpu.fake.bodies)
    # no server sees a prompt twice (llama-server would answer a repeat from its slot's cache), and both get the
    # same texts up to each request's number
    tails = []
    for fake in (tpu.fake, llama.fake):
        texts = [b.get("prompt") or b["messages"][-1]["content"] for b in fake.bodies]
        assert len(set(texts)) == len(texts) and all(re.match(r"\d{4}\. \S", t) for t in texts)
        tails.append({t[len("1000. ") :] for t in texts})
    assert tails[1] <= tails[0]
    table = capsys.readouterr().out
    assert "| HTTP, 8 streams × 8 tokens" in table and table.count("| MISS") == 5


def test_llama_rows_not_run_without_llama(pair, capsys):
    tpu, _ = pair
    rc = run.main(["--quick", "--no-hf", "--only", "many", "--tpuserve-url", tpu.url])
    assert rc == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| HTTP, 8 streams"))
    assert row.rstrip().endswith("| not run |") and "tok/s" in row


def test_mixed_and_shared_system_rows(pair, tmp_path, capsys):
    """A refused long prompt is counted (MISS) and makes the throughput comparison "not run", without failing the
    run; the shared system prompt opens every chat, and llama-server is asked to keep its slot cache."""
    tpu, llama = pair
    tpu.fake.max_prompt_chars = 1000  # the --quick long prompt has ~300 words
    out = tmp_path / "bench.json"
    rc = run.main(["--quick", "--no-hf", "--rows", "mixed,shared-system", "--tpuserve-url", tpu.url,
                   "--tpuserve-metrics-url", tpu.url, "--llama-url", llama.url, "--json", str(out)])  # fmt: skip
    assert rc == 0
    mixed, throughput, shared = json.loads(out.read_text())["rows"]
    assert (mixed["measured"], mixed["baseline"], mixed["result"]) == ("1", "llama-server: 0", MISS)
    assert "of 7 requests" in mixed["note"] and "HTTP 400" in mixed["note"]
    assert throughput["result"] == NOT_RUN and "tok/s" in throughput["measured"]
    assert shared["key"] == "shared_system" and shared["result"] == MISS and shared["ratio"] > 5
    chats = [b for fake in (tpu.fake, llama.fake) for b in fake.bodies if "messages" in b]
    system = [b for b in chats if b["messages"][0]["role"] == "system"]  # the others: run.py's warm-up chats
    assert len(system) == 6 and len({b["messages"][0]["content"] for b in system}) == 1
    assert len({b["messages"][1]["content"] for b in system}) == 6  # a new user turn each request
    assert [b.get("cache_prompt") for b in system] == [None] * 3 + [
        True
    ] * 3  # tpuserve's, then llama-server's
    assert "| mixed load" in capsys.readouterr().out


def test_ttft_streams_rows(pair, tmp_path, capsys):
    """A row per count of decoding streams (1 and 4 with --quick), each probe a new completion closed at its first
    text: tpuserve's fake answers in 250 ms, llama-server's in 20 ms (MISS, ratio > 5)."""
    tpu, llama = pair
    out = tmp_path / "bench.json"
    rc = run.main(["--quick", "--no-hf", "--rows", "ttft_streams", "--tpuserve-url", tpu.url,
                   "--tpuserve-metrics-url", tpu.url, "--llama-url", llama.url, "--json", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [r["key"] for r in rows] == ["ttft_streams"] * 2
    assert ["while 1 stream " in rows[0]["name"], "while 4 streams " in rows[1]["name"]] == [True, True]
    assert all(r["result"] == MISS and r["ratio"] > 5 for r in rows)
    assert "1/1 streams had text at the first probe" in rows[0]["note"]
    assert "4/4 streams had text at the first probe" in rows[1]["note"]
    raw = doc["raw"]["ttft_streams"]
    assert all(len(raw[k]["tpuserve"][0]["ttft_s"]) == 2 for k in raw)  # --quick: 2 probes a round
    for fake in (tpu.fake, llama.fake):
        loads = [b for b in fake.bodies if b.get("max_tokens") == 64]  # the decoding streams: 1, then 4
        short = [b for b in fake.bodies if b.get("max_tokens") == 2]  # 4 probes and run.py's warm-ups
        assert len(loads) == 5 and len(short) >= 4
        texts = [b.get("prompt") or b["messages"][-1]["content"] for b in fake.bodies]
        assert len(set(texts)) == len(texts)  # every prompt new to its server
        assert fake.in_flight == 0  # every probe and load stream closed
    assert "| TTFT of a request arriving while 4 streams decode" in capsys.readouterr().out


def test_prompt_numbers_stay_four_digits_from_any_start(monkeypatch):
    """Each run numbers its prompts from a random start (a second run against the same llama-server must not
    repeat the first's prompts: its prompt cache would answer them), wrapping within 1000-9999."""
    from bench import workload

    monkeypatch.setattr(workload, "_numbers", {})
    monkeypatch.setattr(workload, "_FIRST", 8998)
    got = [workload.unique("x", "t") for _ in range(3)]
    assert got == ["9998. t", "9999. t", "1000. t"] and workload.unique("y", "t") == "9998. t"


def test_servers_are_stopped_on_exit(tmp_path):
    """A server and the child it spawned are gone after the `Servers` block, also when it ends by an error."""
    child_pid = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    server = servers.Server(
        "sleeper", "http://127.0.0.1:9", [sys.executable, "-c", script], tmp_path / "s.log"
    )
    with pytest.raises(KeyboardInterrupt), servers.Servers() as pool:
        pool.start(server)
        deadline = time.monotonic() + 20
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        raise KeyboardInterrupt
    assert server.proc.poll() is not None
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie has exited (its parent, gone, cannot reap it at once)


# ---- w8a8 and drift (servers of their own; measured here against fakes, and their pure parts) -------------------


def test_w8a8_rows_against_fakes(tmp_path):
    """The w8a8 group's measurement on three running servers, alternating: w8a8 (20 ms a token), the exact default
    (60 ms) and llama-server (150 ms); every verdict is known. Without llama-server its two rows are "not run" with
    w8a8's figure, and the w8a8-vs-exact rows are still judged."""
    from bench import w8a8, workload
    from bench.rows import Side

    fakes = {k: Served(Fake(ttft_s=0.02, token_s=t, lp_token_s=t)) for k, t in
             ((w8a8.W8A8, 0.02), (w8a8.EXACT, 0.06), (w8a8.LLAMA, 0.15))}  # fmt: skip
    try:

        def side(key: str, metrics: bool) -> Side:
            url = fakes[key].url
            server = servers.Server(
                key, url, [], tmp_path / f"{key}.log", metrics_url=url if metrics else None
            )
            extra = workload.LLAMA_EXTRA if key == w8a8.LLAMA else ()
            return Side(f"tpuserve {key}" if metrics else key, server, workload.Flavour("fake-model", extra))

        sides = {w8a8.W8A8: side(w8a8.W8A8, True), w8a8.EXACT: side(w8a8.EXACT, True)}
        raw: dict = {}
        rows = w8a8.measure({**sides, w8a8.LLAMA: side(w8a8.LLAMA, False)}, workload.QUICK, raw)
        assert [r.key for r in rows] == ["w8a8"] * 4
        single_ll, many_ll, single_ex, many_ex = rows
        assert "1 stream × 16 tokens" in single_ll.name and single_ll.name.endswith("vs llama-server")
        assert "8 streams × 8 tokens" in many_ll.name and many_ex.name.endswith("vs the exact default")
        assert all(r.result == PASS for r in rows), [(r.name, r.ratio, r.result) for r in rows]
        assert single_ll.ratio > 2 and many_ll.ratio > 1.5 and 1.2 < single_ex.ratio and 1.2 < many_ex.ratio
        assert single_ll.target == "≥ 0.5×" and many_ll.target == "≥ 1.5×" and single_ex.target == "≥ 1×"
        assert "ended early" in many_ll.note and "the exact default:" in many_ll.note  # "Dear diary": 3 of 8
        assert set(raw["w8a8"]["single_tok_s"]) == {"tpuserve w8a8", "tpuserve exact", "llama-server"}
        # one request at a time per server, each prompt new to it; llama-server asked with its extensions
        assert all(b.get("ignore_eos") is True for b in fakes[w8a8.LLAMA].fake.bodies)
        for f in fakes.values():
            texts = [b["prompt"] for b in f.fake.bodies]
            assert len(texts) == 1 + 8 and len(set(texts)) == len(texts) and f.fake.in_flight == 0

        alone = w8a8.measure({**sides, w8a8.LLAMA: None}, workload.QUICK, {})
        assert [r.result for r in alone[:2]] == [NOT_RUN, NOT_RUN]
        assert alone[2].ratio > 1 and alone[3].ratio > 1
        assert all("tok/s" in r.measured and r.note == "no --llama-server" for r in alone[:2])
    finally:
        for f in fakes.values():
            f.close()


def test_w8a8_and_drift_not_run_on_external_servers(pair, capsys):
    """Both groups start servers of their own: against --tpuserve-url every row is "not run", the run succeeds."""
    tpu, llama = pair
    rc = run.main(["--quick", "--only", "w8a8,drift", "--tpuserve-url", tpu.url, "--llama-url", llama.url])
    assert rc == 0
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "benchmark" not in line
    ]
    assert len(lines) == 4 + 3 and all(line.rstrip().endswith("| not run |") for line in lines)
    assert tpu.fake.bodies == [] and llama.fake.bodies == []


def test_w8a8_exact_mode(tmp_path):
    from bench.w8a8 import exact_mode

    assert exact_mode(None) == "keep"
    (tmp_path / "a.yaml").write_text("engine:\n  model: /m/x.gguf\n")
    (tmp_path / "b.yaml").write_text("engine:\n  model: /m/hf-dir\n  quantization: int8\n")
    assert exact_mode(str(tmp_path / "a.yaml")) == "keep" and exact_mode(str(tmp_path / "b.yaml")) == "none"


def test_drift_text_is_the_reference_text():
    import ast

    from bench.drift import TEXT

    source = (REPO / "tests/model/test_gguf_reference.py").read_text()
    assigned = next(
        n for n in ast.parse(source).body if isinstance(n, ast.Assign) and n.targets[0].id == "TEXT"
    )
    assert ast.literal_eval(assigned.value) == TEXT


def test_drift_statistics_on_synthetic_logprobs():
    import math

    from bench.drift import Scored, drift, top_kl

    p = {"a": math.log(0.6), "b": math.log(0.3), "c": math.log(0.1)}
    assert top_kl(p, p) == pytest.approx(0.0)
    q = {"a": math.log(0.3), "b": math.log(0.6), "d": math.log(0.05)}  # lacks "c": it takes q's 3rd, log 0.05
    want = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6) + 0.1 * math.log(0.1 / 0.05)
    assert top_kl(p, q) == pytest.approx(want)
    assert top_kl(p, q, k=2) == pytest.approx(0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6))
    ref = Scored([-0.5, -1.0, -2.0], [p, p, p])
    got = Scored([-0.5, -1.5, -1.0], [p, q, p])
    d = drift(ref, got)
    assert (d.positions, d.mean_abs, d.max_abs) == (3, pytest.approx(0.5), pytest.approx(1.0))
    assert d.top1 == pytest.approx(2 / 3)  # position 1: "a" vs "b"
    assert d.kl_mean == pytest.approx(want / 3) and d.kl_max == pytest.approx(want)
    assert "top-1 agreement 66.7 %" in d.text()
    with pytest.raises(ValueError):
        drift(ref, Scored([-1.0], [p]))


def test_drift_parses_both_servers_answers():
    """tpuserve's echoed prompt logprobs and llama-server's /completion answer (forced token, or the asked token
    among the alternatives, or none when llama-server held the token back), with the tokens' texts written alike (a lone UTF-8 lead byte as \\xNN, as tpuserve's gateway writes it)."""
    from tpuserve.http_gateway.logprobs import token_text as gateway_text
    from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

    from bench.drift import parse_echo, parse_llama, token_text

    for data in (b"\xe4\xb8", b" caf\xc3\xa9", b"\xbd"):
        assert token_text(data) == gateway_text(pb.Token(token_bytes=data))
    choice = {"logprobs": {"tokens": ["a", "b", "c", "x"], "token_logprobs": [None, -1.0, -2.0, -0.1],
                           "top_logprobs": [None, {"b": -1.0}, {"z": -0.5, "c": -2.0}, {"x": -0.1}]}}  # fmt: skip
    s = parse_echo(choice, 3)  # a generated entry after the prompt is ignored
    assert s.chosen == [-1.0, -2.0] and s.top == [{"b": -1.0}, {"z": -0.5, "c": -2.0}]
    with pytest.raises(RuntimeError):
        parse_echo(choice, 5)
    body = {"completion_probabilities": [{"id": 7, "token": ",", "bytes": [44], "logprob": -6.9, "top_logprobs": [
        {"id": 24, "token": "(", "bytes": [40], "logprob": -0.8},
        {"id": 99, "token": "?", "bytes": [228, 184], "logprob": -3.0},
        {"id": 98, "token": "?", "bytes": [228, 184], "logprob": -2.5}]}]}  # fmt: skip
    assert parse_llama(body, 7) == (-6.9, {"(": -0.8, "\\xe4\\xb8": -2.5, ",": -6.9})
    assert parse_llama(body, 24) == (-0.8, {"(": -0.8, "\\xe4\\xb8": -2.5})  # another token, among the top
    assert parse_llama(body, 5) == (None, {"(": -0.8, "\\xe4\\xb8": -2.5})  # not among them: ask for more
    assert parse_llama({"content": "\ufffd"}, 7) is None  # a token ending inside a character: held back


def test_drift_rows_and_their_target():
    from bench.drift import Drift, rows_of

    def d(x: float) -> Drift:
        return Drift(256, x, 2 * x, x / 4, x, 0.9)

    llama, i8, w8 = rows_of({"llama": d(0.2), "w8a8": d(0.25), "int8": d(0.08)})
    assert (llama.result, llama.measured, llama.ratio) == ("diagnostic", "0.200", None)
    assert (i8.result, i8.ratio) == ("diagnostic", pytest.approx(0.4))
    assert (w8.result, w8.ratio, w8.target) == (MISS, pytest.approx(1.25), "≤ 1×")
    assert rows_of({"llama": d(0.3), "w8a8": d(0.25)})[2].result == PASS
    alone = rows_of({"w8a8": d(0.25), "int8": d(0.08)})
    assert [r.result for r in alone] == [NOT_RUN] * 3 and alone[2].measured == "0.250"
    assert alone[0].note == "no --llama-server" and alone[2].note.startswith("no --llama-server; |Δ logprob|")

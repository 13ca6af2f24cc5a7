"""Backend observability and limits over a real grpc.aio server (fake engine): the Prometheus metrics port
(queue depth, active slots, KV cache and its pages, decode-call time, compiles, finish reasons, tokens), the
pages in GetModelInfo, one JSON log line per Generate with the caller's request id and no prompt unless asked,
and max_prompt_tokens."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tpuserve.cli.jsonlog import JSONFormatter
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.grpc_service.conftest import ServerThread, generate
from tests.grpc_service.fake_engine import PAGES, make_engine
from tests.helpers import free_port

SECRET = "my secret prompt about zebras"


@contextmanager
def captured(name: str) -> Iterator[list[dict]]:
    """JSON lines logged to `name` (formatted as in production)."""
    lines: list[dict] = []
    fmt = JSONFormatter()
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(json.loads(fmt.format(record)))  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def wait_for(lines: list[dict], request_id: str, timeout: float = 5.0) -> list[dict]:
    """The server logs after the call's last message or status, which the client may see first."""
    deadline = time.monotonic() + timeout
    while (
        not (found := [ln for ln in lines if ln.get("request_id") == request_id])
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    return found


def scrape(port: int) -> dict[str, float]:
    """`name{label="v",...}` -> value of every sample."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@pytest.fixture(scope="module")
def observed(tokenizer) -> Iterator[ServerThread]:
    engine = make_engine(tokenizer, slots=4, max_seq_len=256, steps_per_call=4)
    server = ServerThread(engine, tokenizer, metrics_port=free_port(), max_prompt_tokens=32)
    yield server
    server.close()


def test_metrics_port_serves_state_and_counters_that_move(observed: ServerThread) -> None:
    port = observed.server.metrics_port
    assert port
    before = scrape(port)
    for name in ("tpuserve_backend_queue_depth", "tpuserve_backend_active_slots", "tpuserve_backend_xla_compiles_total",
                 "tpuserve_backend_kv_cache_bytes", "tpuserve_backend_kv_cache_used_positions"):  # fmt: skip
        assert name in before, sorted(before)
    assert before["tpuserve_backend_slots"] == 4
    assert before["tpuserve_backend_kv_cache_positions"] == 4 * 256
    out = generate(observed.stub, text="Hello there", stopping=pb.StoppingCriteria(max_tokens=6), n=2)
    assert all(m.request_id for m in out)
    deadline = time.monotonic() + 5  # the call is counted when it ends, which the client may see first
    while (
        'tpuserve_backend_requests_total{code="OK"}' not in (after := scrape(port))
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert (
        after["tpuserve_backend_generated_tokens_total"]
        - before.get("tpuserve_backend_generated_tokens_total", 0)
        == 12
    )
    assert after['tpuserve_backend_samples_finished_total{finish_reason="length"}'] >= 2
    assert after['tpuserve_backend_requests_total{code="OK"}'] >= 1
    assert after["tpuserve_backend_generate_call_seconds_count"] > before.get(
        "tpuserve_backend_generate_call_seconds_count", 0
    )
    assert after["tpuserve_backend_time_to_first_token_seconds_count"] >= 1
    for part in ("queue_wait", "prefill", "delivery"):  # the time to first token, split
        assert after[f"tpuserve_backend_ttft_{part}_seconds_count"] >= 1


def test_active_slots_and_queue_depth_while_the_engine_is_held(observed: ServerThread) -> None:
    engine = observed.engine
    engine.gate = threading.Event()  # decode() waits on it: slots stay taken
    results: list = []

    def one() -> None:
        results.append(generate(observed.stub, text="Hello", stopping=pb.StoppingCriteria(max_tokens=4), n=2))

    threads = [threading.Thread(target=one) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while True:
            m = scrape(observed.server.metrics_port)
            # the first request holds 2 slots inside the held decode call; the later ones wait in the queue
            # (admission runs between decode calls), or take the other 2 slots if they came before it
            if m["tpuserve_backend_active_slots"] >= 2 and m["tpuserve_backend_queue_depth"] >= 1:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        assert m["tpuserve_backend_kv_cache_used_positions"] > 0  # the held samples' prompts and tokens
    finally:
        engine.gate.set()
        for t in threads:
            t.join(10)
        engine.gate = None
    assert len(results) == 3
    assert scrape(observed.server.metrics_port)["tpuserve_backend_active_slots"] == 0


def test_compiles_are_counted(observed: ServerThread) -> None:
    import jax
    import numpy as np

    before = scrape(observed.server.metrics_port)["tpuserve_backend_xla_compiles_total"]
    jax.jit(lambda x: x * 3 + 1)(np.arange(7, dtype=np.float32)).block_until_ready()
    assert scrape(observed.server.metrics_port)["tpuserve_backend_xla_compiles_total"] >= before + 1


def test_one_json_log_line_per_generate_with_the_request_id_and_no_prompt(observed: ServerThread) -> None:
    with captured("tpuserve.backend.requests") as lines:
        generate(
            observed.stub, request_id="req-abc123", text=SECRET, stopping=pb.StoppingCriteria(max_tokens=3)
        )
        mine = wait_for(lines, "req-abc123")
    assert len(mine) == 1, lines
    line = mine[0]
    assert line["code"] == "OK" and line["completion_tokens"] == 3 and line["finish_reasons"] == ["length"]
    assert line["prompt_tokens"] > 0 and line["ttft_ms"] is not None
    assert "zebras" not in json.dumps(line)


def test_prompts_are_logged_only_with_log_prompts(tokenizer) -> None:
    engine = make_engine(tokenizer, slots=2, max_seq_len=128, steps_per_call=4)
    server = ServerThread(engine, tokenizer, log_prompts=True, metrics_port=0)
    try:
        with captured("tpuserve.backend.requests") as lines:
            generate(server.stub, request_id="req-p", text=SECRET, stopping=pb.StoppingCriteria(max_tokens=2))
            assert [ln["prompt"] for ln in wait_for(lines, "req-p")] == [SECRET]
        assert server.server.metrics_port is None and server.server.metrics is None  # 0 = off
    finally:
        server.close()


def test_max_prompt_tokens_is_invalid_argument_naming_it(observed: ServerThread) -> None:
    with captured("tpuserve.backend.requests") as lines:
        with pytest.raises(grpc.RpcError) as err:  # the log line is awaited after the error
            generate(
                observed.stub,
                request_id="req-long",
                text="hello " * 100,
                stopping=pb.StoppingCriteria(max_tokens=2),
            )
        assert [ln["code"] for ln in wait_for(lines, "req-long")] == ["INVALID_ARGUMENT"]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_prompt_tokens 32" in err.value.details()
    assert (
        scrape(observed.server.metrics_port)['tpuserve_backend_requests_total{code="INVALID_ARGUMENT"}'] >= 1
    )


def test_prefix_cache_metrics_follow_the_engine(observed: ServerThread) -> None:
    """The prefix cache's counters and gauges are the engine's prefix_cache_stats(); the HELP says how to get
    the hit rate."""
    port = observed.server.metrics_port
    ids = pb.TokenIds(ids=[2000 + i for i in range(10)])
    before = scrape(port)
    for _ in range(2):  # the second run finds 8 of the 10 tokens (fake_engine.py: blocks of 4, not the last)
        generate(
            observed.stub, token_ids=ids, cache_salt="metrics", stopping=pb.StoppingCriteria(max_tokens=1)
        )
    after = scrape(port)
    assert (
        after["tpuserve_backend_prefix_cache_lookup_tokens_total"]
        - before["tpuserve_backend_prefix_cache_lookup_tokens_total"]
        == 20
    )
    assert (
        after["tpuserve_backend_prefix_cache_hit_tokens_total"]
        - before["tpuserve_backend_prefix_cache_hit_tokens_total"]
        == 8
    )
    stats = observed.engine.prefix_cache_stats()
    assert after["tpuserve_backend_prefix_cache_bytes"] == stats.cached_bytes > 0
    assert after["tpuserve_backend_prefix_cache_capacity_bytes"] == stats.capacity_bytes == 1 << 20
    assert after["tpuserve_backend_prefix_cache_evictions_total"] == stats.evictions == 0
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "# TYPE tpuserve_backend_prefix_cache_hit_tokens_total counter" in text
    assert "# TYPE tpuserve_backend_prefix_cache_bytes gauge" in text
    help_line = next(
        ln for ln in text.splitlines() if ln.startswith("# HELP tpuserve_backend_prefix_cache_hit_tokens")
    )
    assert "hit rate" in help_line.lower()


def test_prefix_cache_metrics_are_absent_without_a_cache(tokenizer) -> None:
    engine = make_engine(tokenizer, slots=2, max_seq_len=128, prefix_cache_bytes=None)
    server = ServerThread(engine, tokenizer, metrics_port=free_port())
    try:
        out = generate(server.stub, text="hello", stopping=pb.StoppingCriteria(max_tokens=1))
        assert out[-1].cached_prompt_tokens_count == 0
        names = scrape(server.server.metrics_port)
        assert "tpuserve_backend_slots" in names
        assert not [n for n in names if n.startswith("tpuserve_backend_prefix_cache")], sorted(names)
    finally:
        server.close()


PAGE_GAUGES = {  # metric -> the PageStats field it reports
    "tpuserve_backend_kv_page_tokens": "page_tokens",
    "tpuserve_backend_kv_pages": "total",
    "tpuserve_backend_kv_pages_used": "used",
    "tpuserve_backend_kv_pages_shared": "shared",
    "tpuserve_backend_kv_pages_cached": "cached",
    "tpuserve_backend_kv_pages_free": "free",
}


def help_of(text: str, name: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(f"# HELP {name} "))


def test_page_metrics_and_model_info_follow_the_engine_pages(tokenizer) -> None:
    """With a paged KV cache: a gauge per page count and a preemption counter, read at each scrape from
    engine.page_stats(); kv_cache_positions is the pool's (pages x page tokens), not slots x max_seq_len; the
    same counts in GetModelInfo.pages. A page_stats() that raises costs only the page metrics."""
    engine = make_engine(tokenizer, slots=4, max_seq_len=256, steps_per_call=4, pages=PAGES)
    server = ServerThread(engine, tokenizer, metrics_port=free_port())
    port = server.server.metrics_port
    info = lambda: server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    try:
        for stats in (PAGES, replace(PAGES, used=30, shared=5, cached=9, free=10, preemptions=7)):
            engine.pages = stats
            m = scrape(port)
            for name, field in PAGE_GAUGES.items():
                assert m[name] == getattr(stats, field), name
            assert m["tpuserve_backend_kv_preemptions_total"] == stats.preemptions
            assert (
                m["tpuserve_backend_kv_cache_positions"] == stats.total * stats.page_tokens == 640 != 4 * 256
            )
            got = info()
            assert got.HasField("pages") and got.pages == pb.PageCounts(**asdict(stats))
            assert got.readiness == "serving"
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        for name in PAGE_GAUGES:
            assert f"# TYPE {name} gauge" in text
        assert "# TYPE tpuserve_backend_kv_preemptions_total counter" in text
        assert "pool" in help_of(text, "tpuserve_backend_kv_cache_bytes")
        assert "pages in the pool x positions per page" in help_of(
            text, "tpuserve_backend_kv_cache_positions"
        )

        def broken():
            raise RuntimeError("page table gone")

        engine.page_stats = broken  # type: ignore[method-assign]
        m = scrape(port)
        assert m["tpuserve_backend_slots"] == 4 and m["tpuserve_backend_kv_cache_positions"] == 4 * 256
        assert not [n for n in m if n.startswith(("tpuserve_backend_kv_page", "tpuserve_backend_kv_preempt"))]
        got = info()
        assert not got.HasField("pages") and got.readiness == "serving"
    finally:
        server.close()


def test_page_metrics_are_absent_without_pages(observed: ServerThread) -> None:
    assert observed.engine.page_stats() is None
    m = scrape(observed.server.metrics_port)
    assert m["tpuserve_backend_kv_cache_positions"] == 4 * 256  # slots x max_seq_len
    assert not [n for n in m if n.startswith(("tpuserve_backend_kv_page", "tpuserve_backend_kv_preempt"))]
    assert not observed.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).HasField("pages")

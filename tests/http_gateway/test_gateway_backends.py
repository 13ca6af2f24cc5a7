"""The gateway's side of the gRPC link: what it sends, model discovery, health, round-robin and failover,
cancellation on client disconnect, and the `tpuserve gateway` entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from gateway_checks import check_spec, post, strict_json
from gateway_harness import GatewayServer, sse_events
from scripted_backend import CREATED, MODEL_ID, ScriptedBackend, encode
from tpuserve.cli.gateway import parse_args
from tpuserve.http_gateway.backends import PAGE_FIELDS
from tpuserve.http_gateway.observability import Limits
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

from tests.helpers import free_port

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def last_request(gw) -> pb.GenerateRequest:
    return gw.scripted.servicer.requests[-1]


# ---- routes ----------------------------------------------------------------------------------------------


def test_models_lists_the_backend_model(gateway) -> None:
    r = gateway.http.get("/v1/models")
    data = strict_json(r.text)
    check_spec(data, "ListModelsResponse")
    assert [m["id"] for m in data["data"]] == [gateway.model]
    one = strict_json(gateway.http.get(f"/v1/models/{gateway.model}").text)
    check_spec(one, "Model")
    assert one["id"] == gateway.model and one["object"] == "model"


def test_model_card_uses_backend_info(scripted_gateway) -> None:
    data = scripted_gateway.http.get("/v1/models").json()
    assert data["data"] == [{"id": MODEL_ID, "object": "model", "created": CREATED, "owned_by": "tpuserve"}]
    assert scripted_gateway.http.get("/v1/models/nope").status_code == 404


def test_health_is_200_when_a_backend_serves(gateway) -> None:
    r = gateway.http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and len(body["backends"]) == 1
    if gateway.kind == "scripted":  # its ModelInfo has no pages
        assert body["pages"] == {}
    else:  # the real engine pages its KV cache
        [(address, pages)] = body["pages"].items()
        assert address in body["backends"] and set(pages) == set(PAGE_FIELDS)
        assert pages["page_tokens"] > 0 and pages["total"] > 0
        assert pages["used"] <= pages["total"] and pages["free"] <= pages["total"]


def test_health_gives_the_page_counts_of_each_paging_backend() -> None:
    """/health's `pages`: address -> the backend's GetModelInfo.pages (its engine's page_stats() at the time),
    for the backends that page their KV cache; one that does not is in `backends` only."""
    from dataclasses import asdict, replace

    from tpuserve.model.embedded import default_model_path
    from tpuserve.model.tokenizer import load_tokenizer

    from tests.grpc_service.conftest import ServerThread
    from tests.grpc_service.fake_engine import PAGES, make_engine

    tokenizer = load_tokenizer(default_model_path())
    engine = make_engine(tokenizer, slots=2, max_seq_len=128, pages=PAGES)
    paged = ServerThread(engine, tokenizer)
    plain = ScriptedBackend().start()
    server = GatewayServer([paged.address, plain.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            for stats in (PAGES, replace(PAGES, used=25, shared=6, free=15, preemptions=9)):
                engine.pages = stats
                r = http.get("/health")
                assert r.status_code == 200
                body = r.json()
                assert body["status"] == "ok"
                assert body["backends"] == {paged.address: "serving", plain.address: "unknown"}
                assert body["pages"] == {paged.address: asdict(stats)}
    finally:
        server.stop()
        plain.stop()
        paged.close()


def test_health_is_503_while_no_backend_reports_serving() -> None:
    backend = ScriptedBackend().start()
    server = GatewayServer([backend.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            backend.set_serving(False)  # e.g. still warming up
            r = http.get("/health")
            assert r.status_code == 503
            check_spec(r.json(), "ErrorResponse")
            backend.set_serving(True)
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
        backend.stop()


# ---- request mapping -------------------------------------------------------------------------------------


def test_chat_defaults_reach_the_backend(scripted_gateway) -> None:
    post(scripted_gateway.http, CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]})
    sent = last_request(scripted_gateway)
    assert sent.sampling.temperature == 1.0 and not sent.sampling.HasField("top_p")
    assert not sent.sampling.HasField("seed")
    assert not sent.stopping.HasField("max_tokens") and list(sent.stopping.stop) == []
    assert not sent.logprobs.enabled and sent.logprobs.top_logprobs == 0 and not sent.logprobs.prompt_logprobs
    assert sent.n == 1 and sent.request_id.startswith("chatcmpl-")


def test_chat_parameters_reach_the_backend(scripted_gateway) -> None:
    post(
        scripted_gateway.http,
        CHAT,
        {
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "Hi"}],
            "temperature": 0,
            "top_p": 0.5,
            "seed": -1,
            "stop": "x",
            "max_tokens": 7,
            "max_completion_tokens": 5,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    sent = last_request(scripted_gateway)
    assert sent.sampling.temperature == 0.0 and sent.sampling.top_p == 0.5
    assert sent.sampling.seed == 2**64 - 1
    assert list(sent.stopping.stop) == ["x"] and sent.stopping.max_tokens == 5
    assert sent.n == 2 and sent.logprobs.enabled and sent.logprobs.top_logprobs == 3


def test_completion_parameters_reach_the_backend(scripted_gateway) -> None:
    post(scripted_gateway.http, COMPLETIONS, {"model": MODEL_ID, "prompt": "Hi"})
    sent = last_request(scripted_gateway)
    assert sent.WhichOneof("prompt") == "text" and sent.text == "Hi"
    assert sent.stopping.max_tokens == 16 and not sent.logprobs.enabled
    post(
        scripted_gateway.http,
        COMPLETIONS,
        {
            "model": MODEL_ID,
            "prompt": [5, 6],
            "echo": True,
            "logprobs": 2,
            "max_tokens": 0,
            "seed": 42,
            "stop": ["a", "b"],
        },
    )
    sent = last_request(scripted_gateway)
    assert sent.WhichOneof("prompt") == "token_ids" and list(sent.token_ids.ids) == [5, 6]
    assert sent.logprobs.enabled and sent.logprobs.top_logprobs == 2 and sent.logprobs.prompt_logprobs
    assert (
        sent.stopping.max_tokens == 0 and sent.sampling.seed == 42 and list(sent.stopping.stop) == ["a", "b"]
    )


def test_echo_without_logprobs_does_not_ask_for_prompt_logprobs(scripted_gateway) -> None:
    data = post(scripted_gateway.http, COMPLETIONS, {"model": MODEL_ID, "prompt": "say:x", "echo": True})
    assert data["choices"][0]["text"] == "say:xx"
    sent = last_request(scripted_gateway)
    assert not sent.logprobs.prompt_logprobs and not sent.logprobs.enabled


def test_batched_prompts_are_one_backend_request_each(scripted_gateway) -> None:
    before = len(scripted_gateway.scripted.servicer.requests)
    post(scripted_gateway.http, COMPLETIONS, {"model": MODEL_ID, "prompt": ["a", "b", "c"], "n": 2})
    sent = scripted_gateway.scripted.servicer.requests[before:]
    assert sorted(r.text for r in sent) == ["a", "b", "c"] and all(r.n == 2 for r in sent)
    assert len({r.request_id for r in sent}) == 3


# ---- several backends ------------------------------------------------------------------------------------


@pytest.fixture()
def two_backends():
    backends = [ScriptedBackend().start(), ScriptedBackend().start()]
    yield backends
    for b in backends:
        b.stop()


def test_requests_go_round_robin_and_fail_over_when_a_backend_goes_away(two_backends) -> None:
    a, b = two_backends
    server = GatewayServer([a.address, b.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            for _ in range(4):
                post(http, CHAT, body)
            assert len(a.servicer.requests) == 2 and len(b.servicer.requests) == 2
            b.stop()
            for _ in range(3):
                post(http, CHAT, body)
            assert len(a.servicer.requests) == 5
            assert http.get("/health").status_code == 200
    finally:
        server.stop()


def test_backends_serving_different_models() -> None:
    a, b = ScriptedBackend("model-a").start(), ScriptedBackend("model-b").start()
    server = GatewayServer([a.address, b.address]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["model-a", "model-b"]
            for model, backend in (("model-b", b), ("model-a", a)):
                post(http, COMPLETIONS, {"model": model, "prompt": "x", "max_tokens": 1})
                assert len(backend.servicer.requests) == 1
    finally:
        server.stop()
        a.stop()
        b.stop()


# ---- cancellation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_client_disconnect_cancels_the_backend_call(scripted_gateway, path) -> None:
    prompt = "slow:loop:ab"
    body = {"model": MODEL_ID, "max_tokens": 2000, "stream": True}
    body.update({"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt})
    servicer = scripted_gateway.scripted.servicer
    with (
        httpx.Client(base_url=scripted_gateway.url, timeout=10) as http,
        http.stream("POST", path, json=body) as r,
    ):
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
        request_id = servicer.requests[-1].request_id
    deadline = time.monotonic() + 5
    while request_id not in servicer.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in servicer.cancelled


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_client_timeout_on_a_non_streamed_request_cancels_the_backend_call(scripted_gateway, path) -> None:
    prompt = "slow:loop:ab"
    body = {"model": MODEL_ID, "max_tokens": 2000}
    body.update({"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt})
    servicer = scripted_gateway.scripted.servicer
    before = len(servicer.requests)
    # 2 s: long enough for the gateway to reach the backend on a loaded 2-core CI machine (0.5 s is not),
    # far shorter than the 20 s the slow script streams for
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted_gateway.url + path, json=body, timeout=2.0)
    deadline = time.monotonic() + 5
    while len(servicer.requests) <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    request_id = servicer.requests[before].request_id
    while request_id not in servicer.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in servicer.cancelled


# ---- entry point -----------------------------------------------------------------------------------------


def test_request_timeout_is_the_backend_calls_deadline(scripted) -> None:
    """`request_timeout`: a generation that runs longer ends with 504 (non-streamed) or an error event (streamed),
    since the backend call's gRPC deadline passed (the backend then frees the slots: test_deadline_frees_the_slot
    in tests/grpc_service/test_server.py); the gateway keeps serving."""
    server = GatewayServer([scripted.address], limits=Limits(request_timeout_s=2.0)).start()
    body = {"model": MODEL_ID, "prompt": "slow:loop:tick", "max_tokens": 2000}  # 10 ms a token: ~20 s
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            t0 = time.monotonic()
            r = http.post(COMPLETIONS, json=body)
            assert r.status_code == 504, r.text
            assert r.json()["error"]["code"] == "timeout"
            assert time.monotonic() - t0 < 10
            r = http.post(COMPLETIONS, json={**body, "stream": True})
            assert r.status_code == 200  # the stream had started: its last event before [DONE] is the error
            events = [e for e in sse_events(r.text) if e != "[DONE]"]
            assert json.loads(events[-1])["error"]["code"] == "timeout", events[-1]
            ok = http.post(COMPLETIONS, json={"model": MODEL_ID, "prompt": "say:fine", "max_tokens": 8})
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"
    finally:
        server.stop()


def test_parse_args_reads_repeated_backends_and_the_key_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("TPUSERVE_API_KEY", "from-env")
    args = parse_args(["gateway", "--backend", "a:1", "--backend", "b:2", "--port", "9000"])
    assert args.backend == ("a:1", "b:2") and args.port == 9000 and args.api_key == "from-env"
    assert parse_args(["--backend", "a:1", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("TPUSERVE_API_KEY")
    assert parse_args(["--backend", "a:1"]).api_key is None


def test_parse_args_config_sections(tmp_path) -> None:
    """The gateway reads its `gateway:` section (an empty one is all defaults), a flat file of gateway keys, and
    nothing from a file whose sections are all another process's; unknown keys and bad values are errors."""
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  slots: 4\ngateway:\n")
    assert parse_args(["--config", str(path), "--backend", "a:1"]).max_n == 16
    path.write_text("max_n: 5\nbackend: [b:2]\n")
    args = parse_args(["--config", str(path)])
    assert args.max_n == 5 and args.backend == ("b:2",)
    path.write_text("server:\n  port: 1\n")
    assert parse_args(["--config", str(path), "--backend", "a:1"]).port == 8000
    for bad in ("gateway:\n  max_m: 5\n", "gateway: [1]\n"):
        path.write_text(bad)
        with pytest.raises(SystemExit):
            parse_args(["--config", str(path), "--backend", "a:1"])


def test_gateway_entry_point_serves(scripted) -> None:
    port = free_port()
    env = {**os.environ, "TPUSERVE_API_KEY": "k1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tpuserve.http_gateway.serve",
            "--backend",
            scripted.address,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "gateway did not come up"
            time.sleep(0.05)
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(
            url + COMPLETIONS,
            headers={"Authorization": "Bearer k1"},
            json={"model": MODEL_ID, "prompt": "say:ok"},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert r.json()["usage"]["prompt_tokens"] == len(encode("say:ok", True))
    finally:
        proc.terminate()
        proc.wait(10)

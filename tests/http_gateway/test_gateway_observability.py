"""Gateway observability and limits on real loopback servers: /metrics counters move after requests, one JSON
log line per request whose id is the response id, the x-request-id header and the backend's request id (and
the backend's own log line), prompts only with log_prompts; each limit's status, error shape and headers."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from gateway_harness import GatewayServer
from prometheus_client.parser import text_string_to_metric_families
from tpuserve.cli.gateway import parse_args
from tpuserve.cli.jsonlog import JSONFormatter
from tpuserve.http_gateway.app import create_app
from tpuserve.http_gateway.observability import Limits

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SECRET = "zebras are my secret"


@contextmanager
def captured(name: str) -> Iterator[list[dict]]:
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


def wait_for(lines: list[dict], pred, timeout: float = 5.0) -> list[dict]:
    """The log line is written when the request ends, which may be just after the client has the response."""
    deadline = time.monotonic() + timeout
    while not (found := [ln for ln in lines if pred(ln)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def scrape(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class AppServer(GatewayServer):
    """GatewayServer over create_app(**kw) (limits, log_prompts)."""

    def __init__(self, backends: list[str], **kw) -> None:
        super().__init__(backends)
        config = uvicorn.Config(
            create_app(backends, **kw), log_level="warning", lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


@pytest.fixture(scope="module")
def limited(scripted) -> Iterator[tuple[httpx.Client, str]]:
    server = AppServer(
        [scripted.address],
        limits=Limits(max_body_bytes=2000, max_concurrent_requests=2, max_n=4),
        log_prompts=True,
    ).start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http, scripted.servicer.model_id
    server.stop()


def chat(model: str, content: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# ---- metrics -------------------------------------------------------------------------------------------


def test_metrics_move_after_a_streamed_and_a_plain_request(scripted_gateway) -> None:
    http, model = scripted_gateway.http, scripted_gateway.model
    before = scrape(http)
    with http.stream("POST", CHAT, json=chat(model, "say:one two three four", stream=True)) as r:
        assert r.status_code == 200
        r.read()
    assert (
        http.post(COMPLETIONS, json={"model": model, "prompt": "say:hi there", "max_tokens": 5}).status_code
        == 200
    )
    assert http.post(CHAT, json=chat(model, "x", n=1000)).status_code == 400
    key400 = 'tpuserve_gateway_requests_total{endpoint="/v1/chat/completions",status="400"}'
    deadline = time.monotonic() + 5  # counted when the request ends, which the client may see first
    while (after := scrape(http)).get(key400, 0) == before.get(key400, 0) and time.monotonic() < deadline:
        time.sleep(0.01)

    def moved(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert moved('tpuserve_gateway_requests_total{endpoint="/v1/chat/completions",status="200"}') == 1
    assert moved('tpuserve_gateway_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert moved('tpuserve_gateway_requests_total{endpoint="/v1/chat/completions",status="400"}') == 1
    assert moved("tpuserve_gateway_time_to_first_token_seconds_count") == 2
    assert moved("tpuserve_gateway_inter_token_latency_seconds_count") > 0
    assert moved("tpuserve_gateway_generated_tokens_total") >= 10
    assert after["tpuserve_gateway_requests_in_flight"] == 0  # /metrics itself is not a /v1 request


# ---- logs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_one_json_log_line_per_request_with_the_response_id_and_no_prompt(scripted_gateway, stream) -> None:
    http, model = scripted_gateway.http, scripted_gateway.model
    with captured("tpuserve.gateway.requests") as lines:
        r = http.post(CHAT, json=chat(model, f"say:hello {SECRET}", stream=stream))
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert rid.startswith("chatcmpl-")
        if not stream:
            assert r.json()["id"] == rid
        else:
            assert f'"id":"{rid}"' in r.text.replace(" ", "")
        found = wait_for(lines, lambda ln: ln["request_id"] == rid)
    assert len(found) == 1
    line = found[0]
    assert line["status"] == 200 and line["path"] == CHAT and line["model"] == model
    assert line["completion_tokens"] > 0 and line["ttft_ms"] is not None and line["finish_reasons"] == ["eos"]
    assert "zebras" not in json.dumps(line) and "prompt" not in line
    assert scripted_gateway.scripted.servicer.requests[-1].request_id == rid  # the backend gets the same id


def test_prompts_are_logged_with_log_prompts(limited) -> None:
    http, model = limited
    with captured("tpuserve.gateway.requests") as lines:
        r = http.post(COMPLETIONS, json={"model": model, "prompt": f"say:{SECRET}", "max_tokens": 3})
        assert r.status_code == 200
        found = wait_for(lines, lambda ln: ln["request_id"] == r.json()["id"])
    assert found and found[0]["prompt"] == f"say:{SECRET}"


def test_request_ids_match_across_gateway_and_backend_logs() -> None:
    """The real servicer (over the fake engine and the embedded model's tokenizer) logs the gateway's id."""
    from tpuserve.model.embedded import default_model_path
    from tpuserve.model.tokenizer import load_tokenizer

    from tests.grpc_service.conftest import ServerThread
    from tests.grpc_service.fake_engine import make_engine

    tokenizer = load_tokenizer(default_model_path())

    backend = ServerThread(make_engine(tokenizer, slots=2, max_seq_len=128, steps_per_call=4), tokenizer)
    gateway = GatewayServer([backend.address]).start()
    try:
        with captured("tpuserve.gateway.requests") as gw, captured("tpuserve.backend.requests") as be:
            r = httpx.post(gateway.url + CHAT, json=chat("fake-smollm2", SECRET, max_tokens=3), timeout=30)
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            assert wait_for(gw, lambda ln: ln["request_id"] == rid)
            found = wait_for(be, lambda ln: ln["request_id"] == rid)
        assert len(found) == 1 and found[0]["code"] == "OK" and found[0]["completion_tokens"] == 3
        assert "zebras" not in json.dumps(found[0])
    finally:
        gateway.stop()
        backend.close()


# ---- limits --------------------------------------------------------------------------------------------


def test_body_over_max_body_bytes_is_413_naming_the_limit(limited) -> None:
    http, model = limited
    body = json.dumps(chat(model, "a" * 3000)).encode()
    err = error_of(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 413)
    assert "max_body_bytes" in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no content-length: counted while read
        for i in range(0, len(body), 500):
            yield body[i : i + 500]

    err = error_of(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert "max_body_bytes" in err["message"]
    assert http.post(CHAT, json=chat(model, "say:ok")).status_code == 200  # still serving


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [(CHAT, {"n": 5}, "n"), (COMPLETIONS, {"n": 5}, "n"), (COMPLETIONS, {"n": 1, "best_of": 5}, "best_of")],
)
def test_n_over_max_n_is_400_naming_it(limited, path, extra, param) -> None:
    http, model = limited
    body = chat(model, "say:x", **extra) if path == CHAT else {"model": model, "prompt": "say:x", **extra}
    err = error_of(http.post(path, json=body), 400)
    assert err["param"] == param and "max_n = 4" in err["message"]
    assert err["type"] == "invalid_request_error"


def test_concurrent_requests_over_the_limit_get_429_with_retry_after(limited) -> None:
    http, model = limited
    body = chat(model, "slow:loop:ab", stream=True, max_tokens=1000)  # ~10 s unless abandoned
    url = str(http.base_url)
    with (
        httpx.Client(base_url=url, timeout=30) as c1,
        httpx.Client(base_url=url, timeout=30) as c2,
        c1.stream("POST", CHAT, json=body) as s1,
        c2.stream("POST", CHAT, json=body) as s2,
    ):
        assert s1.status_code == s2.status_code == 200
        r = http.post(CHAT, json=chat(model, "say:hi"))
        err = error_of(r, 429)
        assert r.headers["retry-after"] == "1"
        assert "max_concurrent_requests = 2" in err["message"] and err["type"] == "rate_limit_error"
        assert http.get("/health").status_code == 200  # outside /v1: not limited
    deadline = time.monotonic() + 10  # the abandoned streams end (their calls are cancelled)
    while (
        r := http.post(CHAT, json=chat(model, "say:hi"))
    ).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_backend_resource_exhausted_is_429_with_retry_after(scripted_gateway, stream) -> None:
    http, model = scripted_gateway.http, scripted_gateway.model
    r = http.post(CHAT, json=chat(model, "fail:RESOURCE_EXHAUSTED:the queue is full", stream=stream))
    err = error_of(r, 429)
    assert r.headers["retry-after"] == "1" and err["message"] == "the queue is full"


def test_gateway_config_yaml_and_flags(tmp_path, capsys) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "gateway:\n  backend: [127.0.0.1:1]\n  max_n: 8\n  max_body_bytes: 1000\n  log_prompts: true\n"
    )
    args = parse_args(["--config", str(cfg), "--max-n", "3", "--port", "9001"])
    assert args.backend == ("127.0.0.1:1",) and args.port == 9001 and args.log_prompts is True
    assert args.limits() == Limits(max_body_bytes=1000, max_concurrent_requests=256, max_n=3)
    assert parse_args(["--backend", "h:1"]).limits() == Limits()
    cfg.write_text("max_bodybytes: 3\nbackend: h:1\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
    cfg.write_text("gateway:\n  backend: h:1\n  max_n: eight\n")  # a value of the wrong type is named
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
    assert "`gateway.max_n` must be an integer, not 'eight'" in capsys.readouterr().err

"""CORS: off by default — no Access-Control-* header on any answer and no preflight; with allowed origins
configured, a browser's preflight succeeds without the API key (browsers send none on preflights), allowed
origins get the CORS headers on results and on errors, and other origins get none."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import API_KEY, GatewayServer
from scripted_backend import MODEL_ID

ORIGIN = "https://app.example.com"
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "say:hi"}], "max_tokens": 4}
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


def cors_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


@pytest.fixture(scope="module")
def cors_gateway(scripted):
    server = GatewayServer([scripted.address], api_key=API_KEY, cors_allow_origins=[ORIGIN]).start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http
    server.stop()


def test_cors_is_off_by_default(scripted_gateway):
    http = scripted_gateway.http
    r = http.post(CHAT, json=BODY, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and cors_headers(r) == {}
    r = http.options(CHAT, headers=PREFLIGHT)
    assert r.status_code == 405 and cors_headers(r) == {}
    assert r.json()["error"]["code"] == "method_not_allowed"


def test_preflight_from_an_allowed_origin_needs_no_key(cors_gateway):
    r = cors_gateway.options(CHAT, headers=PREFLIGHT)
    assert r.status_code == 200, r.text
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == ORIGIN
    assert "POST" in h["access-control-allow-methods"]
    assert "x-stainless-os" in h["access-control-allow-headers"].lower()


def test_allowed_origin_gets_cors_headers_on_results_and_errors(cors_gateway):
    auth = {"Authorization": f"Bearer {API_KEY}", "Origin": ORIGIN}
    r = cors_gateway.post(CHAT, json=BODY, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hi"
    h = cors_headers(r)
    assert h["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in h["access-control-expose-headers"].lower()
    # a browser must be able to read the error body too: wrong key (401), bad body (400)
    r = cors_gateway.post(CHAT, json=BODY, headers={"Origin": ORIGIN, "Authorization": "Bearer wrong"})
    assert r.status_code == 401 and cors_headers(r)["access-control-allow-origin"] == ORIGIN
    r = cors_gateway.post(CHAT, json={"model": MODEL_ID}, headers=auth)
    assert r.status_code == 400 and cors_headers(r)["access-control-allow-origin"] == ORIGIN


def test_other_origins_get_no_cors_headers(cors_gateway):
    r = cors_gateway.options(CHAT, headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in cors_headers(r)
    assert r.json()["error"]["code"] == "cors_not_allowed" and "origin" in r.json()["error"]["message"]
    r = cors_gateway.post(
        CHAT, json=BODY, headers={"Authorization": f"Bearer {API_KEY}", "Origin": "https://evil.example"}
    )
    assert r.status_code == 200 and "access-control-allow-origin" not in cors_headers(r)

"""The logprob playground's routes and static files (no browser: tests/http_gateway/test_playground_browser.py
drives the page itself). The page is served by the gateway from the package, works offline (nothing fetched from
another origin) and stays reachable behind --api-key, since it asks for the key itself."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
from gateway_harness import API_KEY
from tpuserve.http_gateway import playground

REPO = Path(__file__).resolve().parents[2]
FILES = ("index.html", "playground.js", "playground.css")


@pytest.mark.parametrize("path", ["/", "/playground"])
def test_page_is_served_at_root_and_playground(scripted_gateway, path: str) -> None:
    r = scripted_gateway.http.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "logprob playground" in r.text
    assert r.text == (playground.STATIC / "index.html").read_text()
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp


def test_assets_are_served_and_nothing_else(scripted_gateway) -> None:
    http = scripted_gateway.http
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        r = http.get(f"/playground/assets/{name}")
        assert r.status_code == 200, name
        assert r.headers["content-type"].startswith(kind)
        assert r.text == (playground.STATIC / name).read_text()
    for bad in ("index.html.bak", "..%2Fplayground.py", "%2E%2E/app.py", "nope.js"):
        r = http.get(f"/playground/assets/{bad}")
        assert r.status_code == 404, bad
        assert r.json()["error"]["code"] == "not_found"


def test_page_references_resolve_from_both_routes(scripted_gateway) -> None:
    """The page links its assets relatively; from / and from /playground they resolve to the same files."""
    html = (playground.STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(refs) == ["playground/assets/playground.css", "playground/assets/playground.js"]
    for page in ("/", "/playground"):
        for ref in refs:
            url = httpx.URL(scripted_gateway.url + page).join(ref)
            assert scripted_gateway.http.get(url).status_code == 200, (page, ref)


def test_static_files_fetch_nothing_from_the_network() -> None:
    """No CDN, no web fonts, no absolute URLs: the page must work on a machine without internet."""
    for name in FILES:
        text = (playground.STATIC / name).read_text()
        assert not re.search(r"https?://|//cdn|@import", text), name
    css = (playground.STATIC / "playground.css").read_text()
    assert "url(" not in css and "@font-face" not in css
    js = (playground.STATIC / "playground.js").read_text()
    calls = re.findall(r"\bfetch\([^,)]*", js)
    assert calls and all(c.startswith("fetch(url(") for c in calls), calls  # only this gateway's own URLs
    assert not re.search(r"XMLHttpRequest|WebSocket|EventSource|importScripts|import\(", js)


def test_page_is_open_behind_an_api_key_but_the_api_is_not(keyed_gateway) -> None:
    with httpx.Client(base_url=keyed_gateway.url, timeout=10) as anonymous:
        assert anonymous.get("/").status_code == 200
        assert anonymous.get("/playground/assets/playground.js").status_code == 200
        r = anonymous.get("/v1/models")
        assert r.status_code == 401
    assert keyed_gateway.http.get("/v1/models").headers["content-type"] == "application/json"
    assert API_KEY not in (playground.STATIC / "playground.js").read_text()


def test_api_key_is_kept_in_session_storage_only() -> None:
    js = (playground.STATIC / "playground.js").read_text()
    assert "sessionStorage" in js
    assert "localStorage" not in js and "document.cookie" not in js


def test_script_parses() -> None:
    """`node --check`: a syntax error would leave the page dead without failing anything else."""
    subprocess.run(["node", "--check", str(playground.STATIC / "playground.js")], check=True, timeout=30)


def test_files_ship_in_the_package() -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data.get("tpuserve.http_gateway", [])
    for name in FILES:
        assert any(Path("playground", name).match(p) for p in patterns), (name, patterns)

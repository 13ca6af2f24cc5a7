"""The logprob playground in a real headless browser (Debian's Chromium driven by Playwright) against the real
gateway over the real backend on the embedded model.

What the page shows is read back from its DOM (each token is a button carrying its text, logprob, bytes and
alternatives; the popover and the stats are visible text) and compared with a direct call to the JSON API made
with the request the page itself printed as curl. Screenshots of each mode go to $TPUSERVE_SCREENSHOTS (default:
a pytest temporary folder); their paths are printed (`pytest -s` shows them).

Chromium and Playwright are test requirements: when either is missing these tests fail, naming the command that
installs them (`make install-test`); they never skip.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import API_KEY, GatewayServer, requests_in_flight

CHROMIUM = "/usr/bin/chromium"
INSTALL = "make install-test"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EMOJI_CJK = "Pizza 🍕 and sushi 寿司 taste good 🙂"
TOKENS_JS = r"""() => [...document.querySelectorAll('#output .tok')].map(b => ({
    token: b.dataset.token, logprob: b.dataset.logprob, bytes: JSON.parse(b.dataset.bytes),
    alts: JSON.parse(b.dataset.alts), rank: b.dataset.rank, special: b.classList.contains('special'),
    colour: [...b.classList].find(c => /^p(\d|none)$/.test(c)),
    text: b.textContent}))"""


# ---- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"Chromium is not installed ({CHROMIUM} is missing): run `{INSTALL}`.", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"Playwright is not installed in this environment: run `{INSTALL}`.", pytrace=False)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def _start(backend: str, api_key: str | None = None) -> Iterator[str]:
    server = GatewayServer([backend], api_key=api_key).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def gw(real_backend_address: str) -> Iterator[str]:
    """The real gateway (no API key) over the real backend on the embedded model."""
    yield from _start(real_backend_address)


@pytest.fixture(scope="module")
def keyed_gw(real_backend_address: str) -> Iterator[str]:
    """The same, behind `--api-key` (API_KEY)."""
    yield from _start(real_backend_address, api_key=API_KEY)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("TPUSERVE_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("playground-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(page, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"\nplayground screenshot: {path}")


@pytest.fixture
def page(browser, gw: str) -> Iterator[object]:
    yield from _page(browser, gw)


def _until(page, ready: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait until `ready()`, reading the page through locators: page.wait_for_function would evaluate its string
    in the page, which the playground's CSP (script-src 'self', no eval) refuses once it has to poll."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"not ready after {timeout_s} s"
        page.wait_for_timeout(50)


def _page(browser, url: str, width: int = 1100, height: int = 900) -> Iterator[object]:
    """A fresh tab (own session storage) on the playground; fails the test on a script error or on any request
    that leaves the gateway's origin."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=url)
    page = context.new_page()
    errors: list[str] = []
    foreign: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # console errors (a CSP violation reports there); a refused request (the 401 tests) is logged there too
    page.on(
        "console",
        lambda m: (
            errors.append(m.text) if m.type == "error" and "Failed to load resource" not in m.text else None
        ),
    )
    page.on("request", lambda req: None if req.url.startswith(url) else foreign.append(req.url))
    page.goto(url + "/playground")
    _until(page, lambda: page.locator("#model").input_value() != "" or not page.locator("#error").is_hidden())
    yield page
    context.close()
    assert not errors, errors
    assert not foreign, foreign


# ---- helpers ----------------------------------------------------------------------------------------------


def colour(logprob: float | None) -> str:
    """The page's colour class for a probability: the legend's bins."""
    if logprob is None:
        return "pnone"
    p = math.exp(logprob)
    return next(f"p{6 - i}" for i, edge in enumerate((0.9, 0.7, 0.5, 0.3, 0.1, 0.0)) if p >= edge)


def run(page, mode: str, prompt: str, wait: bool = True, **controls: object) -> None:
    """Pick the mode, fill the prompt and the controls (by element id), press Run and wait for the end."""
    page.click(f"#mode-{mode}")
    page.fill("#prompt", prompt)
    for field, value in controls.items():
        page.fill(f"#{field.replace('_', '-')}", str(value))
    page.click("#run")
    if wait:
        page.wait_for_selector("#status[data-phase=done], #status[data-phase=error]", timeout=120_000)


def dom_tokens(page) -> list[dict]:
    return page.evaluate(TOKENS_JS)


def curl_request(page) -> tuple[str, dict]:
    """(url, body) of the request, read from the page's "Copy as code" curl text."""
    page.click("#code-curl")
    words = shlex.split(page.inner_text("#code"))
    assert words[0] == "curl"
    assert "Authorization: Bearer $OPENAI_API_KEY" in words  # the placeholder, never the key
    url = next(w for w in words[1:] if w.startswith("http"))
    return url, json.loads(words[words.index("-d") + 1])


def python_kwargs(page) -> dict:
    """The keyword arguments of the SDK call in the page's Python code (which must compile)."""
    page.click("#code-python")
    code = page.inner_text("#code")
    tree = ast.parse(code)
    compile(tree, "playground.py", "exec")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "create"]
    assert len(calls) == 1, code
    return {kw.arg: ast.literal_eval(kw.value) for kw in calls[0].keywords}


def api(url: str, body: dict, key: str | None = None) -> dict:
    """The same request, not streamed, straight to the JSON API."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def show_alternatives(page, index: int) -> str:
    """Hover token `index`; the popover's text."""
    page.hover(f'#output .tok[data-i="{index}"]')
    page.wait_for_selector("#pop:not([hidden])")
    return page.inner_text("#pop")


# ---- tests ------------------------------------------------------------------------------------------------


def test_chat_stream_renders_what_the_api_returns(page, shots: Path) -> None:
    run(
        page,
        "chat",
        "Name three colours.",
        temperature=1,
        top_p=0.95,
        seed=1234,
        max_tokens=12,
        top_logprobs=5,
        stop="Blue\n\\n",  # two stop strings, one per line; the second is "\n" written as backslash-n
    )
    url, body = curl_request(page)
    assert url.endswith("/v1/chat/completions")
    assert body["stop"] == ["Blue", "\n"]
    assert body["seed"] == 1234 and body["top_logprobs"] == 5 and body["logprobs"] is True
    assert body["stream"] is True and body["max_tokens"] == 12 and body["temperature"] == 1
    assert python_kwargs(page) == body
    expected = api(url, body)["choices"][0]["logprobs"]["content"]
    shown = dom_tokens(page)
    assert [t["token"] for t in shown] == [e["token"] for e in expected]
    assert len(shown) >= 1
    for t, e in zip(shown, expected, strict=True):
        assert float(t["logprob"]) == e["logprob"]
        assert t["colour"] == colour(e["logprob"])
        assert t["bytes"] == e["bytes"]
        assert t["special"] == (e["bytes"] is None)
        assert t["alts"] == [[a["token"], a["logprob"], a["bytes"]] for a in e["top_logprobs"]]
        assert "\ufffd" not in t["text"]
    # the popover: the alternatives with their probabilities and bytes; the sampled one marked
    text = show_alternatives(page, 0)
    first = expected[0]
    for i, alt in enumerate(first["top_logprobs"]):
        assert f"{alt['logprob']:.4f}" in text
        assert f"{math.exp(alt['logprob']):.3f}" in text or math.exp(alt["logprob"]) < 0.001
        if alt["bytes"]:
            assert "".join(f"\\x{b:02x}" for b in alt["bytes"]) in text
        if alt["token"] == first["token"] and alt["bytes"] == first["bytes"]:
            row = page.inner_text("#pop tr.sampled")
            assert "sampled" in row and row.split()[0] == str(i + 1)
    stats = page.get_attribute("#stats", "data-total")
    assert float(stats) == pytest.approx(sum(e["logprob"] for e in expected), abs=1e-9)
    screenshot(page, shots, "chat")


def test_completion_stream_renders_what_the_api_returns(page, shots: Path) -> None:
    run(
        page, "completion", "The capital of France is", temperature=0.8, seed=7, max_tokens=10, top_logprobs=3
    )
    url, body = curl_request(page)
    assert url.endswith("/v1/completions")
    assert body["logprobs"] == 3 and body["seed"] == 7 and body["prompt"] == "The capital of France is"
    assert python_kwargs(page) == body
    page.click("#copy")  # the Python code, as shown, onto the clipboard
    page.wait_for_selector("#status:text('Copied.')")
    assert page.evaluate("navigator.clipboard.readText()") == page.inner_text("#code")
    expected = api(url, body)["choices"][0]["logprobs"]
    shown = dom_tokens(page)
    assert [t["token"] for t in shown] == expected["tokens"]
    for t, lp, top in zip(shown, expected["token_logprobs"], expected["top_logprobs"], strict=True):
        assert float(t["logprob"]) == lp
        assert {a[0]: a[1] for a in t["alts"]} == top
        assert [a[1] for a in t["alts"]] == sorted(top.values(), reverse=True)
        assert t["special"] == t["token"].startswith("<|")  # the EOS entry (if generation ended on it)
    assert page.inner_text("#output .prompt-text") == "The capital of France is"
    text = show_alternatives(page, len(shown) - 1)
    assert "sampled" in text
    screenshot(page, shots, "completion")


def test_score_mode_totals_match_the_echo_logprobs(page, shots: Path) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. Colourless green ideas sleep furiously."
    run(page, "score", prompt, top_logprobs=20)
    url, body = curl_request(page)
    assert body == {"model": body["model"], "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 20}
    assert python_kwargs(page) == body
    expected = api(url, body)["choices"][0]["logprobs"]
    scored = [lp for lp in expected["token_logprobs"] if lp is not None]
    total = sum(scored)
    stats = page.locator("#stats")
    assert float(stats.get_attribute("data-total")) == pytest.approx(total, abs=1e-9)
    assert int(stats.get_attribute("data-count")) == len(scored) == len(expected["tokens"]) - 1
    shown_text = stats.inner_text()
    mean = total / len(scored)
    assert f"total logprob {total:.4f}" in shown_text
    assert f"mean {mean:.4f}" in shown_text
    assert f"perplexity {math.exp(-mean):.3f}" in shown_text
    # the page's Python code runs as it is (official SDK) and prints the same total
    page.click("#code-python")
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    ran = subprocess.run(
        [sys.executable, "-c", page.inner_text("#code")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert f"total logprob {total:.4f}, mean {mean:.4f}" in ran.stdout
    shown = dom_tokens(page)
    assert [t["token"] for t in shown] == expected["tokens"]
    assert shown[0]["logprob"] == "null"
    assert [t["colour"] for t in shown] == [colour(lp) for lp in expected["token_logprobs"]]  # the heat map
    # rank among the alternatives when in the top 20; none otherwise
    ranked = 0
    for t, lp, top in zip(
        shown[1:], expected["token_logprobs"][1:], expected["top_logprobs"][1:], strict=True
    ):
        above = sum(1 for tok, v in top.items() if tok != t["token"] and v > lp)
        assert t["rank"] == (str(above + 1) if above < 20 else ""), t
        ranked += bool(t["rank"])
    assert ranked > 0
    text = show_alternatives(page, 1)
    assert f"rank {shown[1]['rank']} of top 20" in text or "not in the top 20" in text
    screenshot(page, shots, "score")


def test_utf8_split_tokens_show_escaped_bytes_never_replacement_characters(page, shots: Path) -> None:
    run(page, "score", EMOJI_CJK + "<|im_end|>", top_logprobs=5)
    url, body = curl_request(page)
    expected = api(url, body)["choices"][0]["logprobs"]
    split = [i for i, t in enumerate(expected["tokens"]) if "\\x" in t]
    assert split, f"the prompt should split a character across tokens: {expected['tokens']}"
    shown = dom_tokens(page)
    for i in split:
        assert shown[i]["token"] == expected["tokens"][i]
        assert shown[i]["text"] == expected["tokens"][i]  # shown as \xNN, as the API writes it
        assert "\\x" in page.inner_text(f'#output .tok[data-i="{i}"] .esc')
    assert "\ufffd" not in page.inner_text("#output")
    text = show_alternatives(page, split[0])
    assert "\\x" in text and "\ufffd" not in text
    # the special token typed at the end is marked as one (no bytes)
    assert expected["tokens"][-1] == "<|im_end|>"
    assert shown[-1]["special"] and shown[-1]["bytes"] is None
    assert "special" in show_alternatives(page, len(shown) - 1)
    screenshot(page, shots, "utf8-split")


def test_wrong_api_key_shows_the_401_message(browser, keyed_gw: str, shots: Path) -> None:
    for page in _page(browser, keyed_gw):
        assert "401" in page.inner_text("#error")  # /v1/models without a key
        assert "You didn't provide an API key." in page.inner_text("#error")
        page.fill("#api-key", API_KEY)
        page.press("#api-key", "Tab")  # change: the models load with the key
        _until(page, lambda page=page: page.locator("#model").input_value() != "")
        assert page.is_hidden("#error")
        page.fill("#api-key", "sk-wrong")
        run(page, "score", "Hello there.", top_logprobs=2)
        error = page.inner_text("#error")
        assert "401" in error and "Incorrect API key provided." in error
        assert page.get_attribute("#status", "data-phase") == "error"
        screenshot(page, shots, "wrong-api-key")
        page.fill("#api-key", API_KEY)
        run(page, "score", "Hello there.", top_logprobs=2)
        assert page.is_hidden("#error")
        assert page.locator("#output .tok").count() > 1
        stored = page.evaluate("[sessionStorage.getItem('tpuserve-playground-api-key'), localStorage.length]")
        assert stored == [API_KEY, 0]
        assert API_KEY not in page.inner_text("#code")


def test_stop_cancels_the_stream(page, gw: str, request: pytest.FixtureRequest) -> None:
    backend = None if os.environ.get("TPUSERVE_TEST_BACKEND") else request.getfixturevalue("real_backend")

    def backend_busy() -> int:  # decode slots holding a sample plus requests waiting for one
        orch = backend.orchestrator
        return orch.engine.slots - orch.free_slots + orch.queued

    run(
        page,
        "chat",
        "Tell me a very long story about a dragon.",
        wait=False,
        temperature=1,
        seed=3,
        max_tokens=200,
        top_logprobs=2,
    )
    page.wait_for_selector("#output .tok")
    if backend is not None:
        assert backend_busy() > 0
    page.click("#stop-button")
    page.wait_for_selector("#status[data-phase=stopped]")
    assert "Stopped" in page.inner_text("#status")
    assert page.is_disabled("#stop-button") and page.is_enabled("#run")
    deadline = time.monotonic() + 20
    while (
        requests_in_flight(gw) or (backend is not None and backend_busy())
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_in_flight(gw) == 0
    if backend is not None:
        assert backend_busy() == 0
    assert page.locator("#output .tok").count() < 200  # cut short, not run to the end


def test_keyboard_and_narrow_screen(browser, gw: str, shots: Path) -> None:
    for page in _page(browser, gw, width=360, height=780):
        page.click("#mode-chat")
        page.fill("#prompt", "Say hello.")
        page.fill("#max-tokens", "8")
        page.fill("#seed", "5")
        page.press("#prompt", "Control+Enter")  # runs from the keyboard
        page.wait_for_selector("#status[data-phase=done]", timeout=120_000)
        width = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert width[0] <= width[1] == 360, width  # nothing wider than the screen
        first = page.locator('#output .tok[data-i="0"]')
        first.focus()
        page.wait_for_selector("#pop:not([hidden])")  # focus shows the alternatives
        page.keyboard.press("Enter")  # pins them
        assert first.get_attribute("aria-expanded") == "true"
        box = page.locator("#pop").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 360
        screenshot(page, shots, "narrow-360")
        page.keyboard.press("ArrowRight")
        assert page.evaluate("document.activeElement.dataset.i") == "1"
        assert page.get_attribute("#pop", "data-for") == "1"
        page.keyboard.press("Space")
        page.keyboard.press("Escape")
        assert page.is_hidden("#pop")
        assert page.evaluate("document.activeElement.dataset.i") == "1"
        # the mode tabs and the code tabs work from the keyboard too
        page.focus("#mode-chat")
        page.keyboard.press("ArrowRight")
        assert page.get_attribute("#mode-completion", "aria-selected") == "true"

"""Gateway fixtures: a real uvicorn server per backend kind, session-scoped.

- `scripted` / `scripted_gateway`: the scripted gRPC backend (tests/http_gateway/scripted_backend.py) whose
  outputs the tests control through the prompt; most tests use these (fast, exact expectations).
- `gateway`: parametrized over backend kinds, for the tests that assert only what holds for any backend
  (the seed reports, streamed == non-streamed, EOS accounting, SDK round trips, errors). Kind "real" uses the
  `real_backend_address` fixture (tests/conftest.py: the gRPC backend over the shared warmed engine). Real
  generation costs seconds per request on CPU: keep that set small and its max_tokens low.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import openai_spec
from gateway_harness import API_KEY, GatewayServer
from scripted_backend import ScriptedBackend

from tests.helpers import free_port


@dataclass
class Gateway:
    url: str
    model: str
    kind: str
    http: httpx.Client
    scripted: ScriptedBackend | None = None


def _gateway(
    backends: list[str], kind: str, scripted: ScriptedBackend | None = None, api_key: str | None = None
) -> Iterator[Gateway]:
    server = GatewayServer(backends, api_key=api_key).start()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=server.url, timeout=30, headers=headers) as http:
        models = http.get("/v1/models").json()
        model = models["data"][0]["id"] if models.get("data") else ""
        yield Gateway(server.url, model, kind, http, scripted)
    server.stop()


@pytest.fixture(scope="session")
def scripted() -> Iterator[ScriptedBackend]:
    backend = ScriptedBackend().start()
    yield backend
    backend.stop()


@pytest.fixture(scope="session")
def scripted_gateway(scripted: ScriptedBackend) -> Iterator[Gateway]:
    yield from _gateway([scripted.address], "scripted", scripted)


@pytest.fixture(scope="session", params=["scripted", "real"])
def gateway(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    if request.param == "scripted":
        yield request.getfixturevalue("scripted_gateway")
        return
    yield from _gateway([request.getfixturevalue("real_backend_address")], "real")


@pytest.fixture(scope="session")
def keyed_gateway(scripted: ScriptedBackend) -> Iterator[Gateway]:
    """The gateway with an API key (its client sends the right bearer token)."""
    yield from _gateway([scripted.address], "scripted", scripted, api_key=API_KEY)


@pytest.fixture(scope="session")
def dead_gateway() -> Iterator[Gateway]:
    """A gateway whose only backend address has nothing listening."""
    yield from _gateway([f"127.0.0.1:{free_port()}"], "dead")


@pytest.fixture(scope="session")
def spec() -> object:
    """The OpenAPI schema validator module (its checks fail, never skip, when the spec file is absent)."""
    return openai_spec

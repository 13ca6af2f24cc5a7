"""The FastAPI app: routes, bearer auth, and the backend pool's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tpuserve.http_gateway import chat, completions
from tpuserve.http_gateway.auth import BearerAuth
from tpuserve.http_gateway.backends import BackendPool
from tpuserve.http_gateway.errors import APIError, install_handlers
from tpuserve.http_gateway.observability import GatewayMetrics, Limits, Observe, note_request
from tpuserve.http_gateway.request_models import ChatCompletionRequest, CompletionRequest
from tpuserve.http_gateway.request_parsing import parse_request
from tpuserve.http_gateway.response_models import ModelCard, ModelList, OpenAIObject

OWNED_BY = "tpuserve"
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: OpenAIObject) -> Response:
    return Response(body.dump(), media_type="application/json")


def _respond(result: OpenAIObject | AsyncIterator[str]) -> Response:
    if isinstance(result, OpenAIObject):
        return _json(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work` (a backend call) but cancels it when the client goes away first, so that an abandoned
    request frees its backend slots. Streams watch for themselves once the response has started."""
    task = asyncio.ensure_future(work)
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone:
            raise APIError(
                499, "The client closed the request.", "invalid_request_error", None, "client_closed_request"
            ) from None
        raise
    finally:
        watcher.cancel()


def create_app(
    backends: list[str],
    api_key: str | None = None,
    pool: BackendPool | None = None,
    limits: Limits | None = None,
    log_prompts: bool = False,
) -> FastAPI:
    """The OpenAI-compatible gateway in front of gRPC `backends` ("host:port"). With `api_key`, /v1/* needs
    `Authorization: Bearer <api_key>`; /health and /metrics stay open. `limits`: body size, concurrency, n."""
    pool = pool or BackendPool(backends)
    limits = limits or Limits()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(
        title="tpuserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.pool = pool
    install_handlers(app)
    app.state.metrics = metrics
    app.state.limits = limits
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(Observe, metrics=metrics, limits=limits, log_prompts=log_prompts)  # outermost

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest)
        note_request(req.model, lambda: [m.model_dump() for m in req.messages])
        limits.check_n(req.n)
        return _respond(await _unless_disconnected(request, chat.create(pool, req)))

    @app.post("/v1/completions")
    async def legacy_completions(request: Request) -> Response:
        req = parse_request(await request.body(), CompletionRequest)
        note_request(req.model, lambda: req.prompt)
        limits.check_n(req.n, req.best_of)
        return _respond(await _unless_disconnected(request, completions.create(pool, req)))

    @app.get("/v1/models")
    async def models() -> Response:
        await pool.refresh(missing_only=True)
        cards = [
            ModelCard(id=m, object="model", created=info.created, owned_by=OWNED_BY)
            for m, info in sorted(pool.models().items())
        ]
        return _json(ModelList(object="list", data=cards))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        info = await pool.info(model_id)
        return _json(ModelCard(id=info.model_id, object="model", created=info.created, owned_by=OWNED_BY))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        if await pool.healthy():
            return JSONResponse({"status": "ok"})
        return APIError(503, "No backend is serving.", "server_error", None, "service_unavailable").response()

    return app

"""The FastAPI app: routes, bearer auth, and the backend pool's lifetime."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from tpuserve.http_gateway import chat, completions
from tpuserve.http_gateway.backends import BackendPool
from tpuserve.http_gateway.errors import APIError, install_handlers
from tpuserve.http_gateway.request_models import ChatCompletionRequest, CompletionRequest
from tpuserve.http_gateway.request_parsing import parse_request
from tpuserve.http_gateway.response_models import ModelCard, ModelList, OpenAIObject

OWNED_BY = "tpuserve"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: OpenAIObject) -> Response:
    return Response(body.dump(), media_type="application/json")


def _respond(result: OpenAIObject | AsyncIterator[str]) -> Response:
    if isinstance(result, OpenAIObject):
        return _json(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


def _auth_middleware(
    api_key: str,
) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                message = "You didn't provide an API key." if not given else "Incorrect API key provided."
                return APIError(401, message, "invalid_request_error", None, "invalid_api_key").response()
        return await call_next(request)

    return check


def create_app(backends: list[str], api_key: str | None = None, pool: BackendPool | None = None) -> FastAPI:
    """The OpenAI-compatible gateway in front of gRPC `backends` ("host:port"). With `api_key`, /v1/* needs
    `Authorization: Bearer <api_key>`; /health stays open."""
    pool = pool or BackendPool(backends)

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
    if api_key:
        app.middleware("http")(_auth_middleware(api_key))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest)
        return _respond(await chat.create(pool, req))

    @app.post("/v1/completions")
    async def legacy_completions(request: Request) -> Response:
        req = parse_request(await request.body(), CompletionRequest)
        return _respond(await completions.create(pool, req))

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

    @app.get("/health")
    async def health() -> Response:
        if await pool.healthy():
            return JSONResponse({"status": "ok"})
        return APIError(503, "No backend is serving.", "server_error", None, "service_unavailable").response()

    return app

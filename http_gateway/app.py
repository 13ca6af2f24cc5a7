"""The FastAPI app: routes, bearer auth, and the backend pool's lifetime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from tpuserve.http_gateway import chat, completions, openapi, responses
from tpuserve.http_gateway.admin import add_admin_routes
from tpuserve.http_gateway.auth import BearerAuth
from tpuserve.http_gateway.backends import BackendPool, BackendTLS
from tpuserve.http_gateway.completion_objects import ModelCard, ModelList, OpenAIObject
from tpuserve.http_gateway.errors import APIError, install_handlers
from tpuserve.http_gateway.observability import GatewayMetrics, Limits, Observe, note_request
from tpuserve.http_gateway.playground import add_playground_routes
from tpuserve.http_gateway.request_models import ChatCompletionRequest, CompletionRequest
from tpuserve.http_gateway.request_parsing import parse_request
from tpuserve.http_gateway.responses_request import CreateResponseRequest

OWNED_BY = "tpuserve"
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(body: OpenAIObject) -> Response:
    return Response(body.dump(), media_type="application/json")


def _respond(result: OpenAIObject | AsyncIterator[str]) -> Response:
    if isinstance(result, OpenAIObject):
        return _json(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


class _CORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the OpenAI error shape instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        error = APIError(400, f"{response.body.decode()}.", "invalid_request_error", None, "cors_not_allowed")
        return error.response()


def _is_json(content_type: str | None) -> bool:
    """No Content-Type (some minimal clients) is read as JSON; otherwise application/json or a +json type."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _json_body(request: Request) -> bytes:
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        raise APIError(
            415,
            f"Unsupported Content-Type '{content_type}': send the body as JSON with "
            "'Content-Type: application/json'.",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
    return await request.body()


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
    cors_allow_origins: list[str] | None = None,
    backend_tls: BackendTLS | None = None,
    admin_key: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible gateway in front of gRPC `backends` ("host:port"). With `api_key`, /v1/* needs
    `Authorization: Bearer <api_key>`; /health, /metrics and /openapi.json stay open. `limits`: body size,
    concurrency, n. `cors_allow_origins`: browser origins allowed to call the API (CORS is off without them;
    "*" allows any). `backend_tls`: reach the backends over TLS. `pool`: a ready-made pool (tests), which brings
    its own TLS and timeout settings (`backend_tls` and `limits.request_timeout_s` are then not used).
    `admin_key`: serve POST /v1/admin/update_weights under this bearer key (http_gateway/admin.py); None: no
    such route."""
    limits = limits or Limits()
    pool = pool or BackendPool(backends, tls=backend_tls, request_timeout_s=limits.request_timeout_s)
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
    app.add_middleware(Observe, metrics=metrics, limits=limits, log_prompts=log_prompts)
    if cors_allow_origins:  # outermost: preflights carry no API key, and every answer gets the CORS headers
        app.add_middleware(
            _CORS,
            allow_origins=list(cors_allow_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # the SDKs send x-stainless-* and OpenAI-* headers
            expose_headers=["x-request-id", "Retry-After"],
            max_age=600,
        )
    _add_api_routes(app, pool, limits)
    if admin_key:
        add_admin_routes(app, pool, admin_key)
    _add_service_routes(app, pool, metrics, openapi.build(api_key=bool(api_key)))
    add_playground_routes(app)  # the logprob playground page at / and /playground (open: it asks for the key)
    return app


def _add_api_routes(app: FastAPI, pool: BackendPool, limits: Limits) -> None:
    """The OpenAI routes under /v1."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(await _json_body(request), ChatCompletionRequest)
        note_request(req.model, lambda: [m.model_dump() for m in req.messages])
        limits.check_n(req.n)
        return _respond(await _unless_disconnected(request, chat.create(pool, req)))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = parse_request(await _json_body(request), CreateResponseRequest)
        note_request(req.model, lambda: responses.request_summary(req))
        return _respond(await _unless_disconnected(request, responses.create(pool, req)))

    @app.post("/v1/completions")
    async def legacy_completions(request: Request) -> Response:
        req = parse_request(await _json_body(request), CompletionRequest)
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


def _add_service_routes(app: FastAPI, pool: BackendPool, metrics: GatewayMetrics, document: dict) -> None:
    """The open routes: the OpenAPI document, Prometheus metrics, health."""

    @app.get("/openapi.json")
    async def openapi_document() -> Response:
        return JSONResponse(document)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        """200 when a backend serves; 503 otherwise. Both say where each backend is (`readiness`); the 200 also
        gives the KV pool's page counts of each backend that pages its KV cache (`pages`, {} when none does)."""
        serving, (readiness, pages, versions) = await asyncio.gather(pool.healthy(), pool.readiness())
        if serving:
            return JSONResponse(
                {"status": "ok", "backends": readiness, "pages": pages, "weight_versions": versions}
            )
        detail = "; ".join(f"{address}: {state}" for address, state in readiness.items())
        error = APIError(
            503, f"No backend is serving ({detail}).", "server_error", None, "service_unavailable"
        )
        return error.response()

"""Gateway limits, Prometheus metrics and per-request JSON log lines, as one plain ASGI middleware.

Each request gets a `RequestRecord` (a context variable, so the token-timing code in backend_messages.py finds it,
also inside streaming responses): its id is the response id (`chatcmpl-...`, `cmpl-...`), sent to the backend
as `GenerateRequest.request_id` (a completions request with several prompts sends `<id>-<i>`), returned in
the `x-request-id` header and logged on both sides. Prompts are logged only with `log_prompts`."""

from __future__ import annotations

import contextvars
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tpuserve.http_gateway.errors import APIError, invalid_request
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

request_log = logging.getLogger("tpuserve.gateway.requests")

_PROBES = ("/health", "/metrics")
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class Limits:
    """Per-gateway limits; exceeding one is an OpenAI-shaped 413/429/400 that names it."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_requests: int = 256  # /v1/* requests in flight (streams count until they end)
    max_n: int = 16  # samples per request (`n`, and `best_of` for completions)
    request_timeout_s: float | None = None  # the backend call's gRPC deadline (queueing included); then 504

    def check_n(self, n: int | None, best_of: int | None = None) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.max_n:
                raise invalid_request(
                    f"'{name}' is {value}, more than this server's limit max_n = {self.max_n}.",
                    name,
                    "limit_exceeded",
                )


class GatewayMetrics:
    """Metrics of one gateway app, in its own registry (several apps in one process do not collide)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tpuserve_gateway_requests",
            "HTTP requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tpuserve_gateway_requests_in_flight",
            "/v1/* requests being served (streams until they end).",
            registry=r,
        )
        self.ttft = Histogram(
            "tpuserve_gateway_time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.itl = Histogram(
            "tpuserve_gateway_inter_token_latency_seconds",
            "Time between a sample's consecutive tokens (a message's gap spread over its tokens).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.tokens = Counter(
            "tpuserve_gateway_generated_tokens", "Tokens generated (all samples).", registry=r
        )
        self.rejected = Counter(
            "tpuserve_gateway_limit_rejections", "Requests refused by a gateway limit.", ["limit"], registry=r
        )


@dataclass
class RequestRecord:
    metrics: GatewayMetrics
    log_prompts: bool
    start: float = field(default_factory=time.monotonic)
    request_id: str = ""
    model: str | None = None
    prompt: object = None
    first_token: float | None = None
    last: dict[int, float] = field(default_factory=dict)
    tokens: int = 0
    finish: list[str] = field(default_factory=list)
    error: str | None = None

    def on_message(self, msg: pb.GenerateResponse) -> None:
        """Token timing of one backend message (called for every message of every prompt's stream)."""
        k = len(msg.tokens)
        if k:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.start)
            last = self.last.get(msg.index)
            if last is not None:
                gap = (now - last) / k
                for _ in range(k):
                    self.metrics.itl.observe(gap)
            self.last[msg.index] = now
            self.tokens += k
            self.metrics.tokens.inc(k)
        if msg.finished:
            self.finish.append(pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower())


current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "tpuserve_request", default=None
)


def new_request_id(prefix: str) -> str:
    """The response id for this request (`<prefix>-<hex>`), remembered for its log line and header."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    rec = current.get()
    if rec is not None:
        rec.request_id = request_id
    return request_id


def note_request(model: str, prompt: Callable[[], object]) -> None:
    """The request's model, and its prompt (built only when prompts are logged)."""
    rec = current.get()
    if rec is not None:
        rec.model = model
        if rec.log_prompts:
            rec.prompt = prompt()


def on_message(msg: pb.GenerateResponse) -> None:
    rec = current.get()
    if rec is not None:
        rec.on_message(msg)


def on_stream_error(code: str | None) -> None:
    rec = current.get()
    if rec is not None:
        rec.error = code or "error"


def _endpoint(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class Observe:
    """Outermost middleware: body-size and concurrency limits, metrics, one JSON log line per request."""

    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics, limits: Limits, log_prompts: bool = False
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.limits = limits
        self.log_prompts = log_prompts
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = _endpoint(path)
        limited = path.startswith("/v1/")
        rec = RequestRecord(self.metrics, self.log_prompts)
        status = 500
        rejection = self._check_limits(scope) if limited else None

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if rec.request_id:
                    message = dict(message)
                    message["headers"] = [
                        *message.get("headers", []),
                        (b"x-request-id", rec.request_id.encode()),
                    ]
            await send(message)

        received = 0
        max_body = self.limits.max_body_bytes

        async def receive_wrapper() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    self.metrics.rejected.labels("max_body_bytes").inc()
                    raise _too_large(max_body)
            return message

        token = current.set(rec)
        if limited:
            self.in_flight += 1
            self.metrics.in_flight.inc()
        try:
            if rejection is not None:
                await rejection.response()(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            if limited:
                self.in_flight -= 1
                self.metrics.in_flight.dec()
            current.reset(token)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if limited or status >= 400:
                self._log(scope, rec, status)

    def _check_limits(self, scope: Scope) -> APIError | None:
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            self.metrics.rejected.labels("max_body_bytes").inc()
            return _too_large(self.limits.max_body_bytes)
        if self.in_flight >= self.limits.max_concurrent_requests:
            self.metrics.rejected.labels("max_concurrent_requests").inc()
            return APIError(
                429,
                f"The server is at its limit max_concurrent_requests = {self.limits.max_concurrent_requests}; "
                "retry later.",
                "rate_limit_error",
                None,
                "rate_limit_exceeded",
            )
        return None

    def _log(self, scope: Scope, rec: RequestRecord, status: int) -> None:
        now = time.monotonic()
        fields = {
            "event": "request",
            "request_id": rec.request_id or None,
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "model": rec.model,
            "duration_ms": round((now - rec.start) * 1000, 2),
            "ttft_ms": None if rec.first_token is None else round((rec.first_token - rec.start) * 1000, 2),
            "completion_tokens": rec.tokens,
            "finish_reasons": rec.finish,
        }
        if rec.error:
            fields["stream_error"] = rec.error
        if rec.log_prompts and rec.prompt is not None:
            fields["prompt"] = rec.prompt
        # Probes (health checks, scrapes) come every few seconds: a line each only at debug level, unless they
        # fail otherwise than "not ready yet" (503 while the backend warms up, which it logs itself).
        probe = scope["path"] in _PROBES and (status < 400 or status == 503)
        request_log.log(
            logging.DEBUG if probe else logging.INFO,
            "%s %s %d %s", scope["method"], scope["path"], status, rec.request_id, extra={"fields": fields},
        )  # fmt: skip


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit max_body_bytes = {limit} bytes.",
        "invalid_request_error",
        None,
        "request_too_large",
    )

"""Bearer-token auth for /v1/* as plain ASGI middleware (no BaseHTTPMiddleware in the streaming path)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send
from tpuserve.http_gateway.errors import APIError


class BearerAuth:
    """Rejects /v1/* requests whose `Authorization` is not `Bearer <api_key>` with OpenAI's 401 body.
    The comparison is constant-time; /health stays open for load balancers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                message = "You didn't provide an API key." if not given else "Incorrect API key provided."
                error = APIError(401, message, "invalid_request_error", None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

"""Bearer-token auth for /v1/* as plain ASGI middleware (no BaseHTTPMiddleware in the streaming path)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send
from tpuserve.http_gateway.errors import APIError

ADMIN = "/v1/admin/"


def bearer_matches(headers: list[tuple[bytes, bytes]], key: str) -> tuple[bool, bool]:
    """(whether an Authorization header was sent, whether it is `Bearer <key>`), compared in constant time."""
    given = next((v for k, v in headers if k == b"authorization"), b"")
    return bool(given), hmac.compare_digest(given, f"Bearer {key}".encode())


class BearerAuth:
    """Rejects /v1/* requests whose `Authorization` is not `Bearer <api_key>` with OpenAI's 401 body.
    The comparison is constant-time; /health stays open for load balancers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /v1/admin/* checks its own key (the admin key, never the API key)
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1/")
            and not scope["path"].startswith(ADMIN)
        ):
            given, ok = bearer_matches(scope["headers"], self.api_key)
            if not ok:
                message = "You didn't provide an API key." if not given else "Incorrect API key provided."
                error = APIError(401, message, "invalid_request_error", None, "invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

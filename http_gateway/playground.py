"""The logprob playground: a static page (HTML, CSS, JS in `playground/`, no build step, no network fetches) that
calls this gateway's own /v1 API from the browser and colours tokens by probability.

`GET /` and `GET /playground` serve the page; `GET /playground/assets/<file>` its script and stylesheet. The routes
are open (no API key): the page asks for the key and sends it as the bearer header of its /v1 calls. A strict
Content-Security-Policy keeps the page to this origin (no CDN, no third-party fetches)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from tpuserve.http_gateway.errors import APIError

STATIC = Path(__file__).parent / "playground"
ASSETS = {"playground.js": "text/javascript", "playground.css": "text/css"}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_playground_routes(app: FastAPI) -> None:
    """The page at / and /playground, its assets under /playground/assets/."""

    async def page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground", page, methods=["GET"], include_in_schema=False)

    @app.get("/playground/assets/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        media_type = ASSETS.get(name)
        if media_type is None:  # only the known files: no path ever reaches the filesystem from the URL
            raise APIError(404, f"No playground asset '{name}'.", "invalid_request_error", None, "not_found")
        return FileResponse(STATIC / name, media_type=f"{media_type}; charset=utf-8", headers=HEADERS)

"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure, with the status
codes OpenAI uses. gRPC status codes from a backend map onto the same shape."""

from __future__ import annotations

import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tpuserve.http_gateway.completion_objects import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error that renders as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        headers = None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif self.status == 429:  # overload (gateway limit or backend queue full): a short, fixed back-off
            headers = {"Retry-After": RETRY_AFTER_S}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def missing_parameter(param: str) -> APIError:
    """400 for a required field left out, in OpenAI's wording."""
    return invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def unsupported(param: str, detail: str = "") -> APIError:
    extra = f" {detail}" if detail else ""
    return invalid_request(
        f"'{param}' is not supported by this server.{extra}", param, "unsupported_parameter"
    )


_GRPC_STATUS: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
    # a weight update with abort_in_flight ended the request: retrying it is right (the SDKs retry a 503)
    grpc.StatusCode.ABORTED: (503, "server_error", "aborted"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
}


def from_grpc(err: grpc.aio.AioRpcError) -> APIError:
    """A backend's gRPC status as the matching HTTP error; the backend's message is passed through."""
    status, type_, code = _GRPC_STATUS.get(err.code(), (500, "server_error", "backend_error"))
    message = err.details() or err.code().name
    if status >= 500 and err.code() not in _GRPC_STATUS:
        log.error("backend error %s: %s", err.code().name, message)
    return APIError(status, message, type_, None, code)


def install_handlers(app: FastAPI) -> None:
    """Every error leaves the app in the OpenAI shape: never FastAPI's 422 or Starlette's `{"detail"}`."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        loc = [str(p) for p in errors[0]["loc"][1:]] if errors else []
        msg = errors[0]["msg"] if errors else "invalid request"
        return invalid_request(msg, ".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), type_, None, code).response()

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _grpc(_: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return from_grpc(exc).response()

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(
            500,
            "The server had an error while processing your request.",
            "server_error",
            None,
            "internal_error",
        ).response()

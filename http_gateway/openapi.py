"""The gateway's own OpenAPI 3.1 document, served at GET /openapi.json.

The routes parse their bodies themselves (request_parsing.py: strict JSON, our error messages), so FastAPI cannot
infer the document; it is built here from the same pydantic models that validate requests and render responses,
so it cannot drift from them. Streaming (`stream: true`) answers `text/event-stream` whose `data:` events are
`ChatCompletionChunk` / `Completion` objects, then `[DONE]`; /v1/responses streams the Responses API's
events, each as `event: <type>` + `data: <json>`, without `[DONE]`. Every error is an `ErrorResponse`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from tpuserve.http_gateway.completion_objects import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from tpuserve.http_gateway.request_models import ChatCompletionRequest, CompletionRequest
from tpuserve.http_gateway.responses_objects import Response
from tpuserve.http_gateway.responses_request import CreateResponseRequest

_REF = "#/components/schemas/{model}"
VERSION = "0.1.0"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _components() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    models = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (ChatCompletion, "serialization"),
        (ChatCompletionChunk, "serialization"),
        (Completion, "serialization"),
        (CreateResponseRequest, "validation"),
        (Response, "serialization"),
        (ModelList, "serialization"),
        (ModelCard, "serialization"),
        (ErrorResponse, "serialization"),
    ]
    for model, mode in models:
        schema = model.model_json_schema(ref_template=_REF, mode=mode)
        for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
            if schemas.setdefault(name, sub) != sub:  # two models of one name would silently clash
                raise RuntimeError(f"OpenAPI component {name!r} is defined twice, differently")
    return schemas


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


_ERROR_CODES = {
    "400": "Invalid request: malformed JSON, a wrong field, an unsupported parameter or a limit (max_n).",
    "401": "Missing or wrong API key (only when the gateway has one).",
    "404": "Unknown model.",
    "413": "The body is larger than max_body_bytes.",
    "415": "The Content-Type is not application/json.",
    "429": "Over max_concurrent_requests or the backend's queue is full; see Retry-After.",
    "503": "No backend is serving.",
}


def _errors(codes: tuple[str, ...]) -> dict[str, Any]:
    return {c: {"description": _ERROR_CODES[c], "content": _json(ErrorResponse)} for c in codes}


def _generation(
    summary: str, request: type[BaseModel], response: type[BaseModel], chunk: str, done: bool = True
) -> dict:
    end = ", then `data: [DONE]`" if done else " (`event:` + `data:` lines, no `[DONE]`)"
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": f"The result; with `stream: true` an SSE stream of `{chunk}` events{end}.",
                    "content": {
                        **_json(response),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(("400", "401", "404", "413", "415", "429", "503")),
                "5XX": {"description": "Backend failure.", "content": _json(ErrorResponse)},
            },
        }
    }


def build(api_key: bool = False) -> dict[str, Any]:
    """The document; with `api_key`, the /v1/* operations declare bearer auth."""
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generation(
            "Create a chat completion", ChatCompletionRequest, ChatCompletion, "ChatCompletionChunk"
        ),
        "/v1/completions": _generation(
            "Create a (legacy) completion", CompletionRequest, Completion, "Completion"
        ),
        "/v1/responses": _generation(
            "Create a model response (OpenAI Responses API; no state is kept)",
            CreateResponseRequest,
            Response,
            "ResponseStreamEvent",
            done=False,
        ),
        "/v1/models": {
            "get": {
                "summary": "List the served models",
                "responses": {"200": {"description": "The models.", "content": _json(ModelList)}},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {"description": "The model.", "content": _json(ModelCard)},
                    **_errors(("404", "503")),
                },
            }
        },
        "/health": {
            "get": {
                "summary": "200 when a backend serves, else 503",
                "responses": {
                    "200": {
                        "description": "Serving: `{status: ok, backends: {address: readiness}, pages: {address: "
                        "{page_tokens, total, used, shared, cached, free, preemptions}}}` (pages: the backends "
                        "that page their KV cache)."
                    },
                    **_errors(("503",)),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {"description": "Prometheus text format.", "content": {"text/plain": {}}}
                },
            }
        },
    }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tpuserve gateway", "version": VERSION},
        "paths": paths,
        "components": {"schemas": _components()},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path.startswith("/v1/"):
                for op in item.values():
                    op["security"] = [{"bearer": []}]
                    op["responses"].setdefault("401", _errors(("401",))["401"])
    return doc

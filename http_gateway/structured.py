"""Structured outputs: OpenAI's `response_format` (chat) and `text.format` (Responses) -> proto `GuidedDecoding`.

The backend constrains decoding with the grammar (llguidance, a token mask on the device), so the output parses
and validates unless `max_tokens` cuts it. The gateway checks the request's shape (a name the spec allows, a
schema that is a JSON object) and leaves the schema's meaning to the backend, whose refusal
(INVALID_ARGUMENT "guided...: <why>": not valid JSON Schema, a `$ref` the library cannot take) becomes a 400
naming the request's own field through `name_guided_error`.

For the Responses API (flat `text.format`: {type: "json_schema", name, schema, strict, description}) use the
plain-value functions: `check_format_name`, `guided_json_schema(schema, param)`, `guided_json_object()` and
`name_guided_error(err, param)`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tpuserve.http_gateway.errors import APIError, invalid_request, missing_parameter
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

# The spec's rule for `json_schema.name` and function names: a-z, A-Z, 0-9, underscores and dashes, at most 64.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
GUIDED_ERROR_PREFIX = "guided"  # the backend's INVALID_ARGUMENT messages about a grammar start with it
# Objects and arrays nested in one schema, at most: real schemas stay far below; deeper ones would only exhaust
# the recursion of whoever walks them (copying, serializing, compiling the grammar) into a 500.
MAX_SCHEMA_DEPTH = 64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: `name` is required by the spec; `schema` absent means any JSON value."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """Chat's `response_format`: one model for the three types (not a tagged union), so that a validation error
    names `response_format.json_schema.name`, not a union member."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def check(self, param: str = "response_format") -> None:
        """400 naming the field for what the types cannot hold (json_schema's object on the wrong type)."""
        if self.type == "json_schema":
            if self.json_schema is None:
                raise missing_parameter(f"{param}.json_schema")
            check_format_name(self.json_schema.name, f"{param}.json_schema.name")
        elif self.json_schema is not None:
            raise invalid_request(
                f"'{param}.json_schema' is only allowed when '{param}.type' is 'json_schema'.",
                f"{param}.json_schema",
                "invalid_value",
            )

    def guided(self, param: str = "response_format") -> pb.GuidedDecoding | None:
        """The constraint for this format (None for text). Call `check` first."""
        if self.type == "json_object":
            return guided_json_object()
        if self.type == "json_schema":
            assert self.json_schema is not None
            return guided_json_schema(self.json_schema.schema_, f"{param}.json_schema.schema")
        return None


def check_format_name(name: str, param: str) -> None:
    """The spec's name rule (a-z, A-Z, 0-9, _ and -, 1..64 characters): 400 naming `param` otherwise."""
    if not NAME_RE.fullmatch(name):
        raise invalid_request(
            f"Invalid '{param}': '{name[:80]}'. Expected a string that matches the pattern '^[a-zA-Z0-9_-]+$' "
            "with at most 64 characters.",
            param,
            "invalid_value",
        )


def check_schema_depth(schema: Any, param: str) -> None:
    """At most MAX_SCHEMA_DEPTH objects and arrays nested (walked iteratively): a 400 naming `param` otherwise."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                raise invalid_request(
                    f"Invalid '{param}': nested more than {MAX_SCHEMA_DEPTH} levels deep.",
                    param,
                    "invalid_value",
                )
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def guided_json_schema(schema: dict[str, Any] | None, param: str) -> pb.GuidedDecoding:
    """Output constrained to one JSON value valid against `schema` (None: any JSON value). `param` names the
    schema's field in errors; the schema must serialize as JSON (no NaN or infinities) and nest at most
    MAX_SCHEMA_DEPTH levels."""
    if schema is None:
        schema = {}
    check_schema_depth(schema, param)
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError) as e:
        raise invalid_request(f"Invalid '{param}': {e}.", param, "invalid_value") from None
    return pb.GuidedDecoding(json_schema=text)


def guided_json_object() -> pb.GuidedDecoding:
    """Output constrained to one JSON object (OpenAI's `json_object` mode)."""
    return pb.GuidedDecoding(json_object=True)


def name_guided_error(err: APIError, param: str) -> APIError:
    """The backend's refusal of a grammar ("guided...: <why>", a 400 without a param) as a 400 naming the
    request's field that carried it; other errors pass unchanged."""
    if err.status == 400 and err.param is None and err.message.startswith(GUIDED_ERROR_PREFIX):
        return invalid_request(f"Invalid '{param}': {err.message}", param, "invalid_value")
    return err

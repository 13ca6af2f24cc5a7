"""Request body bytes -> a validated request model, or a 400 that names the offending field."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from tpuserve.http_gateway.errors import APIError, invalid_request, missing_parameter

M = TypeVar("M", bound=BaseModel)

# pydantic names union members in error locations ("str", "list[TextPart]", "constrained-int"): not fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# Errors that only say "wrong type for this union member" explain less than a bound or enum error.
_TYPE_ERRORS = {
    "string_type",
    "int_type",
    "float_type",
    "bool_type",
    "list_type",
    "dict_type",
    "model_type",
    "is_instance_of",
    "union_tag_invalid",
    "int_from_float",
}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_request(body: bytes, model: type[M]) -> M:
    """Strict JSON (no NaN/Infinity), then the model's schema; every failure is an `APIError` 400."""
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:  # deeply nested arrays/objects: a client error, not a 500
        raise invalid_request(
            "We could not parse the JSON body of your request: it is nested too deeply."
        ) from None
    if not isinstance(obj, dict):
        raise invalid_request("The request body must be a JSON object.")
    _reject_lone_surrogates(obj)
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None
    check = getattr(req, "check_supported", None)
    if check is not None:
        check()
    return req


def _reject_lone_surrogates(obj: object) -> None:
    """JSON may carry unpaired surrogates ("\\ud800", or their UTF-8-like bytes): they are no text, protobuf cannot
    encode them (a 500 later), so they are a 400 here. Iterative: the tree may be as deep as json allows."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise invalid_request(
                    "We could not parse the JSON body of your request: it contains an unpaired UTF-16 surrogate."
                ) from None


def param_name(loc: tuple) -> str:
    """('messages', 0, 'content', 'list[TextPart]', 0, 'type') -> 'messages[0].content[0].type'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors()
    best = min(errors, key=lambda x: (x["type"] in _TYPE_ERRORS, -len(x["loc"])))
    param = param_name(best["loc"])
    if best["type"] == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if best["type"] == "missing":
        return missing_parameter(param)
    return invalid_request(f"Invalid value for '{param}': {best['msg']}.", param or None, "invalid_value")

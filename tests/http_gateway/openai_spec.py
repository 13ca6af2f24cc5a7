"""Validate gateway JSON against the schemas of OpenAI's OpenAPI file (openai-openapi.yaml beside this module; its
source and licence: openai-openapi.NOTICE).

The file mixes OpenAPI 3.0 (`nullable: true`) and 3.1 (`type: 'null'`) styles; `nullable` is rewritten to a
JSON-schema union. $refs resolve inside the document. Relaxations, each one where the spec's schema is narrower
than what OpenAI actually returns (and what docs/http-api.md promises), are listed in RELAXED and applied explicitly.
"""

from __future__ import annotations

import copy
import functools
import pathlib

import jsonschema
import referencing
import yaml

SPEC_PATH = pathlib.Path(__file__).resolve().parent / "openai-openapi.yaml"
_URI = "urn:openai-openapi"


def _denull(node):
    if isinstance(node, list):
        return [_denull(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _denull(v) for k, v in node.items() if k not in ("discriminator", "example", "x-oaiMeta")}
    if node.pop("nullable", False):
        if (
            isinstance(node.get("type"), str)
            and "$ref" not in node
            and not any(k in node for k in ("oneOf", "anyOf", "allOf"))
        ):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


def _nullable(node: dict) -> dict:
    return {"anyOf": [node, {"type": "null"}]}


def _relax(schemas: dict) -> None:
    """Legacy completions, as OpenAI returns them: with `echo`, the first prompt token has a null logprob and a
    null top_logprobs entry; with `logprobs: 0`, top_logprobs is null; streamed chunks (same schema) carry
    `finish_reason: null` until the last one."""
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]
    lp = choice["properties"]["logprobs"]["anyOf"][0]["properties"]
    lp["token_logprobs"]["items"] = _nullable(lp["token_logprobs"]["items"])
    lp["top_logprobs"]["items"] = _nullable(lp["top_logprobs"]["items"])
    lp["top_logprobs"] = _nullable(lp["top_logprobs"])
    choice["properties"]["finish_reason"] = _nullable(choice["properties"]["finish_reason"])


RELAXED = "CreateCompletionResponse: null first-echo entries, null top_logprobs, streamed finish_reason null"


@functools.cache
def _registry() -> referencing.Registry:
    if not SPEC_PATH.exists():  # CI has it: a checkout without it must fail, not validate nothing
        raise FileNotFoundError(f"the OpenAI OpenAPI spec is missing: {SPEC_PATH.resolve()}")
    spec = yaml.load(SPEC_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    spec = _denull(copy.deepcopy(spec))
    _relax(spec["components"]["schemas"])
    resource = referencing.Resource.from_contents(
        spec, default_specification=referencing.jsonschema.DRAFT202012
    )
    return referencing.Registry().with_resource(_URI, resource)


@functools.cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"{_URI}#/components/schemas/{name}"}, registry=_registry()
    )


def validate(obj: dict, name: str) -> None:
    """Raises jsonschema.ValidationError (with the path) when `obj` does not match the spec's schema `name`."""
    validator(name).validate(obj)

"""A schemathesis run against the gateway's own OpenAPI document (bad input from a client that reads the
document); the document itself is checked in test_gateway_openapi.py.

Schemathesis reads the document from the running gateway (uvicorn, in front of the scripted gRPC backend) and
sends bodies that fit it (positive) and bodies that break it (negative: wrong types, out-of-range numbers, unknown
fields, missing required ones) to every operation. Checks: never a 5xx; every status and content type is one
the document declares; every JSON answer (results and errors) fits its declared schema; every schema-breaking
body is rejected with a 4xx. Afterwards the gateway still serves a normal request."""

from __future__ import annotations

from scripted_backend import MODEL_ID

from tests.helpers import require_extra

schemathesis = require_extra("schemathesis")  # every test here is the fuzz, or checks the gateway after it
from schemathesis import checks as st_checks
from schemathesis.generation.modes import GenerationMode
from tpuserve.http_gateway import openapi

MAX_EXAMPLES = 60
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.negative_data_rejection,
]


# The document the scripted gateway serves (no API key); test_gateway_openapi.py checks that it is exactly what GET /openapi.json returns. (Loading it lazily from the fixture's URL needs
# schemathesis.pytest.from_fixture, which does not work with this pytest.)
schema = schemathesis.openapi.from_dict(openapi.build())
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=MAX_EXAMPLES,
    deterministic=True,  # the same cases on every run (CI must not flake on a new random draw)
    database="none",
)


@schema.parametrize()
def test_fuzz_from_the_gateways_openapi_document(case, scripted_gateway):
    case.call_and_validate(base_url=scripted_gateway.url, checks=CHECKS, timeout=30)


def test_still_serving_after_the_fuzz(scripted_gateway):
    r = scripted_gateway.http.post(
        "/v1/completions", json={"model": MODEL_ID, "prompt": "say:still here", "max_tokens": 16}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "still here"

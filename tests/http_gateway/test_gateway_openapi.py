"""The gateway's own OpenAPI document (GET /openapi.json): what it declares. The schemathesis run against it is
test_gateway_openapi_fuzz.py."""

from __future__ import annotations

from tpuserve.http_gateway import openapi


def test_served_document_is_the_built_one(scripted_gateway):
    r = scripted_gateway.http.get("/openapi.json")
    assert r.status_code == 200
    assert r.json() == openapi.build()


def test_openapi_document_describes_both_endpoints():
    doc = openapi.build()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for path, request in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "ErrorResponse"
        )
    # the request schemas are the validating models': unknown fields are refused, bounds are there
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert set(chat["required"]) == {"model", "messages"}
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]


def test_keyed_gateway_document_declares_bearer_auth(keyed_gateway):
    doc = keyed_gateway.http.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]

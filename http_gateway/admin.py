"""`POST /v1/admin/update_weights`: new weights on every backend without a restart (docs/weight-updates.md).

Close to SGLang's `/update_weights_from_disk`: body `{"model_path", "weight_version", "abort_in_flight"}` ->
`{"success", "message", "weight_version", "num_aborted"}`. The route exists only when the gateway has an admin
key (`--admin-key` / $TPUSERVE_ADMIN_KEY), a bearer key apart from the API key; the gateway hands it on to the
backends, which check it too. A checkpoint a backend refuses answers 400 with `success: false`, the backend's
reason and OpenAI's `error` object; the old weights keep serving."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from tpuserve.http_gateway.auth import ADMIN, bearer_matches
from tpuserve.http_gateway.backends import BackendPool
from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.request_parsing import parse_request
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb

UPDATE_WEIGHTS = ADMIN + "update_weights"


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    weight_version: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    abort_in_flight: bool = False
    # only the backends serving this model (default: every backend)
    model: str | None = None


def add_admin_routes(app: FastAPI, pool: BackendPool, admin_key: str) -> None:
    @app.post(UPDATE_WEIGHTS)
    async def update_weights(request: Request) -> Response:
        sent, ok = bearer_matches(request.headers.raw, admin_key)
        if not ok:
            message = "This endpoint needs the admin key." if not sent else "Incorrect admin key provided."
            raise APIError(401, message, "invalid_request_error", None, "invalid_api_key")
        req = parse_request(await request.body(), UpdateWeightsRequest)
        answers = await pool.update_weights(
            pb.UpdateWeightsRequest(
                model_path=req.model_path,
                weight_version=req.weight_version or "",
                abort_in_flight=req.abort_in_flight,
            ),
            admin_key,
            req.model,
        )
        failed = [(a, r) for a, r in answers if isinstance(r, APIError) or not r.success]
        done = [r for _, r in answers if not isinstance(r, APIError) and r.success]
        versions = sorted({r.weight_version for _, r in answers if not isinstance(r, APIError)})
        body = {
            "success": not failed,
            "message": "; ".join(f"{address}: {r.message}" for address, r in answers),
            "weight_version": versions[0] if len(versions) == 1 else ",".join(versions),
            "num_aborted": sum(r.num_aborted for r in done),
        }
        if not failed:
            return JSONResponse(body)
        address, first = failed[0]
        if isinstance(first, APIError):  # the call itself failed (backend down, key refused): its status
            return JSONResponse({**body, **first.body()}, status_code=first.status)
        error = APIError(
            400, f"{address}: {first.message}", "invalid_request_error", "model_path", "invalid_value"
        )
        return JSONResponse({**body, **error.body()}, status_code=400)

"""Server-sent events in OpenAI's framing: `data: <json>` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.observability import on_stream_error

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


async def sse_stream(payloads: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame JSON payloads as events. A failure after the response started is sent as an OpenAI error event
    (the SDKs raise it), then the stream ends with [DONE]."""
    try:
        async for payload in payloads:
            yield f"data: {payload}\n\n"
    except APIError as e:
        on_stream_error(e.code)
        yield f"data: {json.dumps(e.body())}\n\n"
    except Exception:
        log.exception("error while streaming")
        on_stream_error("internal_error")
        err = APIError(
            500,
            "The server had an error while processing your request.",
            "server_error",
            None,
            "internal_error",
        )
        yield f"data: {json.dumps(err.body())}\n\n"
    yield DONE

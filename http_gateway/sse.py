"""Server-sent events in OpenAI's framing: `data: <json>` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from tpuserve.http_gateway.errors import APIError
from tpuserve.http_gateway.observability import on_stream_error

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"

# Line breaks to `str.splitlines` but not to SSE (CR, LF, CRLF) nor to JSON, which allows them raw inside a string:
# a token's text holding one would cut an event in two for a client that splits the decoded stream with
# splitlines (httpx's `aiter_lines` does). Sent as JSON escapes they mean the same text to every reader.
_SPLITLINES_ONLY = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def data_event(payload: str) -> str:
    """A JSON payload as an SSE `data:` line and the blank line that ends the event."""
    return f"data: {payload.translate(_SPLITLINES_ONLY)}\n\n"


def stream_failure(exc: Exception) -> APIError:
    """The error to send when a stream fails after its response started: an APIError as it is, anything else
    logged and sent as a 500 `internal_error`; either way counted in the metrics."""
    if isinstance(exc, APIError):
        on_stream_error(exc.code)
        return exc
    log.error("error while streaming", exc_info=exc)
    on_stream_error("internal_error")
    return APIError(
        500, "The server had an error while processing your request.", "server_error", None, "internal_error"
    )


async def sse_stream(payloads: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame JSON payloads as events. A failure after the response started is sent as an OpenAI error event
    (the SDKs raise it), then the stream ends with [DONE]."""
    try:
        async for payload in payloads:
            yield data_event(payload)
    except Exception as exc:  # noqa: BLE001 - any failure becomes an error event (stream_failure logs it)
        yield data_event(json.dumps(stream_failure(exc).body()))
    yield DONE

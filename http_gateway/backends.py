"""gRPC client channels to one or more backends: model discovery, health, round-robin choice."""

from __future__ import annotations

import asyncio
import itertools
import logging
import pathlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tpuserve.http_gateway.errors import APIError, from_grpc
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 1.0
# The KV pool's counts /health reports per backend (GetModelInfo.pages): positions per page, pages in the pool,
# held, held more than once, named by the prefix cache, takeable; sequences preempted since start.
PAGE_FIELDS = ("page_tokens", "total", "used", "shared", "cached", "free", "preemptions")
_MAX_MESSAGE = 64 * 1024 * 1024
# gRPC's default reconnect backoff grows to 120 s while a backend is down, so a restarted backend would wait
# that long to be used again; cap it so a returning backend serves within about a second.
RECONNECT_BACKOFF_MS = 1000


@dataclass(frozen=True)
class BackendTLS:
    """TLS to the backends: `ca_file` (PEM roots; None = the system's), a client certificate for mutual TLS
    (`cert_file` + `key_file`), and `server_name` to check in the backend's certificate instead of the host."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a backend client certificate needs both cert_file and key_file")

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return pathlib.Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


class Backend:
    """One backend address: a grpc.aio channel (created inside the serving event loop) and its model info."""

    def __init__(self, address: str, tls: BackendTLS | None = None) -> None:
        self.address = address
        options = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
        ]
        if tls is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self.channel = grpc.aio.secure_channel(address, tls.credentials(), options=options)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.info: pb.ModelInfo | None = None

    async def refresh_info(self) -> pb.ModelInfo | None:
        try:
            self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("backend %s: GetModelInfo failed: %s", self.address, e.code().name)
        return self.info

    async def readiness(self) -> tuple[str, dict[str, int] | None, str | None]:
        """The backend's own word on where it is ("warming up 7/24: ...", "serving"), or why it cannot say; its
        KV pool's page counts (PAGE_FIELDS) when it pages its KV cache, else None; the version of its weights
        (None when it cannot say). One GetModelInfo call."""
        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            return f"unreachable ({e.code().name})", None, None
        pages = {f: getattr(info.pages, f) for f in PAGE_FIELDS} if info.HasField("pages") else None
        return info.readiness or "unknown", pages, info.weight_version or None

    def names(self) -> list[str]:
        """The names its model answers to (none before its info is known)."""
        if self.info is None:
            return []
        return list(self.info.served_model_names) or [self.info.model_id]

    async def serving(self) -> bool:
        try:
            resp = await self.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


class BackendPool:
    """Backends serving one or more models; requests for a model go round-robin over its backends."""

    def __init__(
        self, addresses: list[str], tls: BackendTLS | None = None, request_timeout_s: float | None = None
    ) -> None:
        if not addresses:
            raise ValueError("at least one backend address is required")
        self.addresses = list(addresses)
        self.tls = tls
        self.request_timeout_s = request_timeout_s  # each Generate's gRPC deadline
        self.backends: list[Backend] = []
        self._rr = itertools.count()

    async def start(self) -> None:
        self.backends = [Backend(a, self.tls) for a in self.addresses]
        await self.refresh()

    async def close(self) -> None:
        await asyncio.gather(*(b.channel.close() for b in self.backends), return_exceptions=True)

    async def refresh(self, missing_only: bool = False) -> None:
        todo = [b for b in self.backends if not (missing_only and b.info is not None)]
        await asyncio.gather(*(b.refresh_info() for b in todo))

    def models(self) -> dict[str, pb.ModelInfo]:
        """Every served name (aliases included) -> its model's info."""
        return {name: b.info for b in self.backends if b.info is not None for name in b.names()}

    async def healthy(self) -> bool:
        return any(await asyncio.gather(*(b.serving() for b in self.backends)))

    async def readiness(self) -> tuple[dict[str, str], dict[str, dict[str, int]], dict[str, str]]:
        """Backend address -> its readiness detail; address -> its KV pool's page counts, for the backends that
        page their KV cache (and answered); address -> the version of its weights (those that answered)."""
        reports = await asyncio.gather(*(b.readiness() for b in self.backends))
        details = {b.address: detail for b, (detail, _, _) in zip(self.backends, reports, strict=True)}
        pages = {b.address: p for b, (_, p, _) in zip(self.backends, reports, strict=True) if p is not None}
        versions = {
            b.address: v for b, (_, _, v) in zip(self.backends, reports, strict=True) if v is not None
        }
        return details, pages, versions

    async def resolve(self, model: str) -> list[Backend]:
        """Backends serving `model`, rotated round-robin (the first is this request's choice)."""
        if not any(model in b.names() for b in self.backends):
            await self.refresh(missing_only=True)
        found = [b for b in self.backends if model in b.names()]
        if not found:
            if not self.models():
                raise APIError(503, "No backend is available.", "server_error", None, "service_unavailable")
            raise APIError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        k = next(self._rr) % len(found)
        return found[k:] + found[:k]

    async def info(self, model: str) -> pb.ModelInfo:
        backend = (await self.resolve(model))[0]
        assert backend.info is not None
        return backend.info

    async def generate(self, model: str, request: pb.GenerateRequest) -> GenerateStream:
        """Start `Generate` and wait for its first message, so that errors before any output (bad argument,
        overload, backend down) become the HTTP status. UNAVAILABLE fails over to the model's next backend."""
        last: grpc.aio.AioRpcError | None = None
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        for backend in await self.resolve(model):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())  # one budget in all
            call = backend.stub.Generate(request, timeout=timeout)
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    last = e
                    continue
                raise from_grpc(e) from None
            except BaseException:  # cancelled while waiting (client gone): the backend must know
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise APIError(
                    502, "The backend ended the stream without output.", "server_error", None, "backend_error"
                )
            return GenerateStream(call, first)
        assert last is not None
        raise from_grpc(last)

    async def update_weights(
        self, request: pb.UpdateWeightsRequest, admin_key: str, model: str | None = None
    ) -> list[tuple[str, pb.UpdateWeightsResponse | APIError]]:
        """UpdateWeights on every backend (of `model`, when given), all at once -> (address, its answer or the
        error of the call) per backend; then their model info is read again (the new versions)."""
        targets = await self.resolve(model) if model is not None else list(self.backends)
        metadata = (("authorization", f"Bearer {admin_key}"),)

        async def one(b: Backend) -> pb.UpdateWeightsResponse | APIError:
            try:
                return await b.stub.UpdateWeights(request, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                return from_grpc(e)

        answers = await asyncio.gather(*(one(b) for b in targets))
        await self.refresh()
        return [(b.address, a) for b, a in zip(targets, answers, strict=True)]

    async def detokenize(self, model: str, ids: list[int]) -> str:
        backend = (await self.resolve(model))[0]
        try:
            resp = await backend.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=30)
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e) from None
        return resp.text


class GenerateStream:
    """A started `Generate` call whose first message was already read. Cancel it when abandoned."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, first: pb.GenerateResponse) -> None:
        self.call = call
        self.first = first

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """All messages; a gRPC failure raises `APIError`. The call is cancelled if the consumer stops early."""
        try:
            yield self.first
            while True:
                try:
                    msg = await self.call.read()
                except grpc.aio.AioRpcError as e:
                    raise from_grpc(e) from None
                if msg is grpc.aio.EOF:
                    return
                yield msg
        finally:
            self.call.cancel()

    def cancel(self) -> None:
        self.call.cancel()

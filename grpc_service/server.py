"""The gRPC backend process: TextGeneration + grpc.health.v1.Health + reflection on one grpc.aio server.

Health is NOT_SERVING until the engine's warm-up (run on the engine thread after the port is open) has
finished, then SERVING for "" and "tpuserve.v1.TextGeneration". SIGTERM/SIGINT: health NOT_SERVING, no new
requests (UNAVAILABLE), in-flight streams drain up to a timeout (then end CANCELLED), exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from tpuserve.grpc_service.metrics import BackendMetrics, watch_compiles
from tpuserve.grpc_service.orchestrator import Orchestrator
from tpuserve.grpc_service.servicer import TextGenerationServicer
from tpuserve.proto import jsonlog
from tpuserve.proto.settings import merge
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc
from tpuserve.sampler.api import Engine

if TYPE_CHECKING:
    from tpuserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
MAX_MESSAGE_BYTES = (
    64 * 1024 * 1024
)  # prompt logprobs of a long prompt with top-20 exceed gRPC's 4 MiB default
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerTLS:
    """Serve gRPC over TLS with `cert_file` (PEM chain) and `key_file`; with `client_ca_file`, clients must
    present a certificate signed by it (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (pathlib.Path(self.key_file).read_bytes(), pathlib.Path(self.cert_file).read_bytes())
        ca = pathlib.Path(self.client_ca_file).read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class GrpcServer:
    """A started server; `ready` completes when warm-up is done (or raises its error)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        port: int,
        orchestrator: Orchestrator,
        servicer: TextGenerationServicer,
        health: health_aio.HealthServicer,
    ) -> None:
        self.server, self.port = server, port
        self.orchestrator, self.servicer, self.health = orchestrator, servicer, health
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.metrics: BackendMetrics | None = None
        self.metrics_port: int | None = None  # the bound metrics HTTP port, when metrics are served

    async def _on_ready(self, error: BaseException | None) -> None:
        if error is None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, SERVING)
            log.info("serving on port %d", self.port)
            if not self.ready.done():
                self.ready.set_result(None)
        elif not self.ready.done():
            self.ready.set_exception(error)

    async def shutdown(self, drain_timeout_s: float = 30.0) -> bool:
        """Stop admission, let in-flight streams finish (cancel them after the timeout), stop. True if drained."""
        await self.health.enter_graceful_shutdown()
        self.orchestrator.stop_admission()
        drained = await self.servicer.drain(drain_timeout_s)
        await self.server.stop(grace=1.0)
        await asyncio.to_thread(self.orchestrator.close)
        if self.metrics is not None:
            self.metrics.close()
        return drained


async def start_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_queue: int = 256,
    max_n: int | None = None,
    max_prompt_tokens: int | None = None,
    max_queue_wait_s: float | None = None,
    warmup: Callable[[], None] | None = None,
    metrics_port: int | None = None,
    log_prompts: bool = False,
    tls: ServerTLS | None = None,
) -> GrpcServer:
    """Bind (port 0 = any free port), start, and start the engine thread (it runs `warmup` first).

    `metrics_port`: serve Prometheus metrics over HTTP on `host` at this port (0 = any free port; None = off).
    `tls`: serve over TLS instead of plaintext."""
    orchestrator = Orchestrator(
        engine,
        tokenizer.token_bytes,
        tokenizer.special_ids,
        max_queue=max_queue,
        max_queue_wait_s=max_queue_wait_s,
    )
    metrics = None
    if metrics_port is not None:
        watch_compiles()
        metrics = BackendMetrics(orchestrator)
        orchestrator.on_generate = metrics.generate_seconds.observe
        orchestrator.on_drop = lambda code: metrics.dropped.labels(code).inc()
    servicer = TextGenerationServicer(
        orchestrator,
        tokenizer,
        model_id,
        max_n=max_n,
        max_prompt_tokens=max_prompt_tokens,
        metrics=metrics,
        log_prompts=log_prompts,
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_TextGenerationServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health.set(name, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = (
        server.add_insecure_port(address)
        if tls is None
        else server.add_secure_port(address, tls.credentials())
    )
    if not bound:
        raise OSError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    running = GrpcServer(server, bound, orchestrator, servicer, health)
    if metrics is not None:
        running.metrics = metrics
        running.metrics_port = metrics.serve(host, metrics_port)
    loop = asyncio.get_running_loop()

    def on_ready(error: BaseException | None) -> None:  # on the engine thread
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(running._on_ready(error)))

    orchestrator.start(warmup=warmup, on_ready=on_ready)
    return running


async def serve(
    engine: Engine,
    tokenizer: Tokenizer,
    model_id: str,
    host: str = "0.0.0.0",
    port: int = 50051,
    *,
    drain_timeout_s: float = 30.0,
    **options: Any,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (0 after a graceful stop, 1 if warm-up failed).

    `options` are start_server's (limits, `warmup`, metrics port, TLS, ...). `warmup` (e.g. the engine's
    compile-everything step) runs on the engine thread while health is NOT_SERVING."""
    running = await start_server(engine, tokenizer, model_id, host, port, **options)
    tls = options.get("tls")
    if running.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", host, running.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gRPC%s listening on %s:%d (warming up)", " (TLS)" if tls else "", host, running.port)
    ready = asyncio.ensure_future(asyncio.shield(running.ready))
    await asyncio.wait([ready, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("warm-up failed: %s", ready.exception())
        await running.shutdown(0.0)
        return 1
    await stop.wait()
    log.info("stopping: draining in-flight requests (up to %.0f s)", drain_timeout_s)
    drained = await running.shutdown(drain_timeout_s)
    log.info("stopped (%s)", "drained" if drained else "drain timed out; remaining streams cancelled")
    return 0


SERVER_DEFAULTS: dict[str, Any] = {
    "host": "0.0.0.0",
    "port": 50051,
    "metrics_port": 0,
    "log_prompts": False,
    "log_format": "json",
    "drain_timeout": 30.0,
    "tls_cert_file": None,
    "tls_key_file": None,
    "tls_client_ca_file": None,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Flags, then the `server:` section of the --config YAML (keys = the flags' long names with underscores;
    its `engine:` section configures the engine), then SERVER_DEFAULTS."""
    p = argparse.ArgumentParser(prog="tpuserve grpc", description="Serve a model over gRPC (tpuserve.v1).")
    p.add_argument("--host", default=None, help="default 0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="default 50051")
    p.add_argument("--model", default=None, help="GGUF file, HF model directory or Orbax checkpoint")
    p.add_argument("--config", default=None, help="YAML config (configs/*.yaml); flags override it")
    p.add_argument(
        "--max-queue", type=int, default=None, help="requests waiting for a slot (then RESOURCE_EXHAUSTED)"
    )
    p.add_argument("--max-n", type=int, default=None, help="most samples per request (capped at the slots)")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted (default: context length)",
    )
    p.add_argument(
        "--max-queue-wait",
        type=float,
        default=None,
        help="seconds a request may wait for a slot, then RESOURCE_EXHAUSTED (default: no limit)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this HTTP port (0 = off)"
    )
    p.add_argument(
        "--log-prompts",
        action="store_true",
        default=None,
        help="include prompts in the per-request log lines",
    )
    p.add_argument("--log-format", choices=("json", "text"), default=None, help="default json")
    p.add_argument(
        "--drain-timeout", type=float, default=None, help="seconds in-flight requests get on SIGTERM (30)"
    )
    p.add_argument(
        "--tls-cert-file", default=None, help="serve gRPC over TLS with this PEM certificate (chain)"
    )
    p.add_argument("--tls-key-file", default=None, help="the PEM private key of --tls-cert-file")
    p.add_argument(
        "--tls-client-ca-file",
        default=None,
        help="require client certificates signed by this CA (mutual TLS)",
    )
    ns = p.parse_args(argv)
    try:
        settings = merge(SERVER_DEFAULTS, ns.config, "server", vars(ns))
    except ValueError as e:
        p.error(str(e))
    if (settings["tls_cert_file"] is None) != (settings["tls_key_file"] is None):
        p.error("TLS needs both --tls-cert-file and --tls-key-file")
    if settings["tls_client_ca_file"] and not settings["tls_cert_file"]:
        p.error("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    return argparse.Namespace(**settings, **{k: getattr(ns, k) for k in ENGINE_FLAGS}, config=ns.config)


ENGINE_FLAGS = ("model", "max_queue", "max_n", "max_prompt_tokens", "max_queue_wait")


def tls_of(args: argparse.Namespace) -> ServerTLS | None:
    if args.tls_cert_file is None:
        return None
    return ServerTLS(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)


def main(argv: Sequence[str] | None = None) -> int:
    """`tpuserve grpc --port 50051 [--model PATH] [--config configs/X.yaml]`.

    The engine is built with warm-up deferred, so the port opens (health NOT_SERVING) while it compiles."""
    args = parse_args(argv)
    jsonlog.setup("INFO", args.log_format)
    import dataclasses

    from tpuserve.sampler.config import load_config  # these import JAX: only when really serving
    from tpuserve.sampler.factory import load_engine

    cfg = load_config(args.config, {k: getattr(args, k) for k in ENGINE_FLAGS})
    engine, tokenizer, model_id = load_engine(dataclasses.replace(cfg, warm_up=False))
    return asyncio.run(
        serve(
            engine,
            tokenizer,
            model_id,
            args.host,
            args.port,
            max_queue=cfg.max_queue,
            max_n=cfg.max_n,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_queue_wait_s=cfg.max_queue_wait,
            warmup=engine.warm_up if cfg.warm_up else None,
            drain_timeout_s=args.drain_timeout,
            metrics_port=args.metrics_port or None,
            log_prompts=args.log_prompts,
            tls=tls_of(args),
        )
    )

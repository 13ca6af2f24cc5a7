"""The gRPC backend process (`tpuserve grpc`): TextGeneration + grpc.health.v1.Health + reflection on one grpc.aio
server, over one engine.

Health is NOT_SERVING until the engine's warm-up (run on the engine thread after the port is open) has
finished, then SERVING for "" and "tpuserve.v1.TextGeneration". SIGTERM/SIGINT: health NOT_SERVING, no new
requests (UNAVAILABLE), in-flight streams drain up to a timeout (then end CANCELLED), exit 0.

Threads of the process, and what each owns:
  main thread         the asyncio event loop: the grpc.aio server and its RPC coroutines (servicer.py), health,
                      reflection, the SIGTERM/SIGINT handlers and the shutdown sequence
  engine thread       see orchestrator.py
  metrics thread      prometheus_client's HTTP server, only with a metrics port: it owns nothing and reads the
                      counters and the orchestrator's gauges when scraped (metrics.py)
  shutdown helper     at shutdown, one executor thread (`asyncio.to_thread`) waits for the engine thread to stop
gRPC's C core also runs its own polling threads; no Python code of ours runs on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from tpuserve.grpc_service.guided import Grammars
from tpuserve.grpc_service.metrics import BackendMetrics, watch_compiles
from tpuserve.grpc_service.orchestrator import Orchestrator
from tpuserve.grpc_service.servicer import TextGenerationServicer
from tpuserve.grpc_service.settings import ADMIN_KEY_ENV, ServerSettings, ServerTLS, parse_args
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2 as pb
from tpuserve.proto.tpuserve.v1 import tpuserve_pb2_grpc as pb_grpc
from tpuserve.sampler.api import Engine
from tpuserve.sampler.config import EngineConfig

Progress = Callable[[int, int, str, float], None]  # warm-up stage k of n done, its name, its seconds

if TYPE_CHECKING:
    from tpuserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
# Prompt logprobs of a long prompt with top-20 exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


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
            self.servicer.set_readiness("serving")
            log.info("serving on port %d", self.port)
            if not self.ready.done():
                self.ready.set_result(None)
        elif not self.ready.done():
            self.ready.set_exception(error)

    async def update_weights(
        self,
        version: str,
        *,
        path: str | None = None,
        params: dict[str, Any] | None = None,
        abort_in_flight: bool = False,
    ) -> tuple[bool, str, int]:
        """The in-process form of UpdateWeights (no admin key: the caller owns the process): new weights from
        `path` or from a trainer's `params` (canonical names, any placement; see docs/weight-updates.md) ->
        (success, message, requests aborted)."""
        return await self.servicer.update_weights(
            version, path=path, params=params, abort_in_flight=abort_in_flight
        )

    def fail(self, message: str) -> None:
        """On the event loop: the engine cannot go on (a process of its group failed; this process exits soon).
        Every open request ends with UNAVAILABLE (the gateway answers 503), no new ones, health NOT_SERVING."""
        self.servicer.fail_open(message, "UNAVAILABLE")
        self.orchestrator.stop_admission()
        self.servicer.set_readiness(f"failed: {message}")
        for name in ("", SERVICE_NAME):
            asyncio.ensure_future(self.health.set(name, NOT_SERVING))

    async def shutdown(self, drain_timeout_s: float = ServerSettings.drain_timeout) -> bool:
        """Stop admission, let in-flight streams finish (cancel them after the timeout), stop. True if drained."""
        await self.health.enter_graceful_shutdown()
        self.servicer.set_readiness("shutting down")
        self.orchestrator.stop_admission()
        drained = await self.servicer.drain(drain_timeout_s)
        await self.server.stop(grace=1.0)
        await asyncio.to_thread(self.orchestrator.close)
        if self.metrics is not None:
            self.metrics.close()
        return drained


def grammars_for(engine: Engine, tokenizer: Tokenizer) -> Grammars | None:
    """Structured outputs for engines that take token masks (all but test doubles without them)."""
    if not engine.capabilities.structured_outputs:
        return None
    return Grammars.for_tokenizer(tokenizer, engine.vocab_size)


async def start_server(
    engine: Engine,
    tokenizer: Tokenizer,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_queue: int = EngineConfig.max_queue,
    max_n: int = EngineConfig.max_n,
    max_prompt_tokens: int | None = EngineConfig.max_prompt_tokens,
    max_queue_wait_s: float | None = EngineConfig.max_queue_wait,
    prefill_budget: int | None = EngineConfig.prefill_budget,
    warmup: Callable[[Progress], None] | None = None,
    metrics_port: int = 0,
    log_prompts: bool = ServerSettings.log_prompts,
    tls: ServerTLS | None = None,
    served_model_names: Sequence[str] | None = None,
    admin_key: str | None = None,
    weight_version: str | None = None,
) -> GrpcServer:
    """Bind (port 0 = any free port), start, and start the engine thread (it runs `warmup(progress)` first;
    `progress(k, n, stage, seconds)` after each stage logs it and sets the readiness detail of GetModelInfo).

    `metrics_port`: serve Prometheus metrics over HTTP on `host` at this port (0 = off, as on the command line).
    `tls`: serve over TLS instead of plaintext. `served_model_names`: the names the model answers to (default
    `model_id`); `admin_key`: UpdateWeights' bearer key (None: off); `weight_version`: the version of the weights
    it starts with (default: the engine's)."""
    if weight_version is not None:
        engine.weight_version = weight_version
    orchestrator = Orchestrator(
        engine,
        tokenizer.token_bytes,
        tokenizer.special_ids,
        max_queue=max_queue,
        max_queue_wait_s=max_queue_wait_s,
        prefill_budget=prefill_budget,
        grammars=grammars_for(engine, tokenizer),
    )
    metrics = _metrics_of(orchestrator) if metrics_port else None
    servicer = TextGenerationServicer(
        orchestrator,
        tokenizer,
        model_id,
        max_n=max_n,
        max_prompt_tokens=max_prompt_tokens,
        metrics=metrics,
        log_prompts=log_prompts,
        served_model_names=served_model_names,
        admin_key=admin_key,
    )
    server, health = await _grpc_server(servicer)
    bound = _bind(server, host, port, tls)
    await server.start()
    running = GrpcServer(server, bound, orchestrator, servicer, health)
    if metrics is not None:
        running.metrics = metrics
        running.metrics_port = metrics.serve(host, metrics_port)
    loop = asyncio.get_running_loop()

    def on_ready(error: BaseException | None) -> None:  # on the engine thread
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(running._on_ready(error)))

    def progress(k: int, n: int, stage: str, seconds: float) -> None:  # on the engine thread
        log.info("warm-up %d/%d: %s (%.1f s)", k, n, stage, seconds)
        loop.call_soon_threadsafe(servicer.set_readiness, f"warming up {k}/{n}: {stage}")

    servicer.set_readiness("warming up" if warmup is not None else "starting")
    orchestrator.start(warmup=None if warmup is None else lambda: warmup(progress), on_ready=on_ready)
    return running


def _metrics_of(orchestrator: Orchestrator) -> BackendMetrics:
    """Backend metrics wired to the orchestrator's decode-call and queue-drop hooks."""
    watch_compiles()
    metrics = BackendMetrics(orchestrator)
    orchestrator.on_decode = metrics.generate_seconds.observe
    orchestrator.on_drop = lambda code: metrics.dropped.labels(code).inc()
    return metrics


async def _grpc_server(servicer: TextGenerationServicer) -> tuple[grpc.aio.Server, health_aio.HealthServicer]:
    """An unbound grpc.aio server with TextGeneration, Health (NOT_SERVING until warm-up ends) and reflection."""
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
    return server, health


def _bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None) -> int:
    """Listen on host:port (0 = any free port), over TLS when `tls` is given; returns the bound port."""
    address = f"{host}:{port}"
    bound = (
        server.add_insecure_port(address)
        if tls is None
        else server.add_secure_port(address, tls.credentials())
    )
    if not bound:
        raise OSError(f"cannot bind the gRPC server to {address}")
    return bound


async def serve(
    engine: Engine,
    tokenizer: Tokenizer,
    model_id: str,
    host: str = ServerSettings.host,
    port: int = ServerSettings.port,
    *,
    drain_timeout_s: float = ServerSettings.drain_timeout,
    **options: Any,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (0 after a graceful stop, 1 if warm-up failed).

    `options` are start_server's (limits, `warmup`, metrics port, TLS, ...). `warmup` (e.g. the engine's
    compile-everything step) runs on the engine thread while health is NOT_SERVING."""
    running = await start_server(engine, tokenizer, model_id, host, port, **options)
    loop = asyncio.get_running_loop()
    # a multi-process group's fault (sampler/multihost.py): every open request ends UNAVAILABLE
    engine.set_fault_handler(lambda message: loop.call_soon_threadsafe(running.fail, message))
    tls = options.get("tls")
    if running.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", host, running.metrics_port)
    stop = asyncio.Event()
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
    await asyncio.to_thread(engine.stop_group)  # then a group's other processes stop too
    return 0


def main(
    argv: Sequence[str] | None = None, settings: tuple[ServerSettings, EngineConfig] | None = None
) -> int:
    """Serve with `settings` (the server's and the engine's, finished: `tpuserve grpc` read the --config file
    and set up the JSON logs), else with the flags in `argv` on the defaults, logging plain text (`python -m
    tpuserve.grpc_service --port 50051 [--model PATH]`).

    The engine is built with warm-up deferred, so the port opens (health NOT_SERVING) while it compiles."""
    if settings is None:
        settings = parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server, cfg = settings
    # Imported here, not above: the service itself runs over any `Engine` (tests use a fake one without JAX).
    from tpuserve.model.config import ModelLoadError
    from tpuserve.sampler import multihost, process_group
    from tpuserve.sampler.factory import load_engine

    try:  # before anything else touches JAX
        process_id, num_processes = process_group.initialize(
            server.coordinator, server.num_processes, server.process_id,
            init_timeout=server.init_timeout, peer_timeout=server.peer_timeout,
        )  # fmt: skip
        check_mesh(cfg, num_processes)
    except (RuntimeError, ValueError) as e:
        log.error("%s", e)
        return 2
    try:
        engine, tokenizer, model_id = load_engine(dataclasses.replace(cfg, warm_up=False))
    except ModelLoadError as e:  # a model that cannot be served: one line naming it, no traceback
        log.error("%s", e)
        return 2
    if num_processes > 1:
        channel = process_group.Channel(server.peer_timeout)
        if process_id != 0:
            return follow(engine, channel, server, cfg)
        engine = multihost.LeaderEngine(engine, channel)
        log.info("leader of %d processes: serving; the others follow", num_processes)
        warmup = lambda progress: engine.warm_up(compile=cfg.warm_up, progress=progress)
    else:
        warmup = (lambda progress: engine.warm_up(progress=progress)) if cfg.warm_up else None
    return asyncio.run(serve(engine, tokenizer, model_id, warmup=warmup, **_serve_options(server, cfg)))


def check_mesh(cfg: EngineConfig, num_processes: int) -> None:
    """A mesh larger than the group's devices: a ValueError naming the settings (on every process)."""
    import jax

    need, have = cfg.model_parallel * cfg.data_parallel, jax.device_count()
    if need > have:
        raise ValueError(f"engine.model_parallel {cfg.model_parallel} x engine.data_parallel {cfg.data_parallel} "
                         f"needs {need} devices; the {num_processes} process(es) have {have}")  # fmt: skip


def follow(engine: Any, channel: Any, server: ServerSettings, cfg: EngineConfig) -> int:
    """A follower process (--process-id > 0): warm up as the leader does, then run its commands until it stops
    (exit 0) or the group fails (exit 1, process_group.Channel). gRPC health on server.port says SERVING while it
    follows (probes of the pod); SIGTERM/SIGINT wait for the leader, which drains and then stops the group."""
    from concurrent import futures

    import jax
    from grpc_health.v1 import health as health_sync
    from tpuserve.sampler import multihost

    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = health_sync.HealthServicer()
    health.set("", NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_server)
    port = _bind(grpc_server, server.host, server.port, server.tls())
    grpc_server.start()
    channel.on_fault = lambda message: health.set("", NOT_SERVING)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: log.info("signal received: stopping when the leader stops the group"))
    log.info("follower %d: health on port %d; warming up", jax.process_index(), port)
    if cfg.warm_up:
        engine.warm_up(progress=lambda k, n, stage, s: log.info("warm-up %d/%d: %s (%.1f s)", k, n, stage, s))
    health.set("", SERVING)
    log.info("following the leader")
    code = multihost.follow(engine, channel)
    log.info("the leader stopped the group")
    health.set("", NOT_SERVING)
    grpc_server.stop(1.0)
    return code


def _serve_options(server: ServerSettings, cfg: EngineConfig) -> dict[str, Any]:
    """`serve`'s keywords (but `warmup`) from the process's settings."""
    return {
        "host": server.host,
        "port": server.port,
        "max_queue": cfg.max_queue,
        "max_n": cfg.max_n,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_queue_wait_s": cfg.max_queue_wait,
        "prefill_budget": cfg.prefill_budget,
        "drain_timeout_s": server.drain_timeout,
        "metrics_port": server.metrics_port or 0,
        "log_prompts": server.log_prompts,
        "tls": server.tls(),
        "served_model_names": server.served_model_name,
        "admin_key": server.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        "weight_version": server.weight_version,
    }

"""Backend Prometheus metrics, served on their own HTTP port (`tpuserve grpc --metrics-port N`; 0 = off) by
prometheus_client's server thread.

Each server has its own `CollectorRegistry` (several servers in one process do not collide). Gauges are read
from the orchestrator and engine at scrape time; XLA compiles are counted by a `jax.monitoring` listener
(process-wide: registered once, reported by every registry)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from tpuserve.grpc_service.jobs import FirstTokenTiming

if TYPE_CHECKING:
    from tpuserve.grpc_service.orchestrator import Orchestrator
    from tpuserve.sampler.api import Engine, PageStats

log = logging.getLogger(__name__)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = {"count": 0, "seconds": 0.0}
_compiles_lock = threading.Lock()
_listening = False


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == COMPILE_EVENT:
        with _compiles_lock:
            _compiles["count"] += 1
            _compiles["seconds"] += duration


def watch_compiles() -> None:
    """Count XLA backend compiles from now on (idempotent). The backend owns JAX, so importing it here is fine."""
    global _listening
    with _compiles_lock:
        if _listening:
            return
        _listening = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compiles() -> tuple[int, float]:
    with _compiles_lock:
        return _compiles["count"], _compiles["seconds"]


class _StateCollector:
    """Queue depth, slots, KV-cache use, the KV pool's pages and the prefix cache's counters, read when scraped."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    def collect(self):
        orch, engine = self.orchestrator, self.orchestrator.engine
        slots = int(engine.slots)
        active = slots - orch.free_slots
        yield GaugeMetricFamily(
            "tpuserve_backend_queue_depth", "Requests waiting for a slot.", value=orch.queued
        )
        yield GaugeMetricFamily(
            "tpuserve_backend_active_slots", "Decode slots holding a sample.", value=active
        )
        yield GaugeMetricFamily("tpuserve_backend_slots", "Decode slots (batch size B).", value=slots)
        pages = _page_stats(engine)
        yield GaugeMetricFamily(
            "tpuserve_backend_kv_cache_bytes",
            "Device bytes of the KV cache, allocated once at start: the page pool all slots share (an engine "
            "without pages: one block for all slots).",
            value=float(engine.capabilities.kv_cache_bytes),
        )
        yield GaugeMetricFamily(
            "tpuserve_backend_weight_bytes",
            "Device bytes of the model's weights as the programs hold them (quantized matrices as stored).",
            value=float(engine.capabilities.weight_bytes),
        )
        yield GaugeMetricFamily(
            "tpuserve_backend_kv_cache_positions",
            "KV-cache positions: pages in the pool x positions per page (an engine without pages: slots x max "
            "sequence length).",
            value=pages.total * pages.page_tokens if pages is not None else slots * int(engine.max_seq_len),
        )
        yield GaugeMetricFamily(
            "tpuserve_backend_kv_cache_used_positions",
            "KV-cache positions holding live tokens (the engine thread's last published count).",
            value=orch.stats.used_positions,
        )
        count, seconds = compiles()
        yield CounterMetricFamily(
            "tpuserve_backend_xla_compiles", "XLA backend compiles in this process.", value=count
        )
        yield CounterMetricFamily(
            "tpuserve_backend_xla_compile_seconds", "Time spent in XLA backend compiles.", value=seconds
        )
        yield from _prefix_cache_metrics(engine)
        if pages is not None:
            yield from _page_metrics(pages)


def _page_stats(engine: Engine) -> PageStats | None:
    """engine.page_stats() (a snapshot); None for an engine without pages, or when it fails (a scrape still
    reports everything else)."""
    try:
        return engine.page_stats()
    except Exception:
        log.exception("engine.page_stats() failed")
        return None


def _page_metrics(stats: PageStats):
    """The KV pool's pages now and the preemptions since start. `used`, `shared` and `cached` overlap (a cached
    page may be held, a shared page is used): they are not parts of `total`; `free` is what an allocation can
    take."""
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_page_tokens", "KV-cache positions per page of the pool.", value=stats.page_tokens
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_pages", "Pages in the KV pool (shared by all slots).", value=stats.total
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_pages_used",
        "KV pages held now (by a prefill, a cached prefix in use or a slot).",
        value=stats.used,
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_pages_shared",
        "KV pages held more than once now (a prefix read by several sequences).",
        value=stats.shared,
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_pages_cached",
        "KV pages named by the prefix cache now (held or not).",
        value=stats.cached,
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_kv_pages_free",
        "KV pages an allocation can take now (free ones and cached ones nobody holds).",
        value=stats.free,
    )
    yield CounterMetricFamily(  # prometheus_client appends the _total of a counter's sample
        "tpuserve_backend_kv_preemptions",
        "Sequences moved out of the KV pool to host memory to make room (each resumes where it stopped).",
        value=stats.preemptions,
    )


def _prefix_cache_metrics(engine: Engine):
    """The prefix cache's counters and size (engine.prefix_cache_stats(), a snapshot); none without a cache.
    Hit rate = rate(tpuserve_backend_prefix_cache_hit_tokens_total) / rate(tpuserve_backend_prefix_cache_lookup_tokens_total)."""
    try:
        stats = engine.prefix_cache_stats()
    except Exception:  # a scrape still reports everything else
        log.exception("engine.prefix_cache_stats() failed")
        return
    if stats is None:
        return
    yield CounterMetricFamily(  # prometheus_client appends the _total of a counter's sample
        "tpuserve_backend_prefix_cache_lookup_tokens",
        "Prompt tokens looked up in the prefix cache (every prefilled prompt). Hit rate = hit_tokens / "
        "lookup_tokens.",
        value=stats.lookup_tokens,
    )
    yield CounterMetricFamily(
        "tpuserve_backend_prefix_cache_hit_tokens",
        "Prompt tokens whose KV came from the prefix cache (not recomputed). Hit rate = hit_tokens / "
        "lookup_tokens.",
        value=stats.hit_tokens,
    )
    yield CounterMetricFamily(
        "tpuserve_backend_prefix_cache_evictions",
        "Prefix-cache blocks evicted (least recently used) to make room.",
        value=stats.evictions,
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_prefix_cache_bytes",
        "Device bytes held by cached prefix blocks now.",
        value=stats.cached_bytes,
    )
    yield GaugeMetricFamily(
        "tpuserve_backend_prefix_cache_capacity_bytes",
        "The prefix cache's configured budget in device bytes (prefix_cache_bytes).",
        value=stats.capacity_bytes,
    )


class BackendMetrics:
    """The counters and histograms the servicer and orchestrator update."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tpuserve_backend_requests", "Generate calls by final gRPC status.", ["code"], registry=r
        )
        self.finished = Counter(
            "tpuserve_backend_samples_finished",
            "Samples (n per request) by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.tokens = Counter("tpuserve_backend_generated_tokens", "Tokens generated.", registry=r)
        self.generate_seconds = Histogram(
            "tpuserve_backend_generate_call_seconds",
            "Duration of one engine decode call (N fused decode steps for all slots).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.ttft = Histogram(
            "tpuserve_backend_time_to_first_token_seconds",
            "From Generate received to its first token.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        first = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft_parts = {
            part: Histogram(f"tpuserve_backend_ttft_{part}_seconds", doc, buckets=first, registry=r)
            for part, doc in (
                ("queue_wait", "Time to first token, part 1: Generate received -> admitted to a slot."),
                ("prefill", "Time to first token, part 2: admitted -> first token read back (prefill + insert)."),
                ("delivery", "Time to first token, part 3: first token read back -> handed to gRPC."),
            )
        }  # fmt: skip
        self.dropped = Counter(
            "tpuserve_backend_queue_dropped",
            "Queued requests dropped before taking a slot, by gRPC status (DEADLINE_EXCEEDED: the client's "
            "deadline passed; RESOURCE_EXHAUSTED: max_queue_wait).",
            ["code"],
            registry=r,
        )
        r.register(_StateCollector(orchestrator))
        self._http = None

    def observe_first_token(self, timing: FirstTokenTiming, delivered: float) -> None:
        """Split one request's time to first token (time.monotonic() stamps) into its three parts."""
        self.ttft_parts["queue_wait"].observe(timing.admitted - timing.submitted)
        self.ttft_parts["prefill"].observe(timing.ready - timing.admitted)
        self.ttft_parts["delivery"].observe(delivered - timing.ready)

    def serve(self, host: str, port: int) -> int | None:
        """Start the metrics HTTP server thread on `host:port`; returns the port, None if it could not bind."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            log.warning("metrics port %s:%d unavailable: %s", host, port, e)
            return None
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

"""Build the real engine from an EngineConfig: load the model (placed by the sharding rules), create the engine,
compile everything (warm-up)."""

from __future__ import annotations

import logging
import time

import jax
from tpuserve.model.loader import load_model
from tpuserve.model.sharding import make_mesh
from tpuserve.model.tokenizer import Tokenizer
from tpuserve.sampler import compile_cache, host_memory, xla_flags
from tpuserve.sampler.config import EngineConfig
from tpuserve.sampler.engine import JaxEngine

log = logging.getLogger(__name__)


def load_engine(cfg: EngineConfig) -> tuple[JaxEngine, Tokenizer, str]:
    """-> (engine, tokenizer, model_id) for the gRPC service: the model is placed by the sharding rules of
    the configured mesh as it loads, and the engine's decode state uses the same mesh."""
    xla_flags.set_defaults()  # before the mesh or the weights start JAX's backend
    mesh = (
        make_mesh(cfg.model_parallel, cfg.data_parallel)
        if cfg.model_parallel * cfg.data_parallel > 1
        else None
    )
    cache = compile_cache.enable(cfg.compilation_cache_dir)
    log.info("compilation cache: %s", cache if cache is not None else "off")
    loaded = load_model(cfg.model, dtype=cfg.dtype, mesh=mesh, quantization=cfg.quantization)
    # after the weights (their loading buffers went back to the kernel), on XLA:CPU only (its programs' buffers are
    # host memory; an accelerator's are the device's)
    if jax.default_backend() == "cpu" and host_memory.keep_freed_memory():
        log.info(
            "host memory: freed buffers stay in the process (malloc without mmap, trimmed past %d MiB)",
            host_memory.TRIM_THRESHOLD >> 20,
        )
    engine = JaxEngine(loaded, cfg, mesh=mesh)
    if cfg.warm_up:
        start = time.perf_counter()
        engine.warm_up(progress=lambda k, n, stage, s: log.info("warm-up %d/%d: %s (%.1f s)", k, n, stage, s))
        log.info("warm-up compiled all programs in %.1f s", time.perf_counter() - start)
    return engine, loaded.tokenizer, loaded.model_id

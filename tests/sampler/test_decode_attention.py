"""EngineConfig.decode_attention: a decode step's attention with jax's Pallas TPU paged-attention kernel (what
"auto" picks on TPU), run here in jax's TPU interpreter, against the plain XLA gather path CPU serves with.

A tiny random Llama (2 layers, so a layer's pages are found at an offset in the pool; 2 KV heads of 2 query heads
each; head dim 64). The kernel rounds K and V to bf16 after loading them (model/attention_tpu.py), so the paths
agree in their greedy tokens and to within LOGPROB_BOUND in every logprob, not bit for bit; batch invariance
holds on the kernel path bit for bit. The interpreter is slow: the engine test takes ~15 s on 2 cores."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tpuserve.model.config import ModelConfig
from tpuserve.model.llama import Llama, init_cache, module_params, param_shapes
from tpuserve.model.loader import LoadedModel
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine
from tpuserve.sampler.programs import resolve_decode_attention

from tests.helpers import engine_config, run_engine

CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=256)  # fmt: skip
PROMPT_LENGTHS = (5, 21, 40)  # one page, two pages, three pages (of 16), each ending inside a page
GREEDY = SlotParams(max_tokens=8, temperature=0.0)
# |pallas - gather| over every chosen-token and top-20 logprob of 3 prompts x 8 tokens: measured 9.1e-3 here, at most
# 1.4e-2 over 8 random prompt sets (chosen tokens alone: 5.6e-3); the bf16 rounding of K and V (attention_tpu's own
# test: 7.8e-3 on the attention output). In 1 of those 8 sets a near-tie (top two 6e-4 apart) flipped a greedy token:
# this test's prompts have no such tie (smallest gap 0.056).
LOGPROB_BOUND = 3e-2


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    rng = np.random.default_rng(0)
    params = {n: jnp.ones(s) if n.endswith("norm") else jnp.asarray(rng.standard_normal(s, np.float32) * s[-1] ** -0.5)
              for n, s in param_shapes(CONFIG).items()}  # fmt: skip
    return LoadedModel(CONFIG, params, None, "tiny-random-llama", "numpy", 0.0)


def tiny_engine(loaded: LoadedModel, decode_attention: str) -> JaxEngine:
    """4 slots of up to 128 positions on a pool of 40 pages; decode on 2 rows alone, 4 beside 2 others."""
    cfg = engine_config(slots=4, max_seq_len=128, kv_pages=40, min_batch_bucket=2, min_attend_bucket=64,
                        prefix_cache=False, decode_attention=decode_attention)  # fmt: skip
    return JaxEngine(loaded, cfg)


def test_pallas_decode_gives_the_gather_paths_tokens_and_is_batch_invariant(tiny):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    requests = [(slot, ids, GREEDY) for slot, ids in enumerate(prompts)]
    gather, _ = run_engine(tiny_engine(tiny, "gather"), requests)
    pallas_engine = tiny_engine(tiny, "pallas")
    pallas, _ = run_engine(pallas_engine, requests)
    diff = 0.0
    for slot in range(len(prompts)):
        assert pallas[slot][0] == gather[slot][0], f"prompt {slot}: greedy tokens differ"
        assert len(pallas[slot][0]) == GREEDY.max_tokens
        diff = max(diff, np.abs(np.subtract(pallas[slot][1], gather[slot][1])).max(),
                   np.abs(np.subtract(pallas[slot][3], gather[slot][3])).max())  # fmt: skip
    # not bit-identical: the kernel ran (its bf16 K and V), and within the bound
    assert 0 < diff <= LOGPROB_BOUND, diff

    # the middle prompt alone (2 rows) is what it was beside the other two (4 rows), bit for bit
    alone, _ = run_engine(pallas_engine, [(1, prompts[1], GREEDY)])
    for got, want in zip(alone[1], pallas[1], strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_kernel_reads_each_layers_pages_in_place(tiny, scan_layers):
    """One decode step of rows whose pages are scattered through the pool, scanned and unrolled layers (TPU's
    default): the kernel path's hidden states and the keys and values it writes are the gather path's within
    the bf16 rounding (layer 0's writes, which no attention precedes, bit for bit)."""
    m = Llama(CONFIG, module_params(CONFIG, tiny.params, scan_layers))
    cache = init_cache(CONFIG, 3, 64)  # rows on pages 1-4, 5-8, 9-12; shuffled below
    table = np.asarray(cache.table)[:, np.random.default_rng(2).permutation(4)]
    cache = cache._replace(table=jnp.asarray(table))
    rng = np.random.default_rng(3)
    lengths = np.array([37, 3, 50])
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 64)))
    _, cache = m(tokens, jnp.broadcast_to(jnp.arange(64), (3, 64)), cache, 64)  # a prompt of 64 per row
    step = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (3, 1)))
    out = {mode: m(step, jnp.asarray(lengths)[:, None], cache, 64, decode_attention=mode)
           for mode in ("gather", "pallas")}  # fmt: skip
    (h_gather, kv_gather), (h_pallas, kv_pallas) = out["gather"], out["pallas"]
    diff = float(jnp.abs(h_pallas - h_gather).max())
    assert 0 < diff < 1e-2 * float(jnp.abs(h_gather).max()), diff  # measured 3.4e-3 of the largest
    for pool_pallas, pool_gather in ((kv_pallas.k, kv_gather.k), (kv_pallas.v, kv_gather.v)):
        # layer 0's new keys and values come before any attention; the next layer's follow layer 0's output
        assert np.array_equal(pool_pallas[:, 0], pool_gather[:, 0])
        np.testing.assert_allclose(
            pool_pallas, pool_gather, rtol=0, atol=1e-2 * float(jnp.abs(pool_gather).max())
        )


def test_auto_is_the_kernel_on_tpu_only(caplog):
    assert resolve_decode_attention("auto") == "gather"  # this backend is CPU
    assert resolve_decode_attention("gather") == "gather"
    with caplog.at_level(logging.WARNING, logger="tpuserve.sampler.programs"):
        assert resolve_decode_attention("pallas") == "pallas"
    assert "interpreter" in caplog.text
    with pytest.raises(ValueError, match="decode_attention"):
        resolve_decode_attention("flash")


def test_kernel_on_a_mesh_runs_per_device_on_its_kv_heads(tiny):
    """2 devices split the 2 KV heads (and the pool): the kernel runs under shard_map on each device's head (XLA
    cannot partition it) and gives the one-device kernel's hidden states."""
    from tpuserve.model.sharding import cache_sharding, make_mesh

    mesh = make_mesh(model_parallel=2)
    cache = init_cache(CONFIG, 2, 32)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 32)))
    step = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (2, 1)))
    positions = jnp.asarray([[20], [31]])

    def decode(m: Llama, cache, mesh):
        _, cache = m(tokens, jnp.broadcast_to(jnp.arange(32), (2, 32)), cache, 32)
        return m(step, positions, cache, 32, decode_attention="pallas", mesh=mesh)[0]

    want = decode(Llama(CONFIG, module_params(CONFIG, tiny.params, True)), cache, None)
    sharded = tiny.module(scan_layers=True, mesh=mesh)
    kv = cache_sharding(CONFIG, mesh, cache.k.shape[2], 16)
    assert kv.spec[0] == "model"  # the pool is split over KV heads
    placed = cache._replace(k=jax.device_put(cache.k, kv), v=jax.device_put(cache.v, kv))
    got = decode(sharded, placed, mesh)
    # measured 7.8e-5: the weight products split over the devices sum in another order (a device reading the other
    # head's pages or another layer's would be off by O(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-3)

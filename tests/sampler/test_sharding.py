"""Tensor parallelism on 4 fake CPU devices: an Orbax checkpoint restored straight into the sharded layout
serves the same greedy tokens and logprobs (within 5e-5) as one device, and its prefix cache, split like the KV
cache, is invisible in them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tpuserve.model.loader import load_model
from tpuserve.model.quant import is_quantized
from tpuserve.model.sharding import make_mesh, param_shardings
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine

from tests.helpers import engine_config, run_engine
from tests.sampler.test_engine import PROMPTS


@pytest.fixture(scope="module")
def orbax_dir(embedded_orbax):
    """`tpuserve convert embedded DIR`'s checkpoint (tests/conftest.py: written once a session)."""
    return embedded_orbax


def test_convert_writes_a_loadable_checkpoint(orbax_dir, embedded, capsys):
    loaded = load_model(orbax_dir)
    assert loaded.config == embedded.config and loaded.model_id == embedded.model_id
    assert loaded.quantization == "none" and embedded.quantization == "keep"  # convert writes fp32 by default
    for name, arr in embedded.params.items():  # the kept blocks dequantize to exactly the converted weights
        dense = arr.dequantize() if is_quantized(arr) else arr
        np.testing.assert_array_equal(np.asarray(loaded.params[name]), np.asarray(dense), err_msg=name)
    text = "Tokenizer round trip: 😀 世界 <|im_end|>"
    assert loaded.tokenizer.encode(text) == embedded.tokenizer.encode(text)
    assert loaded.tokenizer.token_bytes == embedded.tokenizer.token_bytes


# same shapes on both sides of a comparison; prefix-cache blocks of 32 tokens
SETTINGS = engine_config(slots=4, max_seq_len=128, steps_per_call=4, prefill_chunk=64, min_prefill_bucket=32)


@pytest.fixture(scope="module")
def one_device(embedded):
    """The one-device engine both mesh tests compare with."""
    return JaxEngine(embedded, SETTINGS)


def test_sharded_engine_matches_one_device(orbax_dir, embedded, one_device):
    assert len(jax.devices()) >= 4, "tests/conftest.py sets --xla_force_host_platform_device_count=4"
    mesh = make_mesh(model_parallel=2, data_parallel=2)
    sharded = load_model(orbax_dir, mesh=mesh)
    expected = param_shardings(sharded.config, mesh)
    for name, arr in sharded.params.items():  # restored directly into the planned layout
        assert arr.sharding.is_equivalent_to(expected[name], arr.ndim), name
    assert len(sharded.params["wq"].sharding.device_set) == 4
    assert sharded.params["w_gate"].sharding.spec[1] == "model"  # [L, I, H]: the MLP axis over the model axis
    tp_engine = JaxEngine(sharded, SETTINGS, mesh=mesh)
    engine = one_device
    for text in PROMPTS[:2]:
        ids = embedded.tokenizer.encode(text)
        params = SlotParams(max_tokens=8, temperature=0.0)
        one, _ = run_engine(engine, [(0, ids, params)])
        tp, _ = run_engine(tp_engine, [(1, ids, params)])
        assert tp[1][0] == one[0][0]
        # Tensor parallelism sums the wo / w_down contractions in partial sums across devices, a different fp32
        # reduction order: differences up to a few 1e-5 (sampled token and top-20) over 8 steps; see docs/engine.md "Numerical fidelity".
        assert np.abs(np.array(tp[1][1]) - np.array(one[0][1])).max() < 5e-5
        assert np.abs(np.stack(tp[1][3]) - np.stack(one[0][3])).max() < 5e-5

    # the pool of pages on the mesh: placed by the sharding rules (split over KV heads where they divide), and a
    # warm prompt (its first pages shared from the cache) gives the same tokens and logprobs as a cold one
    from tpuserve.model.llama import pool_pages
    from tpuserve.model.sharding import cache_sharding

    planned = cache_sharding(sharded.config, mesh, pool_pages(tp_engine.pool.k), tp_engine.page)
    assert tp_engine.pool.k.sharding.is_equivalent_to(planned, 5)
    assert len(tp_engine.pool.k.sharding.device_set) == 4
    ids = embedded.tokenizer.encode((" ".join(PROMPTS) + " ") * 4)[:90]
    assert len(ids) == 90
    params = SlotParams(max_tokens=4, temperature=0.0)
    cold, cold_prompt = run_engine(tp_engine, [(0, ids, params)], want_prompt_logprobs=True)
    hits = tp_engine.prefix_cache_stats().hit_tokens
    warm, warm_prompt = run_engine(tp_engine, [(0, ids, params)], want_prompt_logprobs=True)
    assert tp_engine.prefix_cache_stats().hit_tokens - hits == 80  # five pages of 16
    assert warm[0][0] == cold[0][0] and warm[0][1] == cold[0][1]
    np.testing.assert_array_equal(warm_prompt.logprobs, cold_prompt.logprobs)
    np.testing.assert_array_equal(warm_prompt.top_logprobs, cold_prompt.top_logprobs)


def test_kept_blocks_shard_like_their_matrices(embedded, one_device):
    """The embedded GGUF's quantized blocks (the default) on a 2x2 mesh: each field of a kept matrix is split by
    the matrix's axes, and greedy decoding matches one device."""
    mesh = make_mesh(model_parallel=2, data_parallel=2)
    sharded = load_model(mesh=mesh)
    assert sharded.quantization == "keep"
    w_gate = sharded.params["w_gate"]  # [L, I, H]: values, scales and offsets split over I
    assert all(a.sharding.spec[1] == "model" for a in (w_gate.q, w_gate.scale, w_gate.offset))
    tp_engine = JaxEngine(sharded, SETTINGS, mesh=mesh)
    engine = one_device
    ids = embedded.tokenizer.encode(PROMPTS[0])
    params = SlotParams(max_tokens=8, temperature=0.0)
    one, _ = run_engine(engine, [(0, ids, params)])
    tp, _ = run_engine(tp_engine, [(1, ids, params)])
    assert tp[1][0] == one[0][0]
    assert np.abs(np.array(tp[1][1]) - np.array(one[0][1])).max() < 5e-5

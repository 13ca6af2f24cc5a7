"""Qwen3-MoE against transformers: tiny random Qwen3MoeForCausalLM checkpoints (8 experts, 2 per token, with and
without renormalized top-k router weights) written by transformers as safetensors (one tensor per expert), as
fused expert tensors, and as a GGUF file named by the gguf package's own qwen3moe tensor map; our logits and
teacher-forced logprobs vs PyTorch's in fp32, the experts each position is routed to, greedy continuations
through the engine, the Orbax round trip (fp32 and int8), the 2x2 mesh, batch invariance of the MoE layer, and
jax's Pallas megablox grouped matmul (in its TPU interpreter) against `jax.lax.ragged_dot`."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from tpuserve.model import checkpoint, moe
from tpuserve.model.config import ModelLoadError
from tpuserve.model.llama import module_params
from tpuserve.model.loader import convert, load_model
from tpuserve.model.quant import is_quantized, quantize_int8
from tpuserve.model.sharding import make_mesh
from tpuserve.sampler.api import SlotParams
from tpuserve.sampler.engine import JaxEngine

from tests.helpers import engine_config, require_extra, run_engine
from tests.model import fidelity
from tests.model.fidelity import BOUND, log_softmax, our_logits, reference_logits

torch = require_extra("torch")
transformers = require_extra("transformers")

BASE = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}  # fmt: skip
VARIANTS = {
    "norm-untied": {"norm_topk_prob": True, "tie_word_embeddings": False},
    "nonorm-tied": {"norm_topk_prob": False, "tie_word_embeddings": True},
}
TP_BOUND = 5e-5  # tensor parallelism's partial sums (tests/sampler/test_sharding.py)
IDS = [int(t) for t in np.random.default_rng(1).integers(0, BASE["vocab_size"], size=40)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def qwen3_moe(request, tmp_path_factory):
    """(variant, safetensors directory, GGUF file, the transformers model)."""
    cfg = transformers.Qwen3MoeConfig(**BASE, **VARIANTS[request.param])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random (not unit) norms, so every parameter matters
                p.add_(torch.randn_like(p) * 0.1)
            elif "mlp.gate." in name:  # a router that separates the experts (init's 0.02 leaves near-ties)
                p.normal_(0.0, 0.5)
            elif "experts" in name:  # experts that move the logits well past the bound
                p.normal_(0.0, 0.1)
    out = tmp_path_factory.mktemp(f"qwen3-moe-{request.param}")
    # transformers writes one tensor per expert (mlp.experts.{e}.gate_proj.weight ...); the untied one sharded
    model.save_pretrained(out / "hf", max_shard_size="100KB" if request.param == "norm-untied" else "1GB")
    write_gguf(model, out / "model.gguf")
    return request.param, out / "hf", out / "model.gguf", model


def write_gguf(
    model, path: pathlib.Path, experts_as: dict[str, gguf.GGMLQuantizationType] | None = None
) -> None:
    """The model as a qwen3moe GGUF of F32 tensors: llama.cpp's metadata keys and tensor names by the gguf
    package's own map; each layer's experts stacked into one tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
    as llama.cpp's converter writes them. `experts_as`: those tensors quantized ({"gate": Q8_0, ...})."""
    experts_as = experts_as or {}

    def add(gguf_name: str, arr: np.ndarray) -> None:
        qtype = next((t for part, t in experts_as.items() if f"ffn_{part}_exps" in gguf_name), None)
        if qtype is None:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(arr), qtype), raw_dtype=qtype)

    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if not c.norm_topk_prob:  # llama.cpp renormalizes qwen3moe's weights unless told otherwise
        w.add_expert_weights_norm(False)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, c.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = tensor.numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * Ie, H] in memory: gate rows, then up rows
            half = arr.shape[1] // 2
            prefix = name.removesuffix("gate_up_proj")
            for part, rows in (("gate_proj", arr[:, :half]), ("up_proj", arr[:, half:])):
                add(names.get_name(f"{prefix}{part}.weight", (".weight",)), rows)
            continue
        if name.endswith("mlp.experts.down_proj"):  # the converter names the stacked tensors "....weight"
            name += ".weight"
        add(names.get_name(name, try_suffixes=(".weight", ".bias")), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_fused(model, hf_dir: pathlib.Path, out: pathlib.Path) -> None:
    """The model's tensors as transformers >= 5 holds them in memory (experts fused: mlp.experts.gate_up_proj
    [E, 2 * Ie, H], mlp.experts.down_proj [E, H, Ie]) in one safetensors file, with the same config.json."""
    from safetensors.numpy import save_file

    out.mkdir()
    shutil.copy(hf_dir / "config.json", out / "config.json")
    tensors = {n: t.numpy() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in tensors)
    save_file(tensors, str(out / "model.safetensors"))


assert_matches = functools.partial(fidelity.assert_matches, ids=IDS)


def test_safetensors_fused_gguf_and_orbax_match_transformers(qwen3_moe, tmp_path, figure):
    name, hf_dir, gguf_path, model = qwen3_moe
    ref = reference_logits(model, IDS)
    loaded = load_model(hf_dir, with_tokenizer=False)
    cfg = loaded.config
    assert (cfg.architecture, cfg.qk_norm, cfg.num_experts, cfg.num_experts_per_tok) == (
        "qwen3_moe",
        True,
        8,
        2,
    )
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob) == (32, name == "norm-untied")
    assert loaded.params["we_gate"].shape == (2, 8, 32, 64) and loaded.params["we_down"].shape == (
        2,
        8,
        64,
        32,
    )
    assert not {"w_gate", "w_up", "w_down"} & set(loaded.params)
    assert (hf_dir / "model.safetensors.index.json").exists() == (name == "norm-untied")
    diffs = {"safetensors": max(assert_matches(loaded, ref, False), assert_matches(loaded, ref, True))}
    # the routing matters: the other top-k normalization moves the logits far past the bound
    other = dataclasses.replace(
        loaded, config=dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
    )
    assert np.abs(our_logits(other, IDS) - ref).max() > 1e-2

    write_fused(model, hf_dir, tmp_path / "fused")
    diffs["fused"] = assert_matches(load_model(tmp_path / "fused", with_tokenizer=False), ref)

    from_gguf = load_model(gguf_path, with_tokenizer=False)
    assert (
        dataclasses.replace(from_gguf.config, rms_norm_eps=1e-6) == cfg
    )  # GGUF keeps the epsilon as a float32
    diffs["gguf"] = assert_matches(from_gguf, ref)

    convert(hf_dir, tmp_path / "ckpt", with_tokenizer=False)
    assert checkpoint.is_checkpoint(tmp_path / "ckpt")
    restored = load_model(tmp_path / "ckpt", with_tokenizer=False)
    assert restored.config == cfg
    diffs["orbax"] = assert_matches(restored, ref)
    figure(f"qwen3_moe {name}: max |d logit|, |d logprob| vs transformers (fp32, 40 tokens): "
           + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))  # fmt: skip


def test_routing_picks_the_experts_transformers_picks(qwen3_moe):
    """At every position of every layer, our router's top-k experts (in order) are transformers' (positions whose
    k-th and (k+1)-th probabilities are within 1e-5 of each other, ties, aside: none here)."""
    _, hf_dir, _, model = qwen3_moe
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([IDS]), output_router_logits=True)
    ref_probs = [torch.softmax(r.float(), dim=-1).numpy() for r in out.router_logits]  # per layer [T, E]
    assert len(ref_probs) == model.config.num_hidden_layers

    seen = []
    route = moe.route

    def recording(h, *args, **kwargs):
        weights, experts = route(h, *args, **kwargs)
        seen.append(np.asarray(experts))
        return weights, experts

    loaded = load_model(hf_dir, with_tokenizer=False)
    moe.route = recording
    try:
        our_logits(loaded, IDS, scan_layers=False)  # eager, unrolled: one call per layer, concrete arrays
    finally:
        moe.route = route
    assert len(seen) == len(ref_probs)
    for layer, (ours, probs) in enumerate(zip(seen, ref_probs)):
        ranked = np.argsort(-probs, axis=-1, kind="stable")
        margin = np.take_along_axis(probs, ranked[:, k - 1 : k], -1) - np.take_along_axis(
            probs, ranked[:, k : k + 1], -1
        )
        clear = margin[:, 0] > 1e-5
        assert clear.all(), f"layer {layer}: near-ties at positions {np.flatnonzero(~clear)}"
        np.testing.assert_array_equal(ours, ranked[:, :k], err_msg=f"layer {layer}")
        assert len(np.unique(ours)) > k  # the positions do not all go to the same experts


@pytest.mark.parametrize("qwen3_moe", ["norm-untied"], indirect=True)
def test_greedy_continuations_through_the_engine_equal_transformers(qwen3_moe):
    """16 greedy tokens after each of two prompts (decoded side by side), and each token's logprob, equal to
    transformers' greedy search and logprobs."""
    _, hf_dir, _, model = qwen3_moe
    loaded = load_model(hf_dir, with_tokenizer=False)
    engine = JaxEngine(loaded, engine_config(slots=2, max_seq_len=64, min_batch_bucket=2, kv_pages=16))
    prompts = [IDS[:21], IDS[5:12]]
    got, _ = run_engine(
        engine, [(slot, p, SlotParams(max_tokens=16, temperature=0.0)) for slot, p in enumerate(prompts)]
    )
    for slot, prompt in enumerate(prompts):
        ids, logprobs = list(prompt), []
        for _ in range(16):
            lp = log_softmax(reference_logits(model, ids)[-1])
            ids.append(int(lp.argmax()))
            logprobs.append(lp[ids[-1]])
        assert got[slot][0] == ids[len(prompt) :], f"prompt {slot}"
        assert np.abs(np.asarray(got[slot][1]) - logprobs).max() < BOUND


@pytest.mark.parametrize("qwen3_moe", ["norm-untied"], indirect=True)
def test_int8_experts_load_run_and_round_trip(qwen3_moe, tmp_path, figure):
    """`--quantization int8` quantizes each expert per output channel ([L, E, out, 1] scales; the router stays
    float); quantized at load and restored from `convert --quantization int8`, the logits are the same, near the
    fp32 model's."""
    _, hf_dir, _, model = qwen3_moe
    at_load = load_model(hf_dir, with_tokenizer=False, quantization="int8")
    for name, shape in (("we_gate", (2, 8, 32, 1)), ("we_up", (2, 8, 32, 1)), ("we_down", (2, 8, 64, 1))):
        w = at_load.params[name]
        assert is_quantized(w) and w.q.dtype == np.int8 and w.scale.shape == shape, name
    assert not is_quantized(at_load.params["w_router"])
    convert(hf_dir, tmp_path / "int8", with_tokenizer=False, quantization="int8")
    restored = load_model(tmp_path / "int8", with_tokenizer=False)
    assert restored.quantization == "int8"
    ours = our_logits(at_load, IDS)
    np.testing.assert_array_equal(our_logits(restored, IDS), ours)
    drift = np.abs(log_softmax(ours) - log_softmax(reference_logits(model, IDS))).max()
    assert drift < 5e-2
    figure(f"qwen3_moe int8: max |d logprob| vs transformers fp32 {drift:.1e}")


@pytest.mark.parametrize("qwen3_moe", ["norm-untied"], indirect=True)
def test_quantized_gguf_experts_are_kept_in_their_blocks(qwen3_moe, tmp_path):
    """A GGUF whose stacked expert tensors are Q8_0 (gate, up) and Q4_0 (down): `keep` (the GGUF default) serves
    them from their blocks ([L, E, out, in] quantized matrices), with the logits of the same file dequantized at
    load, and close to transformers' fp32."""
    _, _, _, model = qwen3_moe
    T = gguf.GGMLQuantizationType
    path = tmp_path / "q.gguf"
    write_gguf(model, path, {"gate": T.Q8_0, "up": T.Q8_0, "down": T.Q4_0})
    kept = load_model(path, with_tokenizer=False)
    assert kept.quantization == "keep"
    assert kept.params["we_gate"].kind == "Q8_0" and kept.params["we_gate"].q.shape == (2, 8, 32, 64)
    assert kept.params["we_down"].kind == "Q4_0" and kept.params["we_down"].shape == (2, 8, 64, 32)
    ours = our_logits(kept, IDS)
    np.testing.assert_allclose(ours, our_logits(load_model(path, with_tokenizer=False, quantization="none"), IDS),
                               rtol=0, atol=1e-6)  # fmt: skip
    # 4-bit down matrices on these tiny random experts: logprobs within about 0.2 of fp32 (not a fidelity bound)
    assert np.abs(log_softmax(ours) - log_softmax(reference_logits(model, IDS))).max() < 0.5


@pytest.mark.parametrize("kernel", [None, "tiles", "ragged"])
def test_one_tokens_moe_output_is_bit_identical_alone_and_in_a_batch(kernel):
    """The jitted MoE layer (the backend's default kernel, and each CPU kernel): a token's output alone, among 8
    and among 64 (at another row), bit for bit."""
    rng = np.random.default_rng(0)
    E, H, Ie = 8, 64, 32
    router = jnp.asarray(rng.normal(size=(E, H)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2, Ie, H)) * 0.1, jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, H, Ie)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(64, H)), jnp.float32)
    layer = jax.jit(functools.partial(moe.moe_mlp, top_k=2, norm_topk_prob=True, kernel=kernel))
    alone = np.asarray(layer(x[:1], router, gate_up, down))[0]
    for n in (8, 64):
        batch = jnp.roll(x[:n], 5, axis=0)  # the token at row 5
        np.testing.assert_array_equal(
            np.asarray(layer(batch, router, gate_up, down))[5], alone, err_msg=str(n)
        )


def test_tiles_kernel_equals_ragged_dot_and_is_position_invariant():
    """The "tiles" kernel (CPU) against `jax.lax.ragged_dot_general`, fp32 and int8 per-channel experts, 1 to 200
    tokens (groups from empty to many tiles); and a token's output bit for bit the same at any row of any batch
    (its pairs at every position of their tiles), for tiles of 2, 4 and 8 rows."""
    rng = np.random.default_rng(4)
    E, H, Ie, k = 8, 64, 32, 2
    router = jnp.asarray(rng.normal(size=(E, H)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2, Ie, H)) * 0.1, jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, H, Ie)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.normal(size=(200, H)), jnp.float32)
    int8 = (quantize_int8(gate_up), quantize_int8(down))  # per output channel: scales [E, *out, 1]
    assert all(w.scale.shape[-1] == 1 for w in int8)

    def layer(kernel):
        return jax.jit(functools.partial(moe.moe_mlp, top_k=k, norm_topk_prob=True, kernel=kernel))

    weights, sizes = ((gate_up, down), int8), (1, 2, 7, 64, 200)
    # "ragged" reads no TILE_ROWS: its outputs, computed once, are every tile size's reference
    ragged = layer("ragged")
    reference = {(w, n): np.asarray(ragged(x[:n], router, gu, dn)) for w, (gu, dn) in enumerate(weights)
                 for n in sizes}  # fmt: skip
    for rows in (2, 4, 8):
        moe_rows, moe.TILE_ROWS = moe.TILE_ROWS, rows  # read when the layer is traced
        try:
            tiles = layer("tiles")
            for w, (gu, dn) in enumerate(weights):
                alone = np.asarray(tiles(x[:1], router, gu, dn))[0]
                for n in sizes:
                    got = np.asarray(tiles(x[:n], router, gu, dn))
                    np.testing.assert_allclose(got, reference[w, n], rtol=0, atol=2e-6,
                                               err_msg=f"R {rows}, {n} tokens")  # fmt: skip
                    for shift in sorted({0, 1, 3, n // 2} & set(range(1, n))):
                        moved = np.asarray(tiles(jnp.roll(x[:n], shift, axis=0), router, gu, dn))[shift]
                        np.testing.assert_array_equal(
                            moved, alone, err_msg=f"R {rows}, {n} tokens, row {shift}"
                        )
        finally:
            moe.TILE_ROWS = moe_rows


def test_megablox_in_the_tpu_interpreter_equals_ragged_dot(qwen3_moe):
    """A layer's experts through jax's Pallas megablox `gmm` (run by the TPU interpreter on CPU) and through
    `jax.lax.ragged_dot_general`: the same outputs, for a batch of 1, 7 and 64 tokens (rows padded to the kernel's
    tile)."""
    _, hf_dir, _, _ = qwen3_moe
    loaded = load_model(hf_dir, with_tokenizer=False)
    p = module_params(loaded.config, loaded.params, scan_layers=False)["layers"][1]
    cfg = loaded.config
    rng = np.random.default_rng(2)

    def layer(kernel):
        return jax.jit(functools.partial(moe.moe_mlp, top_k=cfg.num_experts_per_tok,
                                         norm_topk_prob=cfg.norm_topk_prob, kernel=kernel))  # fmt: skip

    for n in (1, 7, 64):
        h = jnp.asarray(rng.normal(size=(n, cfg.hidden_size)), jnp.float32)
        ragged = np.asarray(layer("ragged")(h, p["w_router"], p["we_gate_up"], p["we_down"]))
        with pltpu.force_tpu_interpret_mode():
            mega = np.asarray(layer("megablox")(h, p["w_router"], p["we_gate_up"], p["we_down"]))
        np.testing.assert_allclose(mega, ragged, rtol=0, atol=1e-6, err_msg=str(n))


@pytest.mark.parametrize("qwen3_moe", ["norm-untied"], indirect=True)
def test_tensor_parallel_on_a_2x2_mesh(qwen3_moe):
    """Experts split over the mesh's "model" axis (their intermediate axis, like a dense MLP's): the model's logits
    within the tensor-parallel bound of one device's, the layer's three kernels (megablox in the TPU interpreter)
    under shard_map, and the engine's greedy tokens equal."""
    assert len(jax.devices()) >= 4, "tests/conftest.py sets --xla_force_host_platform_device_count=4"
    _, hf_dir, _, model = qwen3_moe
    mesh = make_mesh(model_parallel=2, data_parallel=2)
    one = load_model(hf_dir, with_tokenizer=False)
    sharded = load_model(hf_dir, with_tokenizer=False, mesh=mesh)
    for name in ("we_gate", "we_up"):  # [L, E, Ie, H]
        assert sharded.params[name].sharding.spec[2] == "model", name
    assert sharded.params["we_down"].sharding.spec[3] == "model"  # [L, E, H, Ie]
    m = sharded.module(mesh=mesh)
    assert m.expert_mesh == mesh
    np.testing.assert_allclose(
        our_logits(sharded, IDS, mesh=mesh), our_logits(one, IDS), rtol=0, atol=TP_BOUND
    )
    assert_matches(sharded, reference_logits(model, IDS), mesh=mesh)

    cfg = one.config
    p1 = module_params(cfg, one.params, scan_layers=False)["layers"][0]
    pm = jax.tree.map(lambda a: a[0], m.layers.arrays())
    h = jnp.asarray(np.random.default_rng(3).normal(size=(6, cfg.hidden_size)), jnp.float32)
    args = (cfg.num_experts_per_tok, cfg.norm_topk_prob)
    want = np.asarray(moe.moe_mlp(h, p1["w_router"], p1["we_gate_up"], p1["we_down"], *args, kernel="ragged"))
    for kernel in ("tiles", "ragged", "megablox"):
        with pltpu.force_tpu_interpret_mode():
            got = jax.jit(functools.partial(moe.moe_mlp, top_k=args[0], norm_topk_prob=args[1], mesh=mesh,
                                            kernel=kernel))(h, pm["w_router"], pm["we_gate_up"], pm["we_down"])  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=TP_BOUND, err_msg=kernel)

    settings = engine_config(slots=2, max_seq_len=64, min_batch_bucket=2, kv_pages=16)
    params = SlotParams(max_tokens=8, temperature=0.0)
    alone, _ = run_engine(JaxEngine(one, settings), [(0, IDS[:13], params)])
    tp, _ = run_engine(JaxEngine(sharded, settings, mesh=mesh), [(1, IDS[:13], params)])
    assert tp[1][0] == alone[0][0]
    assert np.abs(np.array(tp[1][1]) - np.array(alone[0][1])).max() < TP_BOUND


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mlp_only_layers": [1]}, r"dense MLP layers \[1\] .* every layer must be a MoE layer"),
        ({"decoder_sparse_step": 2}, r"dense MLP layers \[0\] .* every layer must be a MoE layer"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 with 8 experts"),
    ],
    ids=["mlp-only-layers", "sparse-step", "top-k-past-experts"],
)
def test_unsupported_moe_layouts_are_refused(tmp_path, fields, message):
    config = {"model_type": "qwen3_moe", **BASE, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path, with_tokenizer=False)

"""Weights kept quantized (tpuserve.model.quant): GGUF blocks served as they are (`keep`) give the dequantized
model's logprobs; int8 per channel; weight bytes; refusals that name the mode and the tensor type."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from tpuserve.model.config import ModelLoadError
from tpuserve.model.gguf_file import tensor_array, tensor_quantized
from tpuserve.model.llama import init_cache
from tpuserve.model.loader import load_model
from tpuserve.model.quant import QuantizedMatrix, is_quantized, linear, quantize_int8, to_planar

from tests.model.test_gguf_reference import TEXT, teacher_forced

# Byte offsets of each type's float16 scale fields in a block (set to small finite values in random blocks).
_F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q6_K: [208], T.Q5_0: [0]}


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes as `rows` rows of `qtype` blocks ([rows, bytes per row]), every scale a small finite float16."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for start in _F16_FIELDS[qtype]:
        d = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, start : start + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K])
def test_blocks_dequantize_bit_identical_to_gguf(qtype: T) -> None:
    """Every bit pattern of a block (random bytes) dequantizes inside a jitted program to exactly what the gguf
    package's dequantizer gives."""
    rows, cols = 6, 512
    data = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    tensor = types.SimpleNamespace(name="t", tensor_type=qtype, shape=[cols, rows], data=data)
    expected = tensor_array(tensor, pathlib.Path("t.gguf"))
    kept = tensor_quantized(tensor, pathlib.Path("t.gguf"))
    got = jax.jit(lambda m: m.dequantize())(jax.tree.map(jnp.asarray, kept))
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert kept.nbytes <= 0.32 * expected.nbytes, (qtype.name, kept.nbytes / expected.nbytes)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_row_halves_give_the_block_orders_weights_and_products(qtype: T) -> None:
    """XLA:CPU's layout of 4-bit values (quant.to_planar: byte j of a row holds input j and input j + in/2) holds the
    same bytes and gives the GGUF block order's weights and products bit for bit, on 2 rows and on 64."""
    rows, cols = 96, 1536
    data = random_blocks(qtype, rows, cols, np.random.default_rng(7 + int(qtype)))
    tensor = types.SimpleNamespace(name="t", tensor_type=qtype, shape=[cols, rows], data=data)
    blocks = tensor_quantized(tensor, pathlib.Path("t.gguf"))
    halves = to_planar(blocks)
    assert (blocks.bits, blocks.planar, halves.planar) == (4, False, True)
    assert halves.nbytes == blocks.nbytes and halves.shape == blocks.shape == (rows, cols)
    assert not np.array_equal(halves.q, blocks.q)  # another byte order
    expected = tensor_array(tensor, pathlib.Path("t.gguf"))
    on_device = jax.tree.map(jnp.asarray, halves)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda m: m.dequantize())(on_device)), expected)
    product = jax.jit(linear)
    x = np.random.default_rng(0).standard_normal((64, cols)).astype(np.float32)
    for n in (2, 64):
        ours, block_order = product(x[:n], on_device), product(x[:n], jax.tree.map(jnp.asarray, blocks))
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(block_order))
    assert to_planar(halves) is halves and to_planar(expected) is expected


def test_an_unsharded_cpu_module_holds_row_halves_a_sharded_one_the_block_order(embedded) -> None:
    """Row halves keep the input axis whole, so only a module without a mesh uses them."""
    from tpuserve.model.sharding import make_mesh

    def four_bit(module) -> list[QuantizedMatrix]:
        leaves = jax.tree.leaves(nnx.state(module, nnx.Param), is_leaf=is_quantized)
        return [w for w in leaves if is_quantized(w) and w.bits == 4]

    plain, sharded = four_bit(embedded.module()), four_bit(embedded.module(mesh=make_mesh(1)))
    assert len(plain) == len(sharded) == 4  # the stacked Q/K/V, O, gate/up and down products (Q4_1)
    assert all(w.planar for w in plain) and not any(w.planar for w in sharded)


# -- a tiny Llama GGUF whose matrices mix the kept types across layers -----------------------------------------

H, I, V, L = 256, 512, 320, 2  # K-quant blocks span 256 inputs


def write_tiny_gguf(path: pathlib.Path, types_by_layer: list[dict[str, T]], embed: T = T.Q8_0) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)

    def matrix(name: str, rows: int, cols: int, qtype: T) -> None:
        if qtype == T.F32:
            w.add_tensor(name, rng.normal(0, 0.05, (rows, cols)).astype(np.float32))
        else:
            w.add_tensor(name, random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)

    matrix("token_embd.weight", V, H, embed)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    shapes = {"attn_q": (H, H), "attn_k": (H // 2, H), "attn_v": (H // 2, H), "attn_output": (H, H),
              "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}  # fmt: skip
    for i, kinds in enumerate(types_by_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        for name, (rows, cols) in shapes.items():
            matrix(f"blk.{i}.{name}.weight", rows, cols, kinds.get(name, T.Q4_K))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


MIXED = [  # a Q4_K_M-like mix: Q6_K attn_v / ffn_down in one layer, Q4_K in the other; every kept type somewhere
    {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "ffn_up": T.Q8_0},
    {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q4_K, "ffn_gate": T.F32},
]


def logprobs(loaded, ids: list[int], scan_layers: bool = True) -> np.ndarray:
    m = loaded.module(scan_layers=scan_layers)
    T_ = len(ids)
    hidden, _ = jax.jit(lambda toks: m(toks, jnp.arange(T_)[None], init_cache(loaded.config, 1, T_), T_))(
        jnp.asarray([ids])
    )
    return np.asarray(jax.nn.log_softmax(m.logits(hidden[0]), axis=-1))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_keep_mixed_types_equals_dequantized_model(tmp_path: pathlib.Path, scan_layers: bool) -> None:
    """Kept blocks of every type, mixed across layers and within the fused Q/K/V and gate/up products, give the
    logprobs of the model dequantized at load."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, MIXED)
    dense = load_model(path, with_tokenizer=False, quantization="none")
    kept = load_model(path, with_tokenizer=False, quantization="keep")
    assert (
        kept.quantization == "keep" and is_quantized(kept.params["wq"]) and is_quantized(kept.params["embed"])
    )
    assert kept.weight_bytes < 0.5 * dense.weight_bytes  # mixed types share one (wider) storage per matrix
    ids = list(range(3, 40))
    ref, got = logprobs(dense, ids, scan_layers), logprobs(kept, ids, scan_layers)
    assert np.isfinite(ref).all()
    # Equal weights; inside one jitted program XLA may sum these small products in another order (logits reach
    # ~160 here: 2e-4 is a relative 1e-6). The embedded model's are bit-identical (test below).
    np.testing.assert_allclose(got, ref, atol=5e-4, rtol=0)


def lowered_dots(loaded, T_: int = 8) -> list[str]:
    """The dot_general lines of the lowered forward pass and logits over T_ tokens."""
    m = loaded.module()
    fwd = jax.jit(
        lambda toks: m.logits(m(toks, jnp.arange(T_)[None], init_cache(loaded.config, 1, T_), T_)[0])
    )
    return [
        line
        for line in fwd.lower(jnp.zeros((1, T_), jnp.int32)).as_text().splitlines()
        if "dot_general" in line
    ]


def test_fp32_products_ask_for_highest_precision(tmp_path: pathlib.Path) -> None:
    """Every product of a fp32 model, kept blocks or not, is lowered at HIGHEST precision (quant.precision): JAX's
    default lets a GPU use TF32 (an H200 moved the embedded model's logprobs by 4.1e-2, bench/device.py) and a
    TPU bf16 passes. XLA:CPU computes the same either way, so this reads the lowered program; bf16 keeps the
    default."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, MIXED)
    dense = load_model(path, with_tokenizer=False, quantization="none")
    kept = load_model(path, with_tokenizer=False, quantization="keep")
    bf16 = dataclasses.replace(dense, params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), dense.params))
    for loaded, want in (
        (dense, "[HIGHEST, HIGHEST]"),
        (kept, "[HIGHEST, HIGHEST]"),
        (bf16, "[DEFAULT, DEFAULT]"),
    ):
        dots = lowered_dots(loaded)
        assert len(dots) >= 6 and all(f"precision = {want}" in line for line in dots), dots


def test_keep_refuses_an_unsupported_gguf_type(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, [{"ffn_up": T.Q5_0}, {}])
    with pytest.raises(
        ModelLoadError, match=r"quantization 'keep' cannot serve tensor blk\.0\.ffn_up\.weight of type Q5_0"
    ):
        load_model(path, with_tokenizer=False, quantization="keep")
    assert load_model(path, with_tokenizer=False, quantization="none").quantization == "none"  # dequantized


# -- the embedded model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_dense():
    return load_model(quantization="none")


def test_keep_embedded_logprobs_match_transformers(embedded, embedded_dense, hf_reference, figure) -> None:
    """The GGUF is the model: its blocks served as they are (the default for a GGUF) give transformers' logprobs on
    the same file, bit-identical to the model dequantized at load, in 0.3x the bytes."""
    embedded_keep = embedded
    assert embedded_keep.quantization == "keep"
    from tests.helpers import require_extra

    torch = require_extra("torch")
    hf_model, _ = hf_reference
    ids = embedded.tokenizer.encode(TEXT)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1).numpy()
    ours = teacher_forced(embedded_keep, ids)
    diff = np.abs(ours - ref).max()
    dense_diff = np.abs(ours - teacher_forced(embedded_dense, ids)).max()
    ratio = embedded_keep.weight_bytes / embedded_dense.weight_bytes
    figure(f"keep: max |logprob diff| vs transformers {diff:.2e}, vs dequantized {dense_diff:.2e}; "
          f"weights {embedded_keep.weight_bytes / 2**20:.1f} MiB = {ratio:.3f}x fp32")  # fmt: skip
    assert diff < 2e-4
    assert dense_diff < 1e-5
    assert ratio <= 0.3


def test_keep_programs_hold_no_fp32_copy_of_the_weights(embedded, figure) -> None:
    """Dequantization happens inside the program, a layer (and the tied embedding) at a time: the compiled
    decode step's scratch memory is far below the weights' fp32 size."""
    from flax import nnx

    embedded_keep = embedded
    m = embedded_keep.module()
    graphdef, state = nnx.split(m)
    B = 8

    def step(state, tokens, positions, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache = model(tokens, positions, cache, 128)
        return model.logits(hidden), cache

    args = (
        jnp.zeros((B, 1), jnp.int32),
        jnp.zeros((B, 1), jnp.int32),
        init_cache(embedded_keep.config, B, 128),
    )
    compiled = jax.jit(step).lower(state, *args).compile()
    fp32_bytes = sum(
        int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(embedded_keep.params, is_leaf=is_quantized)
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    figure(f"keep: decode step scratch {temp / 2**20:.1f} MiB vs fp32 weights {fp32_bytes / 2**20:.1f} MiB")
    assert temp < 0.05 * fp32_bytes  # measured 13.6 of 513 MiB (the tied embedding in 9 MiB chunks)


def test_int8_convert_embedded_drift(embedded_dense, tmp_path: pathlib.Path, figure) -> None:
    """`tpuserve convert --quantization int8` on the embedded model: an Orbax checkpoint of int8 matrices that
    loads as int8 (0.25x fp32 bytes) and whose logprobs drift from the unquantized model's by a measured amount."""
    from tpuserve.cli.main import main as cli_main

    dst = tmp_path / "smollm2-int8"
    assert cli_main(["convert", "embedded", str(dst), "--quantization", "int8"]) == 0
    q = load_model(dst)
    assert q.quantization == "int8" and is_quantized(q.params["w_down"]) and q.params["w_down"].kind == "int8"
    assert q.weight_bytes < 0.27 * embedded_dense.weight_bytes
    ids = embedded_dense.tokenizer.encode(TEXT)
    ref, got = teacher_forced(embedded_dense, ids), teacher_forced(q, ids)
    chosen = np.arange(len(ids) - 1), np.asarray(ids[1:])
    tf = np.abs(got[:-1][chosen] - ref[:-1][chosen])
    kl = (np.exp(ref) * (ref - got)).sum(-1)
    figure(
        f"int8 (embedded, {len(ids)} tokens): teacher-forced |dlogprob| mean {tf.mean():.3f} max {tf.max():.3f}; "
        f"KL mean {kl.mean():.4f} max {kl.max():.4f}; top-1 agreement {(ref.argmax(-1) == got.argmax(-1)).mean():.3f}"
    )
    assert (
        tf.mean() < 0.3 and kl.mean() < 0.05
    )  # docs/engine.md "Quantized weights" states the measured figures
    with pytest.raises(
        ModelLoadError, match=r"quantization 'none' cannot load this checkpoint: it holds int8"
    ):
        load_model(dst, quantization="none")


def test_int8_matches_its_own_dequantization() -> None:
    """The per-channel product (scale applied to the output) equals the product with the dequantized matrix."""
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.1, (48, 64)).astype(np.float32)
    qm = quantize_int8(w)
    assert isinstance(qm, QuantizedMatrix) and qm.q.dtype == np.int8 and qm.scale.shape == (48, 1)
    np.testing.assert_allclose(np.asarray(qm.dequantize()), w, atol=float(np.abs(w).max()) / 254 + 1e-7)
    from tpuserve.model.quant import linear

    x = jnp.asarray(rng.normal(size=(3, 64)).astype(np.float32))
    device_q = jax.tree.map(jnp.asarray, qm)
    np.testing.assert_allclose(np.asarray(linear(x, device_q)), np.asarray(x @ device_q.dequantize().T), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    on_device = quantize_int8(jnp.asarray(w))  # quantized where the array lives
    np.testing.assert_array_equal(np.asarray(on_device.q), qm.q)

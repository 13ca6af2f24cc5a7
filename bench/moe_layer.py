"""One decoder layer's decode step, MoE against dense, in process: a Qwen3-MoE layer (E experts of Ie, k per token)
and a dense Qwen3 layer whose MLP has the same active parameters (intermediate k * Ie), same attention, random fp32
weights, jitted, best of N calls (the kernels and the dense layer interleaved, so a noisy box moves them alike).
Prints each time and the ratio MoE / dense per batch size and MoE kernel (model/moe.py), for the whole layer and
for the MLP alone (the routed experts against one SwiGLU product pair).

  .venv-test/bin/python bench/moe_layer.py [--hidden 768 --experts 32 --top-k 4 --moe-inter 256 --rows 1 8 64
                                            --kernels tiles ragged --tile-rows 8]

Kernels: "ragged" is `jax.lax.ragged_dot_general`, which XLA:CPU lowers to one dense product over every expert
with the rows of other experts masked, so a step reads (and multiplies by) all E experts; "tiles" (the CPU
default) pads each expert's rows to tiles of R rows and loops over the non-empty tiles only, one [R, in] x
[in, out] product per tile on its expert's matrix. `--tile-rows` sets R (a list: each is a kernel "tiles/R").
Results: docs/engine.md, "Mixture of experts (Qwen3-MoE)"."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tpuserve.model import moe
from tpuserve.model.config import ModelConfig
from tpuserve.model.llama import Llama, init_cache, module_params, param_shapes
from tpuserve.model.quant import linear


def best_of(fn, n: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def random_params(cfg: ModelConfig, seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        scale = 1.0 if "norm" in name else 1.0 / np.sqrt(shape[-1])
        out[name] = jnp.asarray(
            rng.normal(size=shape) * scale + (1.0 if "norm" in name else 0.0), jnp.float32
        )
    return out


def layer_step(cfg: ModelConfig, rows: int, context: int):
    """A call of one jitted decode step (T = 1) of a one-layer model over `rows` rows attending `context`
    positions (compiled under the MoE kernel set at the time: `with_kernel`)."""
    graph, state = nnx.split(Llama(cfg, module_params(cfg, random_params(cfg, 0), scan_layers=False)))
    cache = init_cache(cfg, rows, context)
    # distinct tokens, so the rows route to different experts (identical rows would all pick the same k)
    tokens = (jnp.arange(rows, dtype=jnp.int32)[:, None] * 37) % cfg.vocab_size
    positions = jnp.full((rows, 1), context - 1, jnp.int32)
    # the weights are arguments (as the engine passes them), not constants XLA could fold
    step = jax.jit(lambda state, tokens, positions, cache: nnx.merge(graph, state)(tokens, positions, cache,
                                                                                  context)[0])  # fmt: skip
    call = functools.partial(step, state, tokens, positions, cache)
    jax.block_until_ready(call())  # compile now, under the kernel set now
    return call


def mlp_calls(cfg: ModelConfig, dense: ModelConfig, rows: int, kernels: list[str]) -> dict:
    """The MLP alone: a call of the routed experts per kernel and of the dense SwiGLU."""
    p = module_params(cfg, random_params(cfg, 1), scan_layers=False)["layers"][0]
    d = module_params(dense, random_params(dense, 1), scan_layers=False)["layers"][0]
    h = jnp.asarray(np.random.default_rng(2).normal(size=(rows, cfg.hidden_size)), jnp.float32)

    def swiglu(h, d):
        gate_up = linear(h, d["w_gate_up"])
        return linear(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], d["w_down"])

    calls = {"dense": functools.partial(jax.jit(swiglu), h, d)}
    for name in kernels:
        kernel = name.partition("/")[0]
        routed = jax.jit(functools.partial(moe.moe_mlp, top_k=cfg.num_experts_per_tok,
                                           norm_topk_prob=cfg.norm_topk_prob, kernel=kernel))  # fmt: skip
        with with_kernel(name):
            jax.block_until_ready(routed(h, p["w_router"], p["we_gate_up"], p["we_down"]))
        calls[name] = functools.partial(routed, h, p["w_router"], p["we_gate_up"], p["we_down"])
    return calls


@contextlib.contextmanager
def with_kernel(name: str):
    """Trace under MoE kernel `name` ("ragged", "tiles", "tiles/R"): the default kernel and tile rows set."""
    kernel, _, tile_rows = name.partition("/")
    saved = moe.default_kernel, moe.TILE_ROWS
    moe.default_kernel = lambda: kernel
    moe.TILE_ROWS = int(tile_rows or moe.TILE_ROWS)
    try:
        yield
    finally:
        moe.default_kernel, moe.TILE_ROWS = saved


def interleaved(calls: dict, n: int, rounds: int = 3) -> dict:
    """Best seconds of each call over `rounds` rounds of n calls, the calls taking turns."""
    best = {}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best.get(name, float("inf")), best_of(call, n))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", nargs="+", default=["tiles", "ragged"])
    ap.add_argument(
        "--tile-rows", type=int, nargs="+", default=[moe.TILE_ROWS], help='the "tiles" kernel\'s R'
    )
    args = ap.parse_args()
    kernels = []
    for k in args.kernels:
        kernels += [f"tiles/{r}" for r in args.tile_rows] if k == "tiles" else [k]
    heads = args.hidden // 64
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=256, hidden_size=args.hidden, intermediate_size=0,
                      num_layers=1, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64, qk_norm=True,
                      num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_inter, norm_topk_prob=True)  # fmt: skip
    dense = dataclasses.replace(cfg, architecture="qwen3", intermediate_size=args.top_k * args.moe_inter,
                                num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                norm_topk_prob=False)  # fmt: skip
    print(f"backend {jax.default_backend()}; H {args.hidden}, {args.experts} experts of {args.moe_inter}, top-{args.top_k}"
          f" (dense: intermediate {args.top_k * args.moe_inter}); best of {args.rounds} x {args.calls} calls,"
          f" interleaved; load average {pathlib.Path('/proc/loadavg').read_text().split()[0]}")  # fmt: skip
    for rows in args.rows:
        layers = {"dense": layer_step(dense, rows, args.context)}
        for name in kernels:
            with with_kernel(name):
                layers[name] = layer_step(cfg, rows, args.context)
        layer_t = interleaved(layers, args.calls, args.rounds)
        mlp_t = interleaved(mlp_calls(cfg, dense, rows, kernels), args.calls, args.rounds)
        print(
            f"rows {rows:3d}: dense layer {layer_t['dense'] * 1e3:7.3f} ms, MLP {mlp_t['dense'] * 1e3:7.3f} ms"
        )
        for name in kernels:
            print(f"  MoE {name:8s} layer {layer_t[name] * 1e3:8.3f} ms, ratio {layer_t[name] / layer_t['dense']:6.2f};"
                  f" MLP alone {mlp_t[name] * 1e3:8.3f} ms, ratio {mlp_t[name] / mlp_t['dense']:6.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

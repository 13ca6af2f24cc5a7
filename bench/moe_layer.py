"""One decoder layer's decode step, MoE against dense, in process: a Qwen3-MoE layer (E experts of Ie, k per token)
and a dense Qwen3 layer whose MLP has the same active parameters (intermediate k * Ie), same attention, random fp32
weights, jitted, best of N calls. Prints each time and the ratio MoE / dense per batch size, for the whole layer
and for the MLP alone (model/moe.py's routed experts against one SwiGLU product pair).

  .venv-test/bin/python bench/moe_layer.py [--hidden 768 --experts 32 --top-k 4 --moe-inter 256 --rows 1 8 64]

The experts run as the backend's grouped product (model/moe.py: `jax.lax.ragged_dot_general` off TPU). On XLA:CPU
that product has no grouped kernel: jax lowers it to one dense product over every expert with the rows of other
experts masked to zero, contracting over (expert, input) of the [E, out, in] stack, so a step reads (and multiplies
by) all E experts, not the k a token uses, and XLA transposes the stack for that product. TPU (megablox) and GPU
(XLA's ragged dot) visit only the groups that have rows.

Measured on the 2-core CPU box (XLA:CPU, fp32, defaults above, other work running beside it, so only the order of
magnitude holds): the layer's decode step MoE / dense 106x at 1 row, 29x at 8, 17x at 64 (MLP alone 311x / 93x /
43x); with 8 experts of 128, top-2, H 256: 9.5x / 4.6x / 2.3x. The 1.5x target is not met on CPU."""

from __future__ import annotations

import argparse
import dataclasses
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


def layer_step(cfg: ModelConfig, rows: int, context: int, n: int) -> float:
    """Seconds of one jitted decode step (T = 1) of a one-layer model over `rows` rows attending `context`
    positions."""
    graph, state = nnx.split(Llama(cfg, module_params(cfg, random_params(cfg, 0), scan_layers=False)))
    cache = init_cache(cfg, rows, context)
    tokens = jnp.zeros((rows, 1), jnp.int32)
    positions = jnp.full((rows, 1), context - 1, jnp.int32)
    # the weights are arguments (as the engine passes them), not constants XLA could fold
    step = jax.jit(lambda state, tokens, positions, cache: nnx.merge(graph, state)(tokens, positions, cache,
                                                                                  context)[0])  # fmt: skip
    return best_of(lambda: step(state, tokens, positions, cache), n)


def mlp_only(cfg: ModelConfig, dense: ModelConfig, rows: int, n: int) -> tuple[float, float]:
    p = module_params(cfg, random_params(cfg, 1), scan_layers=False)["layers"][0]
    d = module_params(dense, random_params(dense, 1), scan_layers=False)["layers"][0]
    h = jnp.asarray(np.random.default_rng(2).normal(size=(rows, cfg.hidden_size)), jnp.float32)
    routed = jax.jit(lambda h, p: moe.moe_mlp(h, p["w_router"], p["we_gate_up"], p["we_down"],
                                              cfg.num_experts_per_tok, cfg.norm_topk_prob))  # fmt: skip

    def swiglu(h, d):
        gate_up = linear(h, d["w_gate_up"])
        return linear(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], d["w_down"])

    dense_fn = jax.jit(swiglu)
    return best_of(lambda: routed(h, p), n), best_of(lambda: dense_fn(h, d), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    heads = args.hidden // 64
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=256, hidden_size=args.hidden, intermediate_size=0,
                      num_layers=1, num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64, qk_norm=True,
                      num_experts=args.experts, num_experts_per_tok=args.top_k,
                      moe_intermediate_size=args.moe_inter, norm_topk_prob=True)  # fmt: skip
    dense = dataclasses.replace(cfg, architecture="qwen3", intermediate_size=args.top_k * args.moe_inter,
                                num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                norm_topk_prob=False)  # fmt: skip
    print(f"backend {jax.default_backend()}; H {args.hidden}, {args.experts} experts of {args.moe_inter}, top-{args.top_k}"
          f" (dense: intermediate {args.top_k * args.moe_inter}); best of {args.calls} calls")  # fmt: skip
    for rows in args.rows:
        t_moe, t_dense = layer_step(cfg, rows, args.context, args.calls), layer_step(dense, rows, args.context,
                                                                                      args.calls)  # fmt: skip
        m_moe, m_dense = mlp_only(cfg, dense, rows, args.calls)
        print(f"rows {rows:3d}: layer decode step MoE {t_moe * 1e3:7.3f} ms, dense {t_dense * 1e3:7.3f} ms, "
              f"ratio {t_moe / t_dense:5.2f}; MLP alone {m_moe * 1e3:7.3f} vs {m_dense * 1e3:7.3f} ms, "
              f"ratio {m_moe / m_dense:5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
